"""Tensor parallel (Megatron): weight matrices split over the tp axis, by a plan that names the layers.

`layers`: the parallel layers and the conjugate communication operators; `plans`: which layers a plan splits
and how (shipped plans, detection); `sequence_parallel`: the blocks between split layers on 1/tp of the
sequence; `state`: weights and optimizer state back in the single-process layout; `technique`: all of it as
one technique of a plan.
"""

from strategies.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from strategies.tensor_parallel.plans import (
    FUSED_QKV_PLAN,
    SEPARATE_QKV_PLAN,
    SHIPPED_PLANS,
    Colwise,
    Rowwise,
    Style,
    VocabEmbedding,
    apply_plan,
    detect_plan,
)
from strategies.tensor_parallel.technique import TensorParallel

__all__ = ["FUSED_QKV_PLAN", "SEPARATE_QKV_PLAN", "SHIPPED_PLANS", "Colwise", "ColumnParallelLinear",
           "RowParallelLinear", "Rowwise", "Style", "TensorParallel", "VocabEmbedding", "VocabParallelEmbedding",
           "apply_plan", "detect_plan", "vocab_parallel_cross_entropy"]
