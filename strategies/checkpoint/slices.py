"""Save by slice (#59, a first step): what a rank holds, written as it lies, in torch's Distributed Checkpoint format.

A ZeRO flat's shard is a contiguous range of the flattened parameters it packs. Each parameter's part of it is cut
into a few row-major boxes (`boxes`: a partial first row, whole rows, a partial last row, the same again one
dimension in), each a chunk that DCP records at its offsets in the parameter, so `torch.distributed.checkpoint.load`
reads the checkpoint into any layout (a whole module in one process, FSDP2's DTensors) and no rank gathers anything
to write it; `load_by_slice` reads any saved layout back into the shards, each rank its own boxes. Not yet wired
into the strategy's checkpoints (which still gather whole): tp's slices, the pipeline's
stages and the loop's state are the next steps (docs/checkpoints.md, "By slice").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, the box's first index in the flat range


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The elements ``start`` to ``stop`` (flat, row-major) of a tensor of ``shape`` as boxes, in order: each box's
    elements are contiguous in that range, so a box's data is a slice of it viewed in the box's sizes."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,), start)]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner  # the rows the range touches

    def in_row(row: int, a: int, b: int) -> list[Box]:  # part of one row, cut one dimension in
        return [((row, *offsets), (1, *sizes), row * inner + at) for offsets, sizes, at in boxes(shape[1:], a, b)]

    if first == last:
        return in_row(first, start - first * inner, stop - first * inner)
    out = in_row(first, start % inner, inner) if start % inner else []
    whole_from, whole_to = -(-start // inner), stop // inner  # rows wholly inside
    if whole_from < whole_to:
        out.append(((whole_from, *[0] * (len(shape) - 1)), (whole_to - whole_from, *shape[1:]), whole_from * inner))
    return out + (in_row(whole_to, 0, stop % inner) if stop % inner else [])


def flat_pieces(flat, source: torch.Tensor | None = None) -> Iterator[tuple[str, tuple[int, ...], tuple[int, ...],
                                                                         torch.Tensor]]:
    """(parameter name, offsets, sizes, data) of each box of ``flat``'s shard on this rank (`zero.flat.FlatParam`):
    the data is a view of the optimizer's copy of the shard (the host copy under offload), or of ``source``, a
    tensor laid out as the shard (an optimizer's state for it), nothing gathered."""
    start = flat.axis.index * flat.shard_size
    stop, shard = start + flat.shard_size, (flat.master if source is None else source).detach()
    for name, param, offset, numel in zip(flat.names, flat.params, flat.offsets, flat.numels):
        mine = (max(start, offset) - offset, min(stop, offset + numel) - offset)  # in the parameter's own elements
        for offsets, sizes, at in boxes(tuple(param.shape), *mine):
            begin = offset + at - start
            yield name, offsets, sizes, shard[begin : begin + math.prod(sizes)].view(sizes)


def sharded_weights(flats: list, group: dist.ProcessGroup | None = None,
                    source: Callable[[Any], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The parameters of ``flats`` (every rank's, the same names on each) as DCP's sharded tensors, each rank's
    pieces its boxes; with ``source``, the tensor it gives for each flat instead (laid out as the shard). A
    collective: every rank of ``group`` calls it with the same flats."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    rank = dist.get_rank(group)
    pieces: dict[str, list] = {name: [] for flat in flats for name in flat.names}
    shapes = {name: tuple(p.shape) for flat in flats for name, p in zip(flat.names, flat.params)}
    for flat in flats:
        for name, offsets, sizes, data in flat_pieces(flat, None if source is None else source(flat)):
            pieces[name].append(Shard(data, ShardMetadata(list(offsets), list(sizes), f"rank:{rank}/{data.device}")))
    return {name: init_from_local_shards(pieces[name], *shapes[name], process_group=group) for name in pieces}


def sharded_optimizer_state(flats: list, optimizer: torch.optim.Optimizer,
                            group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """The optimizer's state of ``flats`` by parameter name, as torch's `get_optimizer_state_dict` names it
    (``state.<name>.<key>``): each state laid out as the shard (AdamW's moments, SGD's momentum) in the rank's
    boxes, each scalar (AdamW's step: one per flat) given to each of the flat's parameters. Hyperparameters are
    the user's (`configure_optimizers`), not saved here. A collective, as `sharded_weights`."""
    if any(not optimizer.state.get(flat.master) for flat in flats):  # (alike on every rank: all stepped as many times)
        raise ValueError("the optimizer holds no state for these shards yet (torch makes it at the first step): save "
                         "or load its state after a step, or the weights alone (optimizer=None)")
    state: dict[str, dict[str, Any]] = {name: {} for flat in flats for name in flat.names}
    keys = sorted({k for flat in flats for k, v in optimizer.state[flat.master].items()
                   if isinstance(v, torch.Tensor) and v.shape == flat.master.shape})
    for key in keys:  # the same keys in the same order on every rank (each makes its sharded tensors)
        for name, tensor in sharded_weights(flats, group, lambda f, k=key: optimizer.state[f.master][k]).items():
            state[name][key] = tensor
    for flat in flats:
        for key, value in optimizer.state[flat.master].items():
            if not (isinstance(value, torch.Tensor) and value.shape == flat.master.shape):
                for name in flat.names:
                    state[name][key] = value
    return {"state": state}


def save_by_slice(flats: list, path: str, group: dist.ProcessGroup | None = None,
                  optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write the weights of ``flats`` (and ``optimizer``'s state of them, under ``optim``) to the DCP directory
    ``path``, each rank its own shard's boxes (its file holds 1/N of them; DCP's ``.metadata``, written last, says
    where every box lies)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(flats, group, optimizer), checkpoint_id=path, process_group=group)


def _state(flats: list, group: dist.ProcessGroup | None, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What `save_by_slice` writes and `load_by_slice` fills: ``model`` (and ``optim``), as torchtitan names them."""
    state: dict[str, Any] = {"model": sharded_weights(flats, group)}
    if optimizer is not None:
        state["optim"] = sharded_optimizer_state(flats, optimizer, group)
    return state


def load_by_slice(flats: list, path: str, group: dist.ProcessGroup | None = None,
                  optimizer: torch.optim.Optimizer | None = None) -> None:
    """Fill the shards of ``flats`` (and ``optimizer``'s state of them, which must exist: after a step) from the DCP
    checkpoint at ``path``, each rank reading only its boxes (from the chunks of any saved layout that overlap them:
    another world size, FSDP2's). Into the optimizer's copies in place; under offload the device shard is then
    copied from its host copy."""
    import torch.distributed.checkpoint as dcp

    dcp.load(_state(flats, group, optimizer), checkpoint_id=path, process_group=group)
    for flat in flats:
        if flat.master.data_ptr() != flat.shard.data_ptr():
            flat.shard.copy_(flat.master.detach())
