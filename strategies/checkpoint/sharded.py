"""Sharded checkpoints: every rank writes a part of the state, a manifest says where each tensor's parts are.

A checkpoint is a directory:

    manifest.json            format, version, plan, world size, each tensor's shape, dtype and parts, and
                             the byte size of every file (a truncated file is caught before anything loads)
    meta.pt                  the rest of Lightning's checkpoint (loop state, schedulers, callbacks,
                             hyperparameters) with each tensor replaced by its index in the manifest
    shard-00003-of-00008.pt  rank 3's parts: {tensor index: 1-D slice of the flattened tensor}

What is saved is the single-process layout (the strategy's techniques gather it), so the parts are plain ranges of
flattened tensors and the directory loads under any plan and world size, or in one process
(`ShardedCheckpointIO`), and converts to a single file (`convert`). Every large tensor is cut into
world-size equal ranges, one per rank; small ones (< `SMALL` elements) are written whole by rank 0.

Saving is atomic: the ranks write into ``<path>.tmp-<token>``, rank 0 writes the manifest last, and only
then is the directory renamed to ``<path>``; a crash before that leaves any previous checkpoint at
``<path>`` as it was. Loading reads with ``torch.load(weights_only=True)``: no arbitrary objects are
unpickled. Limits: the gather to the single-process layout holds the full state on every rank while saving,
and loading reads every part on every rank.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from strategies.checkpoint.directory import (
    MANIFEST,
    CheckpointError,
    attempt,
    host_copy,
    is_dcp,
    missing,
    raise_failures,
    refuse_non_checkpoint,
    swap_in,
)
from strategies.files import atomic_write, pack_version

FORMAT = "stratpack-sharded"
VERSION = 1
META = "meta.pt"
SMALL = 4096  # elements: smaller tensors are not worth cutting
_REF = "__stratpack_tensor__"


def shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


# -- the layout: which rank writes which range of which tensor ---------------------------------------------


def split_tensors(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """``obj`` with every tensor replaced by ``{_REF: index}``, and the tensors in index order."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return {_REF: len(tensors) - 1}
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):  # not named tuples
            return type(value)(walk(v) for v in value)
        return value

    return walk(obj), tensors


def join_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of `split_tensors`."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_REF}:
            return tensors[skeleton[_REF]]
        return {k: join_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(join_tensors(v, tensors) for v in skeleton)
    return skeleton


def parts(numel: int, world_size: int) -> list[tuple[int, int, int]]:
    """``(rank, start, stop)`` ranges of a flattened tensor of ``numel`` elements, one per writing rank."""
    if numel < SMALL or world_size == 1:
        return [(0, 0, numel)]
    chunk = math.ceil(numel / world_size)
    return [(r, r * chunk, min(numel, (r + 1) * chunk)) for r in range(world_size) if r * chunk < numel]


def layout(tensors: list[torch.Tensor], world_size: int) -> list[dict[str, Any]]:
    return [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
             "parts": [list(p) for p in parts(t.numel(), world_size)]} for t in tensors]


# -- saving -----------------------------------------------------------------------------------------------


def _write(obj: Any, path: str) -> int:
    return atomic_write(path, lambda f: torch.save(obj, f), binary=True)


@dataclass
class Prepared:
    """What one rank writes of a checkpoint, held apart from training (`prepare`): the rest of the checkpoint
    (``skeleton``), every tensor's layout (``entries``) and this rank's ranges, copied to host memory (``mine``)."""

    skeleton: Any
    entries: list[dict[str, Any]]
    mine: dict[str, torch.Tensor]


def prepare(checkpoint: dict[str, Any], rank: int, world_size: int,
            staging: dict[str, torch.Tensor] | None = None) -> Prepared:
    """This rank's part of ``checkpoint`` copied out of training's tensors (to pinned host memory from a GPU, the
    copies in flight together), so that training may go on changing them while the part is written. ``staging``: a
    previous save's copies, written over where they fit (no allocation: on a CPU the first save's fresh pages cost
    1.8 s of a 1.2 GB part against 0.25 s after; pinned memory is slower still to allocate)."""
    skeleton, tensors = split_tensors(checkpoint)
    entries = layout(tensors, world_size)
    staging = staging or {}
    mine = {str(i): host_copy(tensors[i].detach().reshape(-1)[start:stop], staging.get(str(i)))
            for i, entry in enumerate(entries) for r, start, stop in entry["parts"] if r == rank}
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()  # the non-blocking copies have landed
    return Prepared(skeleton, entries, mine)


