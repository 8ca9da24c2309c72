"""Make Lightning's strategy registry answer for every plan string, not only for a fixed list of names.

Lightning looks a ``Trainer(strategy="...")`` name up in one registry object (``StrategyRegistry``, a dict
of exact names): the Trainer first checks ``name in StrategyRegistry.available_strategies()`` and then calls
``StrategyRegistry.get(name)``. Our grammar has unboundedly many names (``zero3_dp4_tp2_pp2_mb8``), so
instead of registering a grid of them, `install()` switches that one object to a subclass whose membership
test and ``get`` also accept any string shaped like a plan. Lightning's own names are looked up first and
keep their meaning; near-misses such as ``ddp_tp2`` are claimed so that the user gets our error, which
suggests ``dp_tp2``, instead of Lightning's generic one.
"""

from __future__ import annotations

import re
from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import StrategyRegistry

from strategies.plan import ParallelPlan

_PLAN_TOKEN = re.compile(r"^(naive|dp|zero[123]|gpipe|1f1b|interleaved|ac|offload|(dp|tp|pp|v|mb)\d+)$")
_PLAN_HEAD = re.compile(r"^(naive|dp|zero|tp|pp)")


def looks_like_plan(name: Any) -> bool:
    """True for strings we should answer for: any plan token, or a head that starts like one."""
    if not isinstance(name, str) or not name:
        return False
    tokens = name.lower().split("_")
    return bool(_PLAN_HEAD.match(tokens[0])) or any(_PLAN_TOKEN.match(t) for t in tokens)


class _PlanNames(list):
    """Lightning's snapshot of registered names, extended to plan strings."""

    def __contains__(self, name: object) -> bool:
        return list.__contains__(self, name) or looks_like_plan(name)


class _PlanAwareRegistry(_StrategyRegistry):
    def available_strategies(self) -> list:
        return _PlanNames(self.keys())

    def get(self, name: str, default: Any = None) -> Any:
        name = name.lower() if isinstance(name, str) else name  # as the Trainer does before looking up
        if name in self.keys() or not looks_like_plan(name):
            return super().get(name, default)
        from strategies.lightning import PlanStrategy

        return PlanStrategy(ParallelPlan.parse(name))  # raises ValueError naming the bad token


def install() -> None:
    """Idempotently make Lightning's registry plan-aware and register the named strategy classes."""
    if not isinstance(StrategyRegistry, _PlanAwareRegistry):
        # One shared object, so every module that imported it sees the change; the layouts are identical
        # (both are plain dict subclasses), which is what makes the class switch safe.
        StrategyRegistry.__class__ = _PlanAwareRegistry
    from strategies.lightning import DataParallelStrategy, NaiveDataParallelStrategy

    for name, cls, description in (
        ("naive", NaiveDataParallelStrategy, "parameter-server data parallel (strategy pack)"),
        ("dp", DataParallelStrategy, "bucketed, overlapped DDP (strategy pack)"),
    ):
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=description)
