"""Save by slice (#59, in steps): what a rank holds, written as it lies, in torch's Distributed Checkpoint format.

A ZeRO flat's shard is a contiguous range of the flattened parameters it packs. Each parameter's part of it is cut
into a few row-major boxes (`boxes`: a partial first row, whole rows, a partial last row, the same again one
dimension in); a tensor-parallel rank's boxes are then moved to where its slice lies in the whole tensor
(`TensorSlices`, `split_boxes`: a fused qkv's slice is three parts). Each box is a chunk that DCP records at its
offsets (`Boxed`, torch's `_Checkpointable` protocol: no collective to describe them, DCP gathers every rank's
plan once per save, and a box several ranks hold alike is written once), so `torch.distributed.checkpoint.load`
reads the checkpoint into any layout (a whole module in one process, FSDP2's DTensors) and no rank gathers anything
to write it; `load_by_slice` reads any saved layout back into the shards, each rank its own boxes. `rank_state`
gives any plan's state so, each technique saying what it holds (`PlanStrategy.state_by_slice`: Lightning's
checkpoints, `dcp_dir`), and `load_state` fills it from any layout (docs/checkpoints.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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


class Boxed:
    """A tensor that DCP saves and loads as the boxes a rank holds of it, through torch's `_Checkpointable` protocol
    (as DTensor does): ``shape``, the whole tensor's; ``pieces``, (offsets, sizes, data) each, the data a view of
    what the rank holds (so a load fills it in place). Nothing is sent to make one: DCP gathers every rank's boxes
    once per save, in its plan, and writes a box several ranks hold alike (a replica's) once (its dedup)."""

    def __init__(self, shape: tuple[int, ...], pieces: list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]):
        self.shape, self.pieces = tuple(shape), pieces

    def __create_write_items__(self, fqn: str, obj: object) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                                      TensorProperties.create_from_tensor(data),
                                                      torch.Size(self.shape)))
                for offsets, sizes, data in self.pieces]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes, _ in self.pieces]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        for offsets, _, data in self.pieces:
            if torch.Size(offsets) == index.offset:
                return data
        raise ValueError(f"{index.fqn}: this rank holds no box at {tuple(index.offset)}")


def _as_is(name: str, box: Boxed) -> Boxed:
    """A box placed where it lies (no technique moved it)."""
    return box


def split_boxes(pieces: list, dim: int, blocks: tuple[int, ...], index: int, size: int) -> list:
    """``pieces`` (offsets, sizes, data) of a tensor-parallel slice, placed in the whole tensor: along ``dim`` each
    block of ``blocks`` (whole sizes, in order) is cut into ``size`` equal parts, and rank ``index`` holds the
    index-th part of each, one after the other (`tensor_parallel.plans.ParamSplit`). A box that spans two blocks'
    parts is cut at the boundary (a fused qkv's: q, k and v each their own box)."""
    out, local, whole = [], 0, 0
    for block in blocks:
        part = block // size
        for offsets, sizes, data in pieces:
            lo, hi = max(offsets[dim], local), min(offsets[dim] + sizes[dim], local + part)
            if lo < hi:  # this box's rows in this block's part, moved to where the part lies in the whole
                at = [*offsets]
                at[dim] = whole + index * part + lo - local
                cut = [*sizes]
                cut[dim] = hi - lo
                out.append((tuple(at), tuple(cut), data.narrow(dim, lo - offsets[dim], hi - lo)))
        local, whole = local + part, whole + block
    return out


