"""The Lightning adapter: the strategy classes (`PlanStrategy` and the named ones), their options, the registry
that makes every plan string a strategy name, and how Lightning's steps run (`steps`).

Importing this package imports no Lightning: `registry` must be importable before Lightning is (``import
strategies`` registers the plan names without importing torch); the classes load on first use.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "PlanStrategy": "strategies.lightning.strategy",
    "PlanOptions": "strategies.lightning.options",
    "NaiveDataParallelStrategy": "strategies.lightning.named",
    "DataParallelStrategy": "strategies.lightning.named",
    "ZeroStrategy": "strategies.lightning.named",
    "TensorParallelStrategy": "strategies.lightning.named",
    "PipelineStrategy": "strategies.lightning.named",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
