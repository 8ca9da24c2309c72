"""Save and load ZeRO's sharded state in the single-process format, so checkpoints move freely.

`full_optimizer_state` gathers every shard's optimizer state and returns what ``optimizer.state_dict()``
of a single-process run would: per-parameter tensors of the parameters' shapes, indexed by the order of
the user's param groups. `load_full_optimizer_state` takes that format (from any world size, or from a
plain single-process checkpoint) and keeps this rank's slice. Every rank must call both (they gather).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from strategies import comm
from strategies.zero import FlatParam, ZeroGradSync


def _per_param_layout(sync: ZeroGradSync) -> dict[str, tuple[FlatParam, int]]:
    return {name: (flat, i) for flat in sync.flats for i, name in enumerate(flat.names)}


def _gather_full(flat: FlatParam, shard: torch.Tensor, sync: ZeroGradSync) -> torch.Tensor:
    device = flat.shard.device  # collectives run on the device (nccl needs it), offloaded state included
    out = torch.empty(flat.padded, dtype=shard.dtype, device=device)
    comm.all_gather(out, shard.detach().to(device).contiguous(), sync.axis)
    return out


def full_optimizer_state(sync: ZeroGradSync, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The single-process ``state_dict()`` of ``optimizer``, assembled from every rank's shards."""
    layout = _per_param_layout(sync)
    per_param: dict[str, dict[str, Any]] = {}
    for flat in sync.flats:
        state = optimizer.state.get(flat.master, {})
        for key, value in sorted(state.items()):
            if isinstance(value, torch.Tensor) and value.numel() == flat.shard_size and value.dim() == 1:
                full = _gather_full(flat, value, sync)
                for i, name in enumerate(flat.names):
                    piece = full[flat.offsets[i] : flat.offsets[i] + flat.numels[i]]
                    per_param.setdefault(name, {})[key] = piece.view_as(flat.params[i]).cpu().clone()
            else:  # scalars such as Adam's step: the same on every rank
                for name in flat.names:
                    per_param.setdefault(name, {})[key] = value.clone() if isinstance(value, torch.Tensor) else value
    index = {name: k for k, name in enumerate(n for group in sync.original_groups for n in group)}
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        entry = {key: value for key, value in group.items() if key != "params"}
        entry["params"] = [index[name] for name in sync.original_groups[g]]
        groups.append(entry)
    state = {index[name]: s for name, s in per_param.items() if name in layout}
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state(sync: ZeroGradSync, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Load a single-process-format optimizer state: each rank keeps its slice of every tensor."""
    names = [n for group in sync.original_groups for n in group]
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups) or any(
        len(saved["params"]) != len(ours) for saved, ours in zip(saved_groups, sync.original_groups)
    ):
        raise ValueError(
            "the checkpoint's optimizer has a different set of param groups or parameters than this model's: "
            f"saved {[len(g['params']) for g in saved_groups]}, here {[len(g) for g in sync.original_groups]}"
        )
    by_name = {name: state_dict["state"].get(k, state_dict["state"].get(str(k), {})) for k, name in enumerate(names)}
    for g, saved in enumerate(saved_groups):
        optimizer.param_groups[g].update({k: v for k, v in saved.items() if k != "params"})
    optimizer.state.clear()
    for flat in sync.flats:
        keys = {key for name in flat.names for key in by_name[name]}
        if not keys:
            continue
        start = sync.axis.index * flat.shard_size
        state: dict[str, Any] = {}
        for key in sorted(keys):
            values = [by_name[name].get(key) for name in flat.names]
            per_element = key != "step" and all(
                isinstance(v, torch.Tensor) and v.shape == p.shape for v, p in zip(values, flat.params)
            )
            if per_element:
                full = torch.zeros(flat.padded, dtype=values[0].dtype)
                for v, offset, n in zip(values, flat.offsets, flat.numels):
                    full[offset : offset + n] = v.reshape(-1)
                state[key] = full[start : start + flat.shard_size].clone().to(flat.master.device)
            else:
                value = values[0]
                state[key] = value.clone() if isinstance(value, torch.Tensor) else value
        optimizer.state[flat.master] = state


def refresh_shards(sync: ZeroGradSync, module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load full parameters into the flats: every rank takes its shard (and its offloaded master)."""
    params = dict(module.named_parameters())
    missing = [name for flat in sync.flats for name in flat.names if name not in state_dict]
    if missing:
        raise KeyError(f"the checkpoint has no values for {', '.join(missing[:8])}")
    with torch.no_grad():
        for flat in sync.flats:
            full = torch.zeros(flat.padded, dtype=flat.shard.dtype, device=flat.shard.device)
            for name, offset, n in zip(flat.names, flat.offsets, flat.numels):
                value = state_dict[name]
                if value.shape != params[name].shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(params[name].shape)}")
                full[offset : offset + n] = value.reshape(-1).to(full.device)
            start = sync.axis.index * flat.shard_size
            flat.shard.copy_(full[start : start + flat.shard_size])
            if flat.full.untyped_storage().nbytes():
                flat.full.copy_(full)
            if flat.offload:
                flat.master.data.copy_(flat.shard.to(flat.master.device))