def save_sharded(checkpoint: dict[str, Any], path: str | os.PathLike, *, rank: int, world_size: int,
                 broadcast: Callable[[Any], Any], gather: Callable[[Any], list[Any]], barrier: Callable[[], None],
                 info: dict[str, Any] | None = None) -> None:
    """Write ``checkpoint`` (the same, full one on every rank) as a sharded directory at ``path``.

    Every rank must call this. ``broadcast(obj)`` returns rank 0's ``obj``; ``gather(obj)`` returns every
    rank's ``obj`` in rank order; ``barrier()`` waits for all (comm.py's, over the world)."""
    refuse_non_checkpoint(path)
    write_prepared(prepare(checkpoint, rank, world_size), path, rank=rank, world_size=world_size,
                   broadcast=broadcast, gather=gather, barrier=barrier, info=info)


def write_prepared(prepared: Prepared, path: str | os.PathLike, *, rank: int, world_size: int,
                   broadcast: Callable[[Any], Any], gather: Callable[[Any], list[Any]], barrier: Callable[[], None],
                   info: dict[str, Any] | None = None) -> None:
    """Write every rank's `prepare`d part into ``<path>.tmp-<token>``, then (rank 0) the metadata, the manifest
    last, and the folder in place: the collectives as `save_sharded`'s (`async_save` runs this in a thread of its
    own, over a process group of its own)."""
    path = os.fspath(path)
    token = broadcast(uuid.uuid4().hex[:12] if rank == 0 else None)
    tmp = f"{path}.tmp-{token}"
    # Every rank must describe the same state, or the parts would not fit together.
    signature = [(e["shape"], e["dtype"]) for e in prepared.entries]
    signatures = gather(signature)
    if any(s != signature for s in signatures):
        bad = [r for r, s in enumerate(signatures) if s != signature]
        raise CheckpointError(f"ranks {bad} hold a different checkpoint layout than rank {rank} (tensor shapes "
                              "or dtypes differ); every rank must save the same single-process state")
    # A rank that fails to write (disk full, permissions) says so to the others instead of leaving them waiting
    # in the next collective: every rank then raises the same error.
    results = gather(attempt(lambda: _write_part(prepared.mine, tmp, rank, world_size)))
    raise_failures(results, "writing its part of")
    status = None
    if rank == 0:
        manifest = {"format": FORMAT, "version": VERSION, "world_size": world_size, **(info or {}),
                    "files": {shard_name(r, world_size): size for r, (size, _) in enumerate(results)},
                    "tensors": prepared.entries}
        status = attempt(lambda: _finish(path, tmp, token, prepared.skeleton, manifest))
    raise_failures([broadcast(status)], "finishing (manifest, rename)")
    barrier()


def _write_part(mine: dict[str, torch.Tensor], tmp: str, rank: int, world_size: int) -> int:
    """This rank's ranges of every tensor, as one file in the save's folder; its size."""
    os.makedirs(tmp, exist_ok=True)
    return _write(mine, os.path.join(tmp, shard_name(rank, world_size)))


def _finish(path: str, tmp: str, token: str, skeleton: Any, manifest: dict[str, Any]) -> None:
    """Rank 0, once every part is written: the metadata, then the manifest (complete from there on), then the
    folder in place of any previous checkpoint."""
    manifest["files"][META] = _write(skeleton, os.path.join(tmp, META))
    atomic_write(os.path.join(tmp, MANIFEST), lambda f: json.dump(manifest, f))  # complete from here on
    swap_in(path, tmp, token)


# -- loading ----------------------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``, after checking that every file it lists is complete."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise missing(path)
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"{path} is not a complete sharded checkpoint: it has no {MANIFEST} (a save that "
                              "did not finish, or another kind of directory)")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{manifest_path} is unreadable: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} checkpoint")
    if manifest.get("version") != VERSION:
        writer = manifest.get("pack_version") or "unknown"
        raise CheckpointError(
            f"{path} is format version {manifest.get('version')} (written by stratpack {writer}); this stratpack "
            f"({pack_version() or 'from source'}) reads version {VERSION}. Load it with the stratpack that wrote it "
            "and save it again, or `stratpack convert` it there to one file, which any version loads")
    for name, size in manifest["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{path} is incomplete: {name} is missing")
        if os.path.getsize(file) != size:
            raise CheckpointError(f"{path} is truncated or altered: {name} has {os.path.getsize(file)} bytes, the "
                                  f"manifest says {size}")
    return manifest


def load_sharded(path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool = True) -> dict[str, Any]:
    """The full checkpoint (single-process layout) from a sharded directory. ``weights_only=False`` lets the
    metadata hold arbitrary objects (hyperparameters as a Namespace...): only for checkpoints you trust."""
    path = os.fspath(path)
    manifest = read_manifest(path)
    world_size = manifest["world_size"]
    try:
        skeleton = torch.load(os.path.join(path, META), weights_only=weights_only)
        shards = [torch.load(os.path.join(path, shard_name(r, world_size)), weights_only=True, mmap=True)
                  for r in range(world_size)]
    except Exception as err:  # noqa: BLE001 - whatever torch raises for a damaged or hostile file
        raise CheckpointError(f"{path}: a file failed to load ({type(err).__name__}: {err})") from None
    tensors = []
    for i in range(len(manifest["tensors"])):
        full = _assemble(path, manifest, shards, i)
        tensors.append(full.to(map_location) if map_location not in (None, "cpu") else full)
    return join_tensors(skeleton, tensors)


