"""What both checkpoint formats share (`sharded`, `dcp_dir`): their error, what a checkpoint directory is, and the
atomic save's steps: write into ``<path>.tmp-<token>``, then move it in (`swap_in`), every rank told of any rank's
failure."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: missing, truncated, of another format, or of another model."""


def is_sharded(path: str | os.PathLike) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def is_dcp(path: str | os.PathLike) -> bool:
    """A torch Distributed Checkpoint directory (`dcp_dir`: DCP writes its ``.metadata`` last)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


def host_copy(piece: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    if into is not None and into.shape == piece.shape and into.dtype == piece.dtype:
        return into.copy_(piece, non_blocking=piece.is_cuda)
    if piece.is_cuda:
        out = torch.empty(piece.shape, dtype=piece.dtype, pin_memory=True)
        return out.copy_(piece, non_blocking=True)
    return piece.to("cpu", copy=True)


def refuse_non_checkpoint(path: str | os.PathLike) -> None:
    path = os.fspath(path)
    if os.path.lexists(path) and not (is_sharded(path) or is_dcp(path) or os.path.isfile(path)):
        # Every rank sees the same path: all refuse together, before any collective.
        raise CheckpointError(f"{path} exists and is not a checkpoint: not replacing it")


def swap_in(path: str, tmp: str, token: str) -> None:
    """The complete checkpoint at ``tmp`` put in place of any at ``path``. Two renames: between them the new one is
    complete at tmp and the old one at ``<path>.old-<token>``, and `read_manifest` names both if a crash happens
    right there."""
    old = f"{path}.old-{token}"
    if os.path.lexists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    if os.path.lexists(old):
        shutil.rmtree(old) if os.path.isdir(old) and not os.path.islink(old) else os.remove(old)


def attempt(fn) -> tuple[Any, str | None]:
    """``(fn(), None)``, or ``(None, the error)`` when it raises an OSError or a CheckpointError."""
    try:
        return fn(), None
    except Exception as err:  # noqa: BLE001 - any (a pickling error too): every rank must hear of it
        return None, f"{type(err).__name__}: {err}"


def raise_failures(results: list[tuple[Any, str | None]], what: str) -> None:
    failed = {r: err for r, (_, err) in enumerate(results) if err is not None}
    if failed:
        detail = "; ".join(f"rank {r}: {err}" for r, err in failed.items())
        raise CheckpointError(f"saving the checkpoint failed {what} it ({detail}); the previous checkpoint, if "
                              "any, is untouched")


def missing(path: str) -> CheckpointError:
    """No checkpoint at ``path``: the error, naming what an interrupted save left beside it."""
    folder, name = os.path.dirname(path) or ".", os.path.basename(path)
    leftovers = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    old = [n for n in leftovers if n.startswith(name + ".old-")]
    tmp = [n for n in leftovers if n.startswith(name + ".tmp-")]
    hint = ""
    if old:  # a crash between the two renames of a save: both checkpoints are whole
        hint = f" (a save was interrupted while replacing it: the previous checkpoint is whole at {old[0]}"
        whole = tmp and (is_sharded(os.path.join(folder, tmp[0])) or is_dcp(os.path.join(folder, tmp[0])))
        hint += f", the new one at {tmp[0]}" if whole else ""
        hint += "; rename one back)"
    elif tmp:
        hint = f" (an interrupted save left {tmp[0]}, which is incomplete)"
    return CheckpointError(f"no checkpoint at {path}{hint}")
