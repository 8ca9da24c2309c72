"""Tensor parallel (Megatron): weight matrices split over the tp axis, by a plan that names the layers.

`layers`: the parallel layers and the conjugate communication operators; `vocab`: the output layer split over the
vocabulary and the loss computed from its pieces ('vp'); `plans`: which layers a plan splits
and how; `families`: the model layouts split without a plan (detection); `heads`: attention counting this rank's
heads; `sequence_parallel`: the blocks between split layers on 1/tp of the
sequence; `state`: weights and optimizer state back in the single-process layout; `technique`: all of it as
one technique of a plan.
"""

from strategies.tensor_parallel.families import FAMILIES, detect_plan
from strategies.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from strategies.tensor_parallel.plans import (
    FUSED_QKV_PLAN,
    SEPARATE_QKV_PLAN,
    Colwise,
    Rowwise,
    Style,
    VocabEmbedding,
    VocabHead,
    apply_plan,
)
from strategies.tensor_parallel.technique import TensorParallel
from strategies.tensor_parallel.vocab import VocabParallelHead, VocabParallelLogits, vocab_parallel_cross_entropy

__all__ = ["FAMILIES", "FUSED_QKV_PLAN", "SEPARATE_QKV_PLAN", "Colwise", "ColumnParallelLinear",
           "RowParallelLinear", "Rowwise", "Style", "TensorParallel", "VocabEmbedding", "VocabHead",
           "VocabParallelEmbedding", "VocabParallelHead", "VocabParallelLogits", "apply_plan", "detect_plan",
           "vocab_parallel_cross_entropy"]
