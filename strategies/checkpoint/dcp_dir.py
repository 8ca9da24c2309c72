"""Lightning checkpoints in torch's Distributed Checkpoint (DCP) format, each rank writing what it holds (#59).

A checkpoint is a directory laid out as Lightning's ``ModelParallelStrategy`` writes one:

    .metadata           DCP's index: each tensor's whole shape and where each of its chunks lies (DCP writes it
                        last, once every rank's file is written)
    __<rank>_0.distcp   each rank's chunks: its slices of the weights and of the optimizer's state, as they lie
    meta.pt             the rest of Lightning's checkpoint (loops, callbacks, schedulers, the loader's position and
                        every rank's random state), written by rank 0

Under ``state_dict`` the module's state by the single-process names; under ``optimizer_0`` the optimizer's as torch's
``get_optimizer_state_dict`` names it (``state.<parameter>.<key>``, ``param_groups`` with parameter names). So
``torch.distributed.checkpoint.load`` reads it into any layout (one process, FSDP2, ModelParallelStrategy) and the
pack resumes from theirs. The save is atomic as the sharded format's (`sharded.swap_in`): everything is written into
``<path>.tmp-<token>``, which replaces ``<path>`` only once DCP's ``.metadata`` is there.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from strategies.checkpoint import directory
from strategies.checkpoint.directory import CheckpointError, swap_in
from strategies.checkpoint.layout import MODEL, layout_of, optimizer_key, paths
from strategies.checkpoint.lazy import LazyWeight
from strategies.checkpoint.slices import Boxed, leaves, load_planner, load_state, save_state
from strategies.files import atomic_write

META = "meta.pt"
METADATA = ".metadata"
FOREIGN = "stratpack_foreign_layout"  # `load_rest`'s answer for a checkpoint not in Lightning's layout


@dataclass(frozen=True)
class SliceLoad:
    """What `load_rest` puts where Lightning expects the weights or an optimizer's state: a DCP checkpoint's part that
    the strategy reads by slice once its layout exists (`PlanStrategy.load_model_state_dict`)."""

    path: str
    key: str


def save_dcp(state: dict[str, Any], rest: dict[str, Any], path: str | os.PathLike, *, rank: int,
             broadcast: Callable[[Any], Any], barrier: Callable[[], None], group: Any = None) -> None:
    """Write ``state`` (every rank its own: `slices.Boxed` and tensors) and, from rank 0, ``rest`` as the DCP directory
    ``path``. Every rank must call this; the collectives run over ``group`` (DCP's) and ``broadcast``/``barrier``."""
    path = os.fspath(path)
    directory.refuse_non_checkpoint(path)
    token = broadcast(uuid.uuid4().hex[:12] if rank == 0 else None)
    tmp = f"{path}.tmp-{token}"

    def write_rest() -> None:
        os.makedirs(tmp, exist_ok=True)
        atomic_write(os.path.join(tmp, META), lambda f: torch.save(rest, f), binary=True)

    written = directory.attempt(write_rest) if rank == 0 else None
    directory.raise_failures([broadcast(written) or (None, None)], "writing meta.pt of")
    save_state(state, tmp, group)  # (a rank that fails raises on every rank: DCP gathers each rank's outcome)
    status = directory.attempt(lambda: swap_in(path, tmp, token)) if rank == 0 else None
    directory.raise_failures([broadcast(status)], "moving in")
    barrier()


def stage(state: Any, staging: dict[str, torch.Tensor] | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """``state`` with every box's data and every tensor copied to host memory (pinned from a GPU, the copies in flight
    together), for a save written while training goes on; the copies by flattened name and offsets, which the next
    save writes over where they fit (``staging``)."""
    staging, copies = staging or {}, {}

    def copy(key: str, t: torch.Tensor) -> torch.Tensor:
        copies[key] = directory.host_copy(t.detach(), staging.get(key))
        return copies[key]

    def walk(value: Any, key: str) -> Any:
        if isinstance(value, Boxed):
            return Boxed(value.shape, [(o, s, copy(f"{key}@{o}", d)) for o, s, d in value.pieces])
        if isinstance(value, torch.Tensor):
            return copy(key, value)
        if isinstance(value, dict):
            return {k: walk(v, f"{key}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, f"{key}.{i}") for i, v in enumerate(value)]
        return value

    staged = walk(state, "")
    if any(t.is_pinned() for t in copies.values()):
        torch.cuda.synchronize()  # the non-blocking copies have landed
    return staged, copies


def read_metadata(path: str | os.PathLike) -> Any:
    """DCP's metadata of the checkpoint at ``path``, after checking that it is whole: ``meta.pt`` there and every
    chunk's file at least as long as the metadata says."""
    from torch.distributed.checkpoint import FileSystemReader

    path = os.fspath(path)
    if not os.path.exists(path):
        raise directory.missing(path)
    if not directory.is_dcp(path):
        raise CheckpointError(f"{path} is not a complete DCP checkpoint: it has no {METADATA} (a save that did not "
                              "finish, or another kind of directory)")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as err:  # noqa: BLE001 - whatever torch raises for a damaged file
        raise CheckpointError(f"{path}: its {METADATA} is unreadable ({type(err).__name__}: {err})") from None
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{path} is incomplete: {name} is missing")
        if os.path.getsize(file) < end:
            raise CheckpointError(f"{path} is truncated: {name} has {os.path.getsize(file)} bytes, its chunks end "
                                  f"at {end}")
    return metadata


def load_rest(path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
    """Lightning's checkpoint from the DCP directory ``path`` without its tensors: ``meta.pt`` (a ModelParallelStrategy
    checkpoint's too), with a `SliceLoad` for the weights and for each optimizer saved, read later by slice. A
    checkpoint in another layout (torchtitan's, a plain ``dcp.save`` of FSDP2's state dicts: `layout`) has no loop
    state: its `SliceLoad`s alone, and its `Layout` under ``FOREIGN``."""
    path = os.fspath(path)
    metadata = read_metadata(path)
    layout = layout_of(metadata)
    if not layout.lightnings and not os.path.exists(os.path.join(path, META)):
        return {FOREIGN: layout, MODEL: SliceLoad(path, MODEL),
                **({"optimizer_states": [SliceLoad(path, optimizer_key(0))]} if layout.optimizer else {})}
    try:
        rest = torch.load(os.path.join(path, META), weights_only=weights_only is not False)
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {META}: a DCP checkpoint in Lightning's layout, but its save did not "
                              "finish (the loop's state is missing)") from None
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"{path}/{META} could not be loaded with torch.load(weights_only=True): "
                              f"{type(err).__name__}: {err}. If it comes from a source you trust, pass "
                              "weights_only=False (trainer.fit(..., weights_only=False))") from None
    tops = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
    rest[MODEL] = SliceLoad(path, MODEL)
    optimizers = sorted(int(k.removeprefix("optimizer_")) for k in tops if k.startswith("optimizer_"))
    if optimizers:
        rest["optimizer_states"] = [SliceLoad(path, optimizer_key(i)) for i in optimizers]
    return rest


def load_whole(path: str | os.PathLike, weights_only: bool | None = None, spill: str | None = None) -> dict[str, Any]:
    """The whole Lightning checkpoint from a DCP directory, in one process, as the single-file format holds it (the
    optimizer's state by index). For converting and for strategies that are not a plan; training loads by slice.
    ``spill``: a folder where each tensor's storage is a file, memory-mapped (`_spilled`): read into the page cache,
    which the kernel writes back and drops, not into the process's own memory (`sharded.convert`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.fspath(path)
    checkpoint = {k: v for k, v in load_rest(path, weights_only).items() if not _is_slice_load(v)}
    if FOREIGN in checkpoint:
        raise CheckpointError(f"{path} is a DCP checkpoint in another layout than Lightning's (torchtitan's, "
                              "FSDP2's): a plan's strategy resumes from it by slice (trainer.fit(..., ckpt_path=...)), "
                              "strategies.load_pretrained reads its weights, `stratpack convert CKPT OUT --dcp` too")
    metadata = read_metadata(path)
    state: dict[str, Any] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        where = (metadata.planner_data or {}).get(fqn, tuple(fqn.split(".", 1)))
        value = None
        if isinstance(meta, TensorStorageMetadata):
            value = _spilled(meta.size, meta.properties.dtype, spill) if spill else \
                torch.empty(meta.size, dtype=meta.properties.dtype)
        _set_in(state, where, value)
    dcp.load(state, checkpoint_id=path, no_dist=True)
    checkpoint[MODEL] = state.pop(MODEL, {})
    optimizers = sorted((int(k.removeprefix("optimizer_")), v) for k, v in state.items() if k.startswith("optimizer_"))
    if optimizers:
        checkpoint["optimizer_states"] = [by_index(v) for _, v in optimizers]
    return checkpoint


def _spilled(size: torch.Size, dtype: torch.dtype, folder: str) -> torch.Tensor:
    """An empty tensor whose storage is a file of its own under ``folder``, mapped shared: what is written to it and
    read from it lives in the page cache (dropped once written back), so a whole checkpoint passes through one
    process without being held in its memory."""
    numel = math.prod(size)
    if numel == 0:
        return torch.empty(size, dtype=dtype)
    fd, file = tempfile.mkstemp(dir=folder, suffix=".bin")
    try:
        os.ftruncate(fd, numel * dtype.itemsize)
    finally:
        os.close(fd)
    return torch.from_file(file, shared=True, size=numel, dtype=dtype).view(size)


def _is_slice_load(value: Any) -> bool:
    return isinstance(value, SliceLoad) or (isinstance(value, list) and any(isinstance(v, SliceLoad) for v in value))


def _set_in(state: dict, where: tuple, value: Any) -> None:
    """``value`` at the nested path ``where`` (dict keys and list indices, as DCP's planner data records them)."""
    node: Any = state
    for key, after in zip(where[:-1], where[1:]):
        child = isinstance(after, int)
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = [] if child else {}
            node = node[key]
        else:
            node = node.setdefault(key, [] if child else {})
    if isinstance(node, list):
        while len(node) <= where[-1]:
            node.append(None)
    node[where[-1]] = value


def by_index(named: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state named by parameter (torch's ``get_optimizer_state_dict`` layout) as ``Optimizer.state_dict``
    numbers it: parameters in the order of the groups' ``params``."""
    groups, index = [], {}
    for group in named.get("param_groups", []):
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": ids})
    return {"state": {index[name]: entry for name, entry in named.get("state", {}).items() if name in index},
            "param_groups": groups}


def load_into(state: dict[str, Any], path: str | os.PathLike, strict: bool = True, metadata: Any = None) -> None:
    """Fill ``state`` (`slices.rank_state`'s boxes, under this format's names) from the DCP directory ``path``, each
    rank reading only what overlaps its boxes; ``strict``: every entry must be in the checkpoint. Each rank checks its
    own entries inside DCP's planning, which raises any rank's error on every rank (under pp the stages differ).
    ``metadata``: `read_metadata`'s, where the caller has read it already."""
    saved = (metadata or read_metadata(path)).state_dict_metadata
    mine = leaves(state)

    def check() -> None:
        absent = sorted(fqn for fqn, _ in mine if fqn not in saved)
        if strict and absent:
            more = f" and {len(absent) - 5} more" if len(absent) > 5 else ""
            raise CheckpointError(f"{os.fspath(path)} does not hold {', '.join(absent[:5])}{more}: saved from "
                                  "another model (or pass strict_loading=False on the LightningModule)")
        # DCP reads whatever overlaps: a tensor of another shape would load in part, without a word
        wrong = [(fqn.split(".", 1)[-1], torch.Size(saved[fqn].size), torch.Size(leaf.shape)) for fqn, leaf in mine
                 if isinstance(leaf, (Boxed, torch.Tensor)) and fqn in saved and hasattr(saved[fqn], "size")
                 and torch.Size(saved[fqn].size) != torch.Size(leaf.shape)]
        if wrong:
            raise CheckpointError("the checkpoint does not fit this model: " + "; ".join(
                f"size mismatch for {name}: copying a param with shape {theirs} from checkpoint, the shape in current "
                f"model is {ours}" for name, theirs, ours in wrong[:5]))

    load_state(state, os.fspath(path), partial=not strict, check=check)


class DcpFiles:
    """The model weights of any DCP checkpoint, read box by box for `strategies.load_pretrained` (the interface of
    `pretrained.SafetensorsFiles`): Lightning's (``state_dict.*``: the pack's, ``ModelParallelStrategy``'s),
    torchtitan's and `slices`' (``model.*``), or a plain ``dcp.save(model.state_dict())`` (names at the top). ``read``
    fills a box of one tensor from the stored chunks that overlap it, whatever layout saved them (FSDP2's shards, tp
    slices): DCP's file reader reads each such chunk whole, so ``bytes_read`` counts those chunks (a tensor saved as
    one chunk is read whole by every rank that keeps part of it)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path, self.bytes_read = os.fspath(path), 0
        metadata = read_metadata(self.path)
        where, found = paths(metadata), layout_of(metadata).weights(metadata)
        mine = {name: fqn for name, fqn in found.items()
                if isinstance(metadata.state_dict_metadata[fqn], TensorStorageMetadata)}
        self._path = {name: where[fqn] for name, fqn in mine.items()}  # where DCP's flattening put each weight
        self._meta = {name: metadata.state_dict_metadata[fqn] for name, fqn in mine.items()}

        class Cached(FileSystemReader):  # DCP reads .metadata again at every load: once is enough here
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                return metadata

        self._reader = Cached(self.path)

    def keys(self) -> list[str]:
        return list(self._meta)

    @property
    def index(self) -> dict[str, str]:  # (the converters' reader: `pretrained.sharded_to_pretrained`)
        return {key: key for key in self._meta}

    def entries(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Each weight's shape and dtype, read from the metadata alone."""
        return {key: (torch.Size(meta.size), meta.properties.dtype) for key, meta in self._meta.items()}

    def tensor(self, key: str) -> torch.Tensor:
        """``key`` whole, from only the chunks that hold it."""
        return self.read(key, ())

    def lazy(self, key: str) -> LazyWeight:
        return LazyWeight(self, key, tuple(self._meta[key].size))

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``key``'s values at ``index`` (one slice per dim; ``()``: all of it)."""
        import torch.distributed.checkpoint as dcp

        meta = self._meta[key]
        shape = tuple(meta.size)
        bounds = [(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape)]
        bounds += [(0, n) for n in shape[len(bounds):]]
        out = torch.empty([b - a for a, b in bounds], dtype=meta.properties.dtype)
        whole = all((a, b) == (0, n) for (a, b), n in zip(bounds, shape))
        target = out if whole else Boxed(shape, [(tuple(a for a, _ in bounds), tuple(out.shape), out)])
        state: dict[str, Any] = {}
        _set_in(state, self._path[key], target)
        dcp.load(state, storage_reader=self._reader, planner=load_planner(), no_dist=True)
        self.bytes_read += _overlapping_bytes(meta, bounds, out.element_size())
        return out


def _overlapping_bytes(meta: Any, bounds: list[tuple[int, int]], itemsize: int) -> int:
    """Bytes of the stored chunks of ``meta`` (DCP's metadata of a tensor) that overlap the box ``bounds``."""
    total = 0
    for chunk in meta.chunks:
        if all(o < b and a < o + n for (a, b), o, n in zip(bounds, chunk.offsets, chunk.sizes)):
            total += math.prod(chunk.sizes) * itemsize
    return total


def save_lazily(entries: dict[str, tuple[torch.Size, torch.dtype]], read: Callable[[str], torch.Tensor],
                path: str | os.PathLike, top: str = "model") -> None:
    """A DCP directory at ``path`` of the tensors ``entries`` names (shape and dtype each) under ``top`` (torchtitan's
    ``model``), each read by ``read(name)`` only as DCP writes it, into a file of its own: one tensor in memory at a
    time (`stratpack convert --dcp`). Written at ``<path>.tmp-<token>`` and moved in once whole, as a save is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    from torch.distributed.checkpoint.planner import WriteItemType

    class Lazy(DefaultSavePlanner):  # the plan from shapes alone; each tensor's values when its file is written
        def resolve_data(self, write_item: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            return read(write_item.index.fqn.removeprefix(f"{top}.")).contiguous()

    path = os.fspath(path)
    directory.refuse_non_checkpoint(path)
    token = uuid.uuid4().hex[:12]
    tmp = f"{path}.tmp-{token}"
    shapes = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in entries.items()}
    # a file per tensor: DCP's writer holds every tensor of a file until the file is done
    writer = FileSystemWriter(tmp, single_file_per_rank=False, thread_count=1)
    try:
        dcp.save({top: shapes}, storage_writer=writer, planner=Lazy(), no_dist=True)
    except BaseException as err:  # (DCP's CheckpointException is a BaseException): nothing half-written left
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"writing {path}: {type(err).__name__}: {err}") from None
    swap_in(path, tmp, token)


def describe(path: str | os.PathLike) -> tuple[str, int]:
    """The plan and the number of files of the DCP checkpoint at ``path`` (a rank that held nothing of its own to
    write has none; ``?`` for the plan where another tool wrote it)."""
    path = os.fspath(path)
    files = {info.relative_path for info in (read_metadata(path).storage_data or {}).values()}
    try:
        rest = torch.load(os.path.join(path, META), weights_only=True)
        plan = rest.get("stratpack", {}).get("plan", "?")
    except Exception:  # noqa: BLE001 - a checkpoint another tool wrote
        plan = "?"
    return plan, len(files)
