"""The run store: what every run measured, on local disk, in a documented and versioned schema.

    runs/                                  ``$STRATPACK_RUNS``, else ``./runs`` (or ``--runs-dir``)
      20261122-213012-zero3_tp2-4f1c/      one folder per run
        meta.json       written once at the start, atomically: the run's identity and environment
        rank00003.jsonl one line per optimizer step from rank 3, appended and flushed every step
        summary.json    written atomically at the end by rank 0; its absence marks the run incomplete

Schema version 1 (`SCHEMA`), present in every file and record:

- ``meta.json``: ``schema``, ``run_id``, ``comparison`` (an id shared by the runs of one comparison, or
  null), ``label`` (the strategy as given), ``plan`` (canonical, resolved) or null for non-plan strategies,
  ``degrees`` {dp, tp, pp, microbatches, virtual}, ``world_size``, ``devices`` (names), ``versions``
  {torch, lightning, stratpack, python}, ``model`` (config), ``num_params``, ``seed``, ``git``, ``started``
  (unix time).
- ``rank*.jsonl`` records: ``schema``, ``rank``, ``step``, ``time`` (unix), ``step_time_s``, ``loss``
  (this rank's), ``lr``, ``samples_per_s``, ``tokens_per_s``, ``memory`` (bytes by category:
  params, grads, optimizer, host, activations_peak, peak_rss, and on CUDA max_allocated, max_reserved),
  ``comm`` ({"all_reduce/dp": {"calls", "bytes_sent", "bytes_recv", "wait_s"}} during this step),
  ``bubble`` (pipeline: this rank's idle fraction) or null.
- ``summary.json``: ``schema``, ``status`` ("complete"), ``finished`` (unix time), and the monitor's
  summary (losses, tokens_per_s, comm_per_step, memory_bytes_per_rank, pipeline timeline, estimate).

Non-finite numbers are written as null. Each rank writes only its own file, so concurrent runs and ranks
never write to the same file; readers take complete lines only (a crash can leave half a line).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

SCHEMA = 1
RUNS_ENV = "STRATPACK_RUNS"
META, SUMMARY = "meta.json", "summary.json"


def runs_dir(path: str | os.PathLike | None = None) -> Path:
    """``path``, else ``$STRATPACK_RUNS``, else ``./runs``."""
    return Path(path or os.environ.get(RUNS_ENV) or "runs")


def new_run_id(label: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in label)[:60]
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}-{uuid.uuid4().hex[:4]}"


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats as null, tuples as lists, numpy/torch scalars as numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        try:
            return _clean(value.item())
        except (ValueError, RuntimeError):
            return None
    return value


def atomic_write(path: str | os.PathLike, write: Callable[[IO], Any], binary: bool = False) -> int:
    """Write a file whole or not at all: ``write(f)`` into a temp file in the same folder, flushed to disk,
    then ``os.replace`` onto ``path``. Returns the file's size. (The run store's JSON and the sharded
    checkpoints' files both go through here.)"""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb" if binary else "w") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


def write_json(path: Path, obj: Any) -> None:
    """Atomically (`atomic_write`), non-finite numbers as null."""
    atomic_write(path, lambda f: json.dump(_clean(obj), f, indent=1, allow_nan=False))


def pack_version() -> str | None:
    """The installed stratpack's version (None when run from a tree that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stratpack")
    except PackageNotFoundError:
        return None


class RunWriter:
    """One rank's writer for one run: rank 0 writes meta and summary, every rank its step records."""

    def __init__(self, root: str | os.PathLike | None, run_id: str, rank: int) -> None:
        self.path = runs_dir(root) / run_id
        self.rank = rank
        self.path.mkdir(parents=True, exist_ok=True)
        self._log = open(self.path / f"rank{rank:05d}.jsonl", "a")

    def write_meta(self, meta: dict[str, Any]) -> None:
        write_json(self.path / META, {"schema": SCHEMA, **meta})

    def append(self, record: dict[str, Any]) -> None:
        self._log.write(json.dumps(_clean({"schema": SCHEMA, "rank": self.rank, **record}), allow_nan=False) + "\n")
        self._log.flush()

    def finish(self, summary: dict[str, Any] | None) -> None:
        """Close this rank's log; rank 0 also writes the summary that marks the run complete."""
        self._log.close()
        if summary is not None:
            write_json(self.path / SUMMARY, {"schema": SCHEMA, "status": "complete", "finished": time.time(),
                                             **summary})


# -- reading ----------------------------------------------------------------------------------------------


class RunError(ValueError):
    """A run folder that cannot be read as a run (no meta, wrong schema, not JSON)."""


_RANK_FILE = re.compile(r"rank(\d+)\.jsonl")


def _regular(path: Path, max_bytes: int | None) -> bool:
    """A plain file inside the run folder (not a link out of it, not a device), not larger than ``max_bytes``."""
    try:
        info = path.lstat()
    except OSError:
        return False
    if not stat.S_ISREG(info.st_mode):
        raise RunError(f"{path.parent.name}: {path.name} is not a regular file (a link or a device): not read")
    if max_bytes is not None and info.st_size > max_bytes:
        raise RunError(f"{path.parent.name}: {path.name} is {info.st_size >> 20} MiB, over the {max_bytes >> 20} MiB "
                       "a reader takes")
    return True


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete lines of one rank's log (a half-written last line is left out; bad lines too)."""
    out = []
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # being written, or cut by a crash
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
    return out


def read_run(path: str | os.PathLike, max_bytes: int | None = None) -> dict[str, Any]:
    """``{"meta", "records": {rank: [...]}, "summary" or None, "status"}`` of one run folder. Only regular
    files are read (no links out of the folder), each at most ``max_bytes``; RunError says what is wrong."""
    path = Path(path)
    if not _regular(path / META, max_bytes):
        raise RunError(f"{path.name}: no {META} (not a run, or one that crashed before it started)")
    try:
        meta = json.loads((path / META).read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise RunError(f"{path.name}: {META} is not JSON ({err})") from None
    if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
        raise RunError(f"{path.name}: schema {meta.get('schema') if isinstance(meta, dict) else '?'}, this "
                       f"version reads schema {SCHEMA}")
    records = {}
    for log in sorted(path.iterdir()):
        match = _RANK_FILE.fullmatch(log.name)
        if match and _regular(log, max_bytes):
            records[int(match.group(1))] = read_records(log)
    summary = None
    if _regular(path / SUMMARY, max_bytes):
        try:
            summary = json.loads((path / SUMMARY).read_text())
        except (ValueError, UnicodeDecodeError):
            summary = None
        if not isinstance(summary, dict):
            summary = None
    return {"meta": meta, "records": records, "summary": summary,
            "status": "complete" if summary is not None else "incomplete", "path": str(path)}


def list_runs(root: str | os.PathLike | None = None) -> list[Path]:
    """Run folders under the runs directory, oldest first."""
    root = runs_dir(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / META).exists())
