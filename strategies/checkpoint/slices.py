"""Save by slice (#59, a first step): what a rank holds, written as it lies, in torch's Distributed Checkpoint format.

A ZeRO flat's shard is a contiguous range of the flattened parameters it packs. Each parameter's part of it is cut
into a few row-major boxes (`boxes`: a partial first row, whole rows, a partial last row, the same again one
dimension in), each a chunk that DCP records at its offsets in the parameter, so `torch.distributed.checkpoint.load`
reads the checkpoint into any layout (a whole module in one process, FSDP2's DTensors) and no rank gathers anything
to write it; `load_by_slice` reads any saved layout back into the shards, each rank its own boxes. Not yet wired
into the strategy's checkpoints (which still gather whole): tp's slices, the pipeline's
stages and the optimizer's state are the next steps (docs/checkpoints.md, "By slice").
"""

from __future__ import annotations

import math
from collections.abc import Iterator

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


def flat_pieces(flat) -> Iterator[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]]:
    """(parameter name, offsets, sizes, data) of each box of ``flat``'s shard on this rank (`zero.flat.FlatParam`):
    the data is a view of the optimizer's copy of the shard (the host copy under offload), nothing gathered."""
    start = flat.axis.index * flat.shard_size
    stop, shard = start + flat.shard_size, flat.master.detach()
    for name, param, offset, numel in zip(flat.names, flat.params, flat.offsets, flat.numels):
        mine = (max(start, offset) - offset, min(stop, offset + numel) - offset)  # in the parameter's own elements
        for offsets, sizes, at in boxes(tuple(param.shape), *mine):
            begin = offset + at - start
            yield name, offsets, sizes, shard[begin : begin + math.prod(sizes)].view(sizes)


def sharded_weights(flats: list, group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """The parameters of ``flats`` (every rank's, the same names on each) as DCP's sharded tensors, each rank's
    pieces its boxes. A collective: every rank of ``group`` calls it with the same flats."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    rank = dist.get_rank(group)
    pieces: dict[str, list] = {name: [] for flat in flats for name in flat.names}
    shapes = {name: tuple(p.shape) for flat in flats for name, p in zip(flat.names, flat.params)}
    for flat in flats:
        for name, offsets, sizes, data in flat_pieces(flat):
            pieces[name].append(Shard(data, ShardMetadata(list(offsets), list(sizes), f"rank:{rank}/{data.device}")))
    return {name: init_from_local_shards(pieces[name], *shapes[name], process_group=group) for name in pieces}


def save_by_slice(flats: list, path: str, group: dist.ProcessGroup | None = None) -> None:
    """Write the weights of ``flats`` to the DCP directory ``path``, each rank its own shard's boxes (its file holds
    1/N of the weights; DCP's ``.metadata``, written last, says where every box lies)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(sharded_weights(flats, group), checkpoint_id=path, process_group=group)


def load_by_slice(flats: list, path: str, group: dist.ProcessGroup | None = None) -> None:
    """Fill the shards of ``flats`` from the DCP checkpoint at ``path``, each rank reading only its boxes (from the
    chunks of any saved layout that overlap them: another world size, FSDP2's). Into the optimizer's copy in place;
    under offload the device shard is then copied from it."""
    import torch.distributed.checkpoint as dcp

    dcp.load(sharded_weights(flats, group), checkpoint_id=path, process_group=group)
    for flat in flats:
        if flat.master.data_ptr() != flat.shard.data_ptr():
            flat.shard.copy_(flat.master.detach())