def _save_planner() -> Any:
    """DCP's default save planner, which finds a `Boxed` tensor's box by its offsets (its own lookup takes a
    torch.Tensor only)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class Planner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            found = self.state_dict.get(index.fqn)
            return found.__get_tensor_shard__(index) if isinstance(found, Boxed) else super().lookup_object(index)

    return Planner()


def load_planner(partial: bool = False, check: Callable[[], None] | None = None) -> Any:
    """DCP's default load planner, which fills a `Boxed` tensor's boxes in place (as `_save_planner`). Its set-up
    replaces every leaf it does not know with None (torch's `_init_state_dict`, which makes meta tensors real): the
    boxes are put back after it, in the caller's dict and in the planner's flattened one. ``partial``: entries the
    checkpoint lacks keep their values (else DCP refuses the load). ``check``: run in DCP's local planning step, whose
    error DCP raises on every rank (a rank that raised before the load would leave the others waiting in it)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def set_up_planner(self, state_dict: dict, *args: Any, **kwargs: Any) -> None:
            boxed = list(_boxed(state_dict, ()))
            super().set_up_planner(state_dict, *args, **kwargs)
            for path, box in boxed:
                parent = state_dict
                for key in path[:-1]:
                    parent = parent[key]
                parent[path[-1]] = box
                self.state_dict[".".join(map(str, path))] = box

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            found = self.state_dict.get(index.fqn)
            return found.__get_tensor_shard__(index) if isinstance(found, Boxed) else super().lookup_tensor(index)

        def create_local_plan(self) -> Any:
            if check is not None:
                check()
            return super().create_local_plan()

    return Planner(allow_partial_load=partial)


def _boxed(state: Any, path: tuple) -> Iterator[tuple[tuple, Boxed]]:
    """(path, box) of every `Boxed` leaf of a nested state dict."""
    if isinstance(state, Boxed):
        yield path, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from _boxed(value, (*path, key))


@dataclass(frozen=True)
class TensorSlices:
    """Where a tensor-parallel rank's slices lie in the whole tensors: ``splits``, each split parameter's cut
    (`tensor_parallel.plans.ParamSplit`: ``dim``, ``blocks``), and the rank's ``index`` of ``size``."""

    splits: dict[str, Any]
    index: int
    size: int

    def place(self, boxed: dict[str, Boxed]) -> dict[str, Boxed]:
        """``boxed`` (boxes of this rank's slices) in the whole tensors: a split parameter's moved along its cut
        (`split_boxes`), its shape the whole one; the others as they are (alike on every tp rank: written once)."""
        return {name: self.place_one(name, box) for name, box in boxed.items()}

    def place_one(self, name: str, box: Boxed) -> Boxed:
        """`place` for one tensor laid out as parameter ``name``'s slice (the parameter, or its optimizer state)."""
        split = self.splits.get(name)
        if split is None:
            return box
        shape = list(box.shape)
        shape[split.dim] = sum(split.blocks)
        return Boxed(tuple(shape), split_boxes(box.pieces, split.dim, split.blocks, self.index, self.size))


def sharded_weights(flats: list, group: dist.ProcessGroup | None = None,
                    source: Callable[[Any], torch.Tensor] | None = None) -> dict[str, Boxed]:
    """The parameters of ``flats`` as the boxes of this rank's shards (`Boxed`); with ``source``, the tensor it gives
    for each flat instead (laid out as the shard). Nothing is sent: each rank gives its own (``group``: unused, kept
    for the callers of the first step's sharded tensors)."""
    pieces: dict[str, list] = {name: [] for flat in flats for name in flat.names}
    shapes = {name: tuple(p.shape) for flat in flats for name, p in zip(flat.names, flat.params)}
    for flat in flats:
        for name, offsets, sizes, data in flat_pieces(flat, None if source is None else source(flat)):
            pieces[name].append((offsets, sizes, data))
    return {name: Boxed(shapes[name], pieces[name]) for name in pieces}


def sharded_optimizer_state(flats: list, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None = None,
                            place: Callable[[str, Boxed], Boxed] = _as_is) -> dict[str, Any]:
    """The optimizer's state of ``flats`` by parameter name, as torch's `get_optimizer_state_dict` names it
    (``state.<name>.<key>``): each state laid out as the shard (AdamW's moments, SGD's momentum) in the rank's
    boxes, each scalar (AdamW's step: one per flat) given to each of the flat's parameters. Hyperparameters are
    the user's (`configure_optimizers`), not saved here. Nothing is sent."""
    if any(not optimizer.state.get(flat.master) for flat in flats):  # (alike on every rank: all stepped as many times)
        raise ValueError("the optimizer holds no state for these shards yet (torch makes it at the first step): save "
                         "or load its state after a step, or the weights alone (optimizer=None)")
    state: dict[str, dict[str, Any]] = {name: {} for flat in flats for name in flat.names}
    keys = sorted({k for flat in flats for k, v in optimizer.state[flat.master].items()
                   if isinstance(v, torch.Tensor) and v.shape == flat.master.shape})
    for key in keys:  # the same keys in the same order on every rank (each makes its sharded tensors)
        for name, box in sharded_weights(flats, group, lambda f, k=key: optimizer.state[f.master][k]).items():
            state[name][key] = place(name, box)
    for flat in flats:
        for key, value in optimizer.state[flat.master].items():
            if not (isinstance(value, torch.Tensor) and value.shape == flat.master.shape):
                for name in flat.names:
                    state[name][key] = value
    return {"state": state}


def rank_state(module: torch.nn.Module, flats: list, place: Callable[[str, Boxed], Boxed] = _as_is,
               holds: Callable[[str], bool] = lambda name: True,
               optimizer: torch.optim.Optimizer | None = None, groups: list[list[str]] | None = None,
               buffers_held: Callable[[str], bool] | None = None) -> dict:
    """What this rank holds of the single-process state, as boxes in the whole tensors (`Boxed`): ``model``, the
    weights (ZeRO's shards of ``flats``, and every parameter outside them whole: a replica's, a pipeline stage's
    own, ``holds``), each placed by ``place`` (tensor parallel's slices: `TensorSlices.place_one`), every name of a
    tied one; with ``optimizer``, ``optim``, its state alike (for the flats as `sharded_optimizer_state` names it,
    the rest whole) and its param groups as torch's ``get_optimizer_state_dict`` writes them (the hyperparameters,
    and ``groups``, the single-process names of each group's parameters, under ``params``). Nothing is gathered. The
    buffers a module keeps in its state dict: those ``buffers_held`` names (a pipeline stage's copies in use, to save;
    every one, to load: each rank's copies), or, without it, refused where a rank does not hold every parameter."""
    named = dict(module.named_parameters())
    flat_names = {name for flat in flats for name in flat.names}
    whole = {name: p for name, p in named.items() if name not in flat_names and holds(name)}
    buffer_names = {name for name, _ in module.named_buffers()}
    buffers = {k: v for k, v in module.state_dict().items() if k not in named and k in buffer_names}
    if buffers_held is not None:
        buffers = {k: v for k, v in buffers.items() if buffers_held(k)}
    elif buffers and not all(holds(name) for name in named):
        raise NotImplementedError(f"under pp, which of the module's buffers ({', '.join(sorted(buffers))}) a rank "
                                  "holds is for its caller to say (buffers_held)")
    weights = {**sharded_weights(flats), **_whole({**{n: p.detach() for n, p in whole.items()}, **buffers})}
    state: dict[str, Any] = {"model": _aliased(module, {n: place(n, box) for n, box in weights.items()})}
    if optimizer is not None:
        stepped = not flats or all(optimizer.state.get(flat.master) for flat in flats)  # (none before a first step)
        state["optim"] = sharded_optimizer_state(flats, optimizer, place=place) if flats and stepped else {"state": {}}
        state["optim"]["param_groups"] = [{**{k: v for k, v in group.items() if k != "params"}, "params": names}
                                          for group, names in zip(optimizer.param_groups, groups or [])]
        held = {id(p): name for name, p in whole.items()}
        for param, entry in optimizer.state.items():
            if id(param) in held:
                name = held[id(param)]
                tensors = _whole({k: v for k, v in entry.items() if isinstance(v, torch.Tensor) and
                                  v.shape == param.shape})
                state["optim"]["state"][name] = {**entry, **{k: place(name, box) for k, box in tensors.items()}}
    return state


def make_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` its state before its first step (torch makes it lazily), for a checkpoint to be read into:
    one step on zero gradients at a learning rate of 0, which leaves every parameter as it was (as torch's
    ``set_optimizer_state_dict`` does). A parameter without a gradient is given a zero one for it, and none after."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if all(optimizer.state.get(p) for p in params):
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    given = [p for p in params if p.grad is None]
    for p in given:
        p.grad = torch.zeros_like(p)
    try:
        for group in optimizer.param_groups:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        with torch.no_grad():
            optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for p in given:
            p.grad = None


def _whole(tensors: dict[str, torch.Tensor]) -> dict[str, Boxed]:
    """Each tensor as one box at its origin."""
    return {name: Boxed(tuple(t.shape), [((0,) * t.dim(), tuple(t.shape), t)]) for name, t in tensors.items()}


def _aliased(module: torch.nn.Module, boxed: dict[str, Boxed]) -> dict[str, Boxed]:
    """``boxed`` under every name of a tied parameter too, as the module's state dict names it."""
    primary = {id(p): name for name, p in module.named_parameters()}
    out = dict(boxed)
    for alias, p in module.named_parameters(remove_duplicate=False):
        if alias not in out and primary[id(p)] in boxed:
            out[alias] = boxed[primary[id(p)]]
    return out


def keep_boxes(boxes: dict[str, Boxed]) -> dict[str, list]:
    """``boxes`` (`rank_state`'s ``model``) as (offsets, sizes, a host copy of the data) per name: what a rank holds,
    kept past the techniques that held it (`deferred.KeptSlices`); a tied weight's boxes are copied once."""
    copies: dict[int, list] = {}
    for box in boxes.values():
        if id(box) not in copies:
            copies[id(box)] = [(tuple(o), tuple(s), d.detach().to("cpu", copy=True)) for o, s, d in box.pieces]
    return {name: copies[id(box)] for name, box in boxes.items()}


def fill_boxes(boxes: dict[str, Boxed], kept: dict[str, list]) -> list[str]:
    """Fill ``boxes`` in place from ``kept`` (`keep_boxes`), each box from the kept one at the same place: the same
    plan and ranks make the same boxes. Returns the names of those that found none (a layout that changed)."""
    missing = []
    for name, box in boxes.items():
        pieces = {(o, s): d for o, s, d in kept.get(name, [])}
        for offsets, sizes, data in box.pieces:
            source = pieces.get((tuple(offsets), tuple(sizes)))
            if source is None:
                missing.append(name)
                break
            data.copy_(source)
    return missing


def share_replicas(state: dict, rank: int, gather: Callable[[Any], list[Any]]) -> dict:
    """``state`` (`rank_state`'s) with each box that several ranks hold alike (a replica's: dp's weights, a norm tp
    keeps whole) kept by one of them only, so that each rank writes and copies (an asynchronous save's stall) its
    share of what is replicated, not all of it. ``gather(obj)``: every rank's ``obj`` in rank order (a collective;
    what is gathered is each box's name, offsets, sizes and bytes: a dp replica of a tp slice is one too, so every
    box is listed, O(boxes x ranks) small objects on each rank, as DCP's own plan on its coordinator). Every rank
    assigns alike: the largest boxes first, each to the holder with the fewest bytes so far."""
    mine = {(fqn, tuple(o), tuple(s)): d.numel() * d.element_size()
            for fqn, leaf in leaves(state) if isinstance(leaf, Boxed) for o, s, d in leaf.pieces}
    holders: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    everyone = gather(list(mine.items()))
    for r, boxes in enumerate(everyone):
        for key, nbytes in boxes:
            holders.setdefault(tuple(key), []).append(r)
            sizes[tuple(key)] = nbytes
    load, owner = [0] * len(everyone), {}
    for key in sorted(holders, key=lambda k: (-sizes[k], k)):
        owner[key] = min(holders[key], key=lambda r: (load[r], r))
        load[owner[key]] += sizes[key]

    def keep(value: Any, fqn: str) -> Any:
        if isinstance(value, Boxed):
            return Boxed(value.shape, [(o, s, d) for o, s, d in value.pieces
                                       if owner.get((fqn, tuple(o), tuple(s)), rank) == rank])
        if isinstance(value, dict):
            return {k: keep(v, f"{fqn}.{k}" if fqn else str(k)) for k, v in value.items()}
        return value

    return keep(state, "")


def leaves(state: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """The leaves of ``state`` (nested dicts and lists) by the flattened names DCP gives them (its
    ``flatten_state_dict``)."""
    if isinstance(state, dict):
        return [kv for key, value in state.items() for kv in leaves(value, f"{prefix}{key}.")]
    if isinstance(state, list) and any(isinstance(v, (dict, list, torch.Tensor, Boxed)) for v in state):
        return [kv for i, value in enumerate(state) for kv in leaves(value, f"{prefix}{i}.")]
    return [(prefix[:-1], state)]


def save_state(state: dict, path: str, group: dist.ProcessGroup | None = None) -> None:
    """Write ``state`` (`rank_state`'s, every rank its own) to the DCP directory ``path``."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path, process_group=group, planner=_save_planner())


def load_state(state: dict, path: str, group: dist.ProcessGroup | None = None, partial: bool = False,
               check: Callable[[], None] | None = None) -> None:
    """Fill ``state`` (`rank_state`'s: views of what the rank holds) in place from the DCP checkpoint at ``path``,
    each rank reading only the chunks that overlap its boxes, whatever layout saved them (``partial``: entries the
    checkpoint lacks are left as they are; ``check``: see `load_planner`)."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=path, process_group=group, planner=load_planner(partial, check))


def save_by_slice(flats: list, path: str, group: dist.ProcessGroup | None = None,
                  optimizer: torch.optim.Optimizer | None = None, tp: TensorSlices | None = None) -> None:
    """Write the weights of ``flats`` (and ``optimizer``'s state of them, under ``optim``) to the DCP directory
    ``path``, each rank its own shard's boxes (its file holds 1/N of them; DCP's ``.metadata``, written last, says
    where every box lies). ``tp``: the flats hold tensor-parallel slices, placed so in the whole tensors."""
    save_state(_state(flats, group, optimizer, tp), path, group)


def _state(flats: list, group: dist.ProcessGroup | None, optimizer: torch.optim.Optimizer | None,
           tp: TensorSlices | None = None) -> dict[str, Any]:
    """What `save_by_slice` writes and `load_by_slice` fills: ``model`` (and ``optim``), as torchtitan names them."""
    weights = sharded_weights(flats, group)
    state: dict[str, Any] = {"model": weights if tp is None else tp.place(weights)}
    if optimizer is not None:
        state["optim"] = sharded_optimizer_state(flats, optimizer, group, place=tp.place_one if tp else _as_is)
    return state


def load_by_slice(flats: list, path: str, group: dist.ProcessGroup | None = None,
                  optimizer: torch.optim.Optimizer | None = None, tp: TensorSlices | None = None) -> None:
    """Fill the shards of ``flats`` (and ``optimizer``'s state of them, which must exist: after a step) from the DCP
    checkpoint at ``path``, each rank reading only its boxes (from the chunks of any saved layout that overlap them:
    another world size, FSDP2's). Into the optimizer's copies in place; under offload the device shard is then
    copied from its host copy."""
    load_state(_state(flats, group, optimizer, tp), path, group)
    for flat in flats:
        if flat.master.data_ptr() != flat.shard.data_ptr():
            flat.shard.copy_(flat.master.detach())
