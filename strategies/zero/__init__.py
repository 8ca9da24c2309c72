"""ZeRO stages 1, 2 and 3 over flat, padded shards, and CPU offload of the optimizer step.

Parameters are packed into `FlatParam`s: one contiguous buffer per group of parameters that share a dtype,
a device and an optimizer param group, padded to a multiple of N so that rank r owns elements
[r*S, (r+1)*S). Every collective is then one contiguous call, and sizes that do not divide by N cost at
most N-1 padding elements per flat. The user's optimizer is kept (its schedulers and hyperparameters
keep working) but steps only this rank's shards:

- ZeRO-1: optimizer states partitioned. Full gradients are kept (4 Psi), reduce-scattered into this rank's
  shard (each bucket as soon as backward fills it); after the step the updated shards are all-gathered.
- ZeRO-2: also gradients partitioned: a bucket's full gradient lives only until its reduce-scatter.
- ZeRO-3: also parameters partitioned: see `stage3`, which gathers them around each unit's use.

Per step each stage moves 2(N-1)/N * Psi elements per rank for 1 and 2 (reduce-scatter + all-gather),
and 3(N-1)/N * Psi for 3 (gather in forward, again in backward, reduce-scatter).

Only element-wise optimizers give the same update on a shard as on the whole tensor; others are refused.
"""


from __future__ import annotations

import torch
from torch import nn

from strategies.comm import Axis
from strategies.data_parallel import DEFAULT_BUCKET_CAP_MB
from strategies.zero.flat import FlatParam, bucket_names, build_flats, shard_optimizer
from strategies.zero.stage3 import Zero3GradSync, build_units
from strategies.zero.sync import IN_FLIGHT, ZeroGradSync

__all__ = ["IN_FLIGHT", "FlatParam", "Zero3GradSync", "ZeroGradSync", "shard_model"]


def shard_model(module: nn.Module, optimizer: torch.optim.Optimizer, axis: Axis, stage: int, *,
                offload: bool = False, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                find_unused_parameters: bool = False, units=None, materialise=None,
                axis_of: dict[str, Axis] | None = None) -> ZeroGradSync:
    """Apply ZeRO-``stage`` to ``module`` over ``axis`` and point ``optimizer`` at the shards.

    ``units`` (ZeRO-3): the wrapping policy, a function from the module to the ``(name, submodule)`` pairs
    gathered as one; by default `stage3.default_units` (the blocks, then every other parameter owner).
    ``materialise`` (a model built on meta, `deferred.Deferred`): ZeRO-3 makes one unit at a time and keeps its
    shard; the other stages make the whole model first."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    name_of = {id(p): n for n, p in module.named_parameters()}
    original_groups = [[name_of[id(p)] for p in group["params"] if id(p) in name_of]
                       for group in optimizer.param_groups]
    if stage == 3:
        chosen = units(module) if units is not None else None
        flats, built = build_units(module, optimizer, axis, offload, chosen, materialise, axis_of)
        sync: ZeroGradSync = Zero3GradSync(module, axis, flats, built, find_unused_parameters=find_unused_parameters)
    else:
        if materialise is not None:
            materialise(module)
        groups = bucket_names(module, bucket_cap_mb)
        built = build_flats(module, optimizer, axis, groups, own_shard=False, offload=offload, axis_of=axis_of)
        flats = [flat for per_group in built for flat in per_group]
        sync = ZeroGradSync(module, axis, flats, stage, find_unused_parameters=find_unused_parameters)
    shard_optimizer(optimizer, flats)
    sync.original_groups = original_groups  # the user's param groups by name: checkpoints use this order
    return sync
