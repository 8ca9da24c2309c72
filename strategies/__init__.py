"""The strategy pack: distributed-training strategies for Lightning, named by one string.

    import lightning as L
    import strategies                       # makes every plan string a Lightning strategy name
    L.Trainer(strategy="dp", devices=4)     # our DDP; "naive", "zero3", "dp_tp2", ... (see ParallelPlan)
"""

from strategies.comm import Axis, CommStats, Op
from strategies.data_parallel import BucketedDataParallel, NaiveDataParallel
from strategies.lightning import DataParallelStrategy, NaiveDataParallelStrategy, PlanStrategy
from strategies.mesh import ParallelMesh
from strategies.plan import DataMode, ParallelPlan, Schedule
from strategies.registry import install as _install_registry
from strategies.sharded_checkpoint import ShardedCheckpointIO
from strategies.tp_plan import Colwise, Rowwise, VocabEmbedding

_install_registry()

__all__ = [
    "Axis",
    "BucketedDataParallel",
    "Colwise",
    "CommStats",
    "DataMode",
    "DataParallelStrategy",
    "NaiveDataParallel",
    "NaiveDataParallelStrategy",
    "Op",
    "ParallelMesh",
    "ParallelPlan",
    "PlanStrategy",
    "Rowwise",
    "Schedule",
    "ShardedCheckpointIO",
    "VocabEmbedding",
]