def _assemble(path: str, manifest: dict[str, Any], shards: list[dict[str, torch.Tensor]], i: int) -> torch.Tensor:
    """Tensor ``i`` of the checkpoint, put together from its parts in the ranks' files."""
    entry = manifest["tensors"][i]
    full = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
    flat = full.view(-1)
    for r, start, stop in entry["parts"]:
        piece = shards[r].get(str(i))
        if piece is None or piece.numel() != stop - start:
            raise CheckpointError(f"{path}: tensor {i}'s part from rank {r} is missing or of the wrong size")
        flat[start:stop] = piece
    return full


class ShardedReader:
    """The model weights of a sharded checkpoint, one tensor at a time: the ranks' files are memory-mapped, so the
    whole checkpoint is never in memory at once (`pretrained.sharded_to_pretrained`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.manifest = read_manifest(self.path)
        world_size = self.manifest["world_size"]
        try:
            skeleton = torch.load(os.path.join(self.path, META), weights_only=True)
            self._shards = [torch.load(os.path.join(self.path, shard_name(r, world_size)), weights_only=True,
                                       mmap=True) for r in range(world_size)]
        except Exception as err:  # noqa: BLE001 - whatever torch raises for a damaged or hostile file
            raise CheckpointError(f"{self.path}: a file failed to load ({type(err).__name__}: {err})") from None
        state = skeleton.get("state_dict") if isinstance(skeleton, dict) else None
        self.index = {k: v[_REF] for k, v in (state or {}).items() if isinstance(v, dict) and set(v) == {_REF}}

    def tensor(self, key: str) -> torch.Tensor:
        """The state_dict entry ``key``, whole."""
        return _assemble(self.path, self.manifest, self._shards, self.index[key])


def load_any(path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool | None = None) -> dict[str, Any]:
    """A sharded directory, or a single-file checkpoint, read with ``weights_only=True`` unless the caller
    passes ``False`` (Lightning's ``trainer.fit(..., weights_only=False)``) for a file they trust."""
    safe = weights_only is not False
    if is_dcp(path):
        from strategies.checkpoint.dcp_dir import load_whole

        checkpoint = load_whole(path, weights_only=safe)
        return checkpoint if map_location in (None, "cpu") else join_tensors(*_moved(checkpoint, map_location))
    if os.path.isdir(path):
        return load_sharded(path, map_location, weights_only=safe)
    if not os.path.exists(path):
        read_manifest(path)  # raises, naming an interrupted save if one is there
    try:
        return torch.load(path, map_location=map_location, weights_only=safe)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(
            f"{path} could not be loaded with torch.load(weights_only=True): {type(err).__name__}: {err}. If it "
            "comes from a source you trust, pass weights_only=False (trainer.fit(..., weights_only=False))."
        ) from None


def _moved(checkpoint: Any, map_location: Any) -> tuple[Any, list[torch.Tensor]]:
    skeleton, tensors = split_tensors(checkpoint)
    return skeleton, [t.to(map_location) for t in tensors]


def convert(path: str | os.PathLike, out: str | os.PathLike, *, model_only: bool = False,
            strip_prefix: str = "") -> dict[str, Any]:
    """Write the sharded or DCP checkpoint at ``path`` as one file: the whole Lightning checkpoint, or with
    ``model_only`` the model's state_dict (keys without ``strip_prefix``), which ``load_state_dict`` takes. A DCP
    checkpoint passes through files mapped beside ``out`` (`dcp_dir.load_whole`'s ``spill``), removed after: the
    process holds what the page cache keeps of them, not the checkpoint (the gathered format's shards are mapped
    as they are)."""
    from strategies.checkpoint.dcp_dir import load_whole

    out = os.fspath(out)
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=os.path.dirname(os.path.abspath(out))) as spill:
        checkpoint = load_whole(path, spill=spill) if is_dcp(path) else load_sharded(path)
        obj = checkpoint
        if model_only:
            obj = {k.removeprefix(strip_prefix): v for k, v in checkpoint["state_dict"].items()
                   if k.startswith(strip_prefix)}
        tmp = f"{out}.part"
        torch.save(obj, tmp)
        os.replace(tmp, out)
    return obj  # (a mapped file outlives its name: the folder's removal leaves these readable)


class ShardedCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO that also reads sharded checkpoint directories: pass it to a Trainer whose
    strategy is not a plan (one process, ``ddp``, ...) to resume from one, e.g.
    ``Trainer(plugins=[ShardedCheckpointIO()])``. Saving stays Lightning's single file."""

    @override
    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict:
        return load_any(path, map_location or "cpu", weights_only)
