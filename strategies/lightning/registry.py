"""Make Lightning's strategy registry answer for every plan string, not only for a fixed list of names.

Lightning looks a ``Trainer(strategy="...")`` name up in one registry object (``StrategyRegistry``, a dict of exact
names): the Trainer first checks ``name in StrategyRegistry.available_strategies()`` and then calls
``StrategyRegistry.get(name)``. Our grammar has unboundedly many names (``zero3_dp4_tp2_pp2_mb8``), so instead of
registering a grid of them, `install` switches that one object to a subclass whose membership test and ``get``
also accept any string shaped like a plan. Lightning's own names are looked up first and keep their meaning;
near-misses such as ``ddp_tp2`` are claimed so that the user gets our error, which suggests ``dp_tp2``, instead
of Lightning's generic one.

`register_with_lightning` does this as soon as Lightning's registry exists: at once if Lightning is imported, else
the moment it is. So ``import strategies`` costs no torch import (the dashboard and ``stratpack plan`` read the
pack without it), and a Trainer built later still finds every plan name.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any

_REGISTRY_MODULE = "lightning.pytorch.strategies"

def _named(class_name: str, **kwargs: Any) -> Any:
    """A registered name's strategy: the named class, imported when a Trainer asks for it."""
    from strategies.lightning import named

    return getattr(named, class_name)(**kwargs)


def install() -> None:
    """Idempotently make Lightning's registry plan-aware and register the names ``naive`` and ``dp``."""
    from lightning.pytorch.strategies import StrategyRegistry

    from strategies.lightning.aware_registry import PlanAwareRegistry as registry_class

    if not isinstance(StrategyRegistry, registry_class):
        # One shared object, so every module that imported it sees the change; the layouts are identical (both
        # are plain dict subclasses), which is what makes the class switch safe.
        StrategyRegistry.__class__ = registry_class
    for name, class_name, description in (
        ("naive", "NaiveDataParallelStrategy", "parameter-server data parallel (strategy pack)"),
        ("dp", "DataParallelStrategy", "bucketed, overlapped DDP (strategy pack)"),
    ):
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, functools.partial(_named, class_name), description=description)


class _InstallWhenImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when Lightning's registry module is about to load, it lets the other finders find it,
    and has its loader run `install` right after that module has run (then it steps out of the import system)."""

    def __init__(self) -> None:
        self._searching = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _REGISTRY_MODULE or self._searching:
            return None
        self._searching = True  # the search below asks every finder, this one too
        try:
            spec = next((found for finder in sys.meta_path if hasattr(finder, "find_spec")
                         and (found := finder.find_spec(name, path, target)) is not None), None)
        finally:
            self._searching = False
        if spec is None or spec.loader is None:
            return None
        loader, before = spec.loader, getattr(spec.loader, "__dict__", {}).get("exec_module")
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            if module.__name__ == _REGISTRY_MODULE:  # a loader may serve other modules too (a zip archive)
                if before is None:
                    del loader.exec_module
                else:
                    loader.exec_module = before
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                install()

        loader.exec_module = exec_module
        return spec


def register_with_lightning() -> None:
    """`install` now if Lightning's registry is loaded, else as soon as it is."""
    if _REGISTRY_MODULE in sys.modules:
        install()
    elif not any(isinstance(finder, _InstallWhenImported) for finder in sys.meta_path):
        sys.meta_path.insert(0, _InstallWhenImported())
