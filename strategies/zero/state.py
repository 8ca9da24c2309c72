"""Save and load ZeRO's sharded state in the single-process layout, so checkpoints move freely.

`gather_optimizer_state` gathers every shard's optimizer state into what ``optimizer.state_dict()`` of a
single-process run holds for each parameter: tensors of the parameter's shape, by parameter name.
`load_optimizer_state` takes that (from any world size, or from a plain single-process checkpoint) and keeps
this rank's slice; `load_params` does the same for the parameters. Every rank must call them (they gather).
"""

from __future__ import annotations

from typing import Any

import torch

from strategies import comm
from strategies.tensors import address
from strategies.zero.flat import FlatParam


def _gather_full(flat: FlatParam, shard: torch.Tensor) -> torch.Tensor:
    device = flat.shard.device  # collectives run on the device (nccl needs it), offloaded state included
    out = torch.empty(flat.padded, dtype=shard.dtype, device=device)
    comm.all_gather(out, shard.detach().to(device).contiguous(), flat.axis)
    return out


def gather_optimizer_state(flats: list[FlatParam], optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """Each parameter's optimizer state as a single process holds it, assembled from every rank's shards."""
    per_param: dict[str, dict[str, Any]] = {}
    for flat in flats:
        state = optimizer.state.get(flat.master, {})
        for key, value in sorted(state.items()):
            if isinstance(value, torch.Tensor) and value.numel() == flat.shard_size and value.dim() == 1:
                full = _gather_full(flat, value)
                for i, name in enumerate(flat.names):
                    piece = full[flat.offsets[i] : flat.offsets[i] + flat.numels[i]]
                    per_param.setdefault(name, {})[key] = piece.view_as(flat.params[i]).cpu().clone()
            else:  # scalars such as Adam's step: the same on every rank
                for name in flat.names:
                    per_param.setdefault(name, {})[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return per_param


def load_optimizer_state(flats: list[FlatParam], optimizer: torch.optim.Optimizer,
                         per_param: dict[str, dict[str, Any]]) -> None:
    """Load each parameter's single-process optimizer state: every rank keeps its slice of every tensor."""
    optimizer.state.clear()
    for flat in flats:
        keys = {key for name in flat.names for key in per_param.get(name, {})}
        if not keys:
            continue
        start = flat.axis.index * flat.shard_size
        state: dict[str, Any] = {}
        for key in sorted(keys):
            values = [per_param.get(name, {}).get(key) for name in flat.names]
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


def load_params(flats: list[FlatParam], state_dict: dict[str, Any], strict: bool = True) -> None:
    """Load full parameters into the flats: every rank takes its shard (and its offloaded master), reading only the
    part of each value its shard holds (a lazily read value, `checkpoint.lazy.LazyWeight`, reads no more); a
    gathered flat (ZeRO-1/2, ZeRO-3's pinned unit) takes the whole values. ``strict=False``: names the state does
    not hold keep their values."""
    missing = [name for flat in flats for name in flat.names if name not in state_dict]
    if missing and strict:
        raise KeyError(f"the checkpoint has no values for {', '.join(missing[:8])}")
    with torch.no_grad():
        for flat in flats:
            start, gathered = flat.axis.index * flat.shard_size, flat.full.untyped_storage().nbytes() > 0
            for name, param, offset, n in zip(flat.names, flat.params, flat.offsets, flat.numels):
                if name not in state_dict:
                    continue
                value = state_dict[name]
                if tuple(value.shape) != tuple(param.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(param.shape)}")
                if gathered:
                    whole = value.read_all() if hasattr(value, "read_all") else value
                    flat.full[offset : offset + n] = whole.reshape(-1).to(flat.full.device)
                lo, hi = max(offset, start), min(offset + n, start + flat.shard_size)
                if lo < hi:
                    if gathered and address(flat.shard) == address(flat.full[start:]):
                        continue  # the shard is a view of the full flat, just written
                    piece = flat_range(value, lo - offset, hi - offset)
                    flat.shard[lo - start : hi - start] = piece.to(flat.shard.device)
            if flat.offload:
                flat.master.data.copy_(flat.shard.to(flat.master.device))


def flat_range(value: Any, lo: int, hi: int) -> torch.Tensor:
    """Elements ``lo:hi`` of ``value`` flattened, read alone when ``value`` is read lazily."""
    return value.read_flat(lo, hi) if hasattr(value, "read_flat") else value.reshape(-1)[lo:hi]
