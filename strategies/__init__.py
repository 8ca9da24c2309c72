"""The strategy pack: distributed-training strategies for Lightning, named by one string.

    import lightning as L
    import strategies                       # makes every plan string a Lightning strategy name
    L.Trainer(strategy="zero3_tp2", devices=4, callbacks=[strategies.StrategyMonitor()])

Every plan string is a strategy (`ParallelPlan` has the grammar); the named classes (`DataParallelStrategy`,
`ZeroStrategy`, `TensorParallelStrategy`, `PipelineStrategy`...) spell one out. The layers, lowest first: `plan`
and `mesh`; `comm`; one package per technique (`data_parallel`, `zero`, `tensor_parallel`, `pipeline`,
`activation_checkpoint`); `checkpoint` files; the `lightning` adapter; `measure`; the `runs` store; `cli`.

Importing the package imports no torch: the names below load on first use, and the plan names reach Lightning's
registry as soon as Lightning is imported (`lightning.registry`).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from strategies.lightning.registry import register_with_lightning

register_with_lightning()

_EXPORTS = {
    "Axis": "strategies.comm",
    "CommStats": "strategies.comm",
    "Op": "strategies.comm",
    "BucketedDataParallel": "strategies.data_parallel",
    "NaiveDataParallel": "strategies.data_parallel",
    "PlanStrategy": "strategies.lightning",
    "PlanOptions": "strategies.lightning",
    "NaiveDataParallelStrategy": "strategies.lightning",
    "DataParallelStrategy": "strategies.lightning",
    "ZeroStrategy": "strategies.lightning",
    "TensorParallelStrategy": "strategies.lightning",
    "PipelineStrategy": "strategies.lightning",
    "ParallelMesh": "strategies.mesh",
    "DataMode": "strategies.plan",
    "ParallelPlan": "strategies.plan",
    "PipelineSchedule": "strategies.plan",
    "ShardedCheckpointIO": "strategies.checkpoint",
    "resumable": "strategies.lightning.resume",
    "FirstBatchMismatch": "strategies.lightning.first_batch",
    "load_pretrained": "strategies.lightning.pretrained",
    "ExportPretrained": "strategies.lightning.pretrained",
    "save_pretrained": "strategies.lightning.pretrained",
    "StrategyMonitor": "strategies.measure.monitor",
    "Colwise": "strategies.tensor_parallel",
    "Rowwise": "strategies.tensor_parallel",
    "VocabEmbedding": "strategies.tensor_parallel",
    "VocabHead": "strategies.tensor_parallel",
}
__all__ = sorted(_EXPORTS)

# Where the modules of the flat layout went (0.1's names; reached as attributes, with a DeprecationWarning).
_MOVED = {
    "estimate": "strategies.measure.estimate", "memory": "strategies.measure.memory",
    "monitor": "strategies.measure.monitor", "runstore": "strategies.runs", "registry": "strategies.lightning.registry",
    "options": "strategies.lightning.options", "sharded_checkpoint": "strategies.checkpoint.sharded",
    "checkpointing": "strategies.activation_checkpoint", "tp_plan": "strategies.tensor_parallel",
    "sequence_parallel": "strategies.tensor_parallel.sequence_parallel", "zero3": "strategies.zero.stage3",
    "zero_state": "strategies.zero.state", "compare": "strategies.cli.compare", "bench": "strategies.cli.bench",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a sub-package, as `strategies.pipeline`
        return importlib.import_module(f"{__name__}.{name}")
    if name in _MOVED or name == "Schedule":
        import warnings

        new = _MOVED.get(name, "strategies.PipelineSchedule")
        warnings.warn(f"strategies.{name} is now {new}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new) if name in _MOVED else __getattr__("PipelineSchedule")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
