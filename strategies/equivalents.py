"""Strategies outside the pack, by name, and the plan that does the same: the one table of them.

The parser uses Lightning's names to suggest our spelling (``ddp_tp2`` -> ``dp_tp2``), the estimator to predict
a reference run of Lightning's strategy as its plan, and ``stratpack bench`` to stand each peer beside its twin.
"""

from __future__ import annotations

LIGHTNING = {
    # Lightning registers these; after `import strategies` they keep Lightning's meaning.
    "ddp": "dp",
    "ddp_spawn": "dp",
    "ddp_fork": "dp",
    "fsdp": "zero3",
    "fsdp_cpu_offload": "zero3_offload",
    "deepspeed": "zero2",
    "deepspeed_stage_1": "zero1",
    "deepspeed_stage_2": "zero2",
    "deepspeed_stage_2_offload": "zero2_offload",
    "deepspeed_stage_3": "zero3",
    "deepspeed_stage_3_offload": "zero3_offload",
}
REFERENCE = {"single": "dp"}  # `stratpack`'s one-process reference run: a plan of one rank
PEERS = {
    # The implementations `stratpack bench` measures ours against.
    "torch_ddp": "dp",
    "deepspeed1": "zero1",
    "deepspeed2": "zero2",
    "deepspeed3": "zero3",
    "fsdp2": "zero3",
    "dtensor_tp": "tp",
    "deepspeed_moe": "ep",
}


def equivalent_plan(name: str) -> str | None:
    """The plan string that does what the strategy ``name`` does, or None when the pack has no name for it."""
    return LIGHTNING.get(name) or REFERENCE.get(name) or PEERS.get(name)
