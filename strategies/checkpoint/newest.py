"""Which checkpoint a restarted run resumes from: the newest complete one in its checkpoint folder.

A run restarted by torchrun (``--max-restarts``) or a SLURM requeue starts from the top of its script; with
``resume="auto"`` (`stratpack train --resume auto`, `PlanStrategy(resume="auto")`) it takes the newest checkpoint in
the folder ModelCheckpoint writes to, by the step in its name (ModelCheckpoint's ``step=N``), then by time. A
checkpoint is complete when every file its manifest lists is there at its size (`sharded.read_manifest`; the
manifest is the last thing a save writes), or every chunk DCP's ``.metadata`` lists (`dcp_dir.read_metadata`), or,
for a single file, when it is a whole zip (torch.save's format keeps its index at the end, so a file cut short has
none). A newer one that is not complete (a save torn by the crash) is passed over, and said so.
"""

from __future__ import annotations

import os
import re
import zipfile

from strategies.checkpoint.dcp_dir import read_metadata
from strategies.checkpoint.directory import CheckpointError, is_dcp
from strategies.checkpoint.sharded import read_manifest

_STEP = re.compile(r"step=(\d+)")


def newest_checkpoint(folder: str | os.PathLike) -> tuple[str | None, list[str]]:
    """The newest complete checkpoint in ``folder`` (None: none yet, or no folder), and a line for each newer one
    passed over, with why."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return None, []
    skipped = []
    for path in sorted(_candidates(folder), key=_order, reverse=True):
        why = _incomplete(path)
        if why is None:
            return path, skipped
        skipped.append(f"{path}: {why}")
    return None, skipped


def _candidates(folder: str) -> list[str]:
    """Checkpoint directories and files: every entry but the hidden ones (a file being written) and an interrupted
    save's old copy (``.old-``: the previous checkpoint, kept while the new one is moved in)."""
    names = [n for n in os.listdir(folder) if not n.startswith(".") and ".old-" not in n]
    return [os.path.join(folder, n) for n in names if os.path.isdir(os.path.join(folder, n)) or n.endswith(".ckpt")]


def _order(path: str) -> tuple[int, float]:
    found = _STEP.findall(os.path.basename(path))
    return (int(found[-1]) if found else -1, os.path.getmtime(path))


def _incomplete(path: str) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed from, or None."""
    if ".tmp-" in os.path.basename(path):
        return "a save that never finished (its folder was not moved in)"
    if os.path.isdir(path):
        try:
            read_metadata(path) if is_dcp(path) else read_manifest(path)
            if is_dcp(path) and not os.path.isfile(os.path.join(path, "meta.pt")):
                return "a DCP directory without meta.pt (not a Lightning checkpoint)"
        except CheckpointError as err:
            return str(err)
        return None
    if not zipfile.is_zipfile(path):
        return "not a whole checkpoint file (cut short?)"
    return None
