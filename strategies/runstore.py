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
  (unix time), ``predicted`` (the estimator's figures, or null); from ``stratpack bench`` also ``bench``
  (the pair, its ratios and both sides' per-rank peaks; ``role`` "ours" or "peer").
- ``rank*.jsonl`` records: ``schema``, ``rank``, ``step``, ``time`` (unix), ``step_time_s``, ``loss``
  (this rank's), ``lr``, ``samples_per_s``, ``tokens_per_s``, ``memory`` (bytes by category:
  params, grads, optimizer, host, activations_peak, peak_rss, and on CUDA max_allocated, max_reserved),
  ``comm`` ({"all_reduce/dp": {"calls", "bytes_sent", "bytes_recv", "wait_s"}} per step), ``bubble``
  (pipeline: this rank's idle fraction) or null, ``steps`` (the steps the record stands for: 1, more once a
  long run's records thin out, see `monitor.keep_record`; its comm figures are their mean). A bench record's
  ``memory`` is ``max_allocated`` only (the profiled peak of torch's allocator, on CPU too).
- ``summary.json``: ``schema``, ``status`` ("complete"), ``finished`` (unix time), and the monitor's
  summary (losses, tokens_per_s, comm_per_step, memory_bytes_per_rank, pipeline timeline, estimate).

Non-finite numbers are written as null. Each rank writes only its own file, so concurrent runs and ranks
never write to the same file; readers take complete lines only (a crash can leave half a line).

`read_run` reads only a run folder's own plain files (no links, pipes or devices, each up to a size), and checks
the fields readers use against META_SHAPE, RECORD_SHAPE and SUMMARY_SHAPE: a meta.json that differs makes the
folder no run; a record line or a summary that differs is left out, and the run's "problems" say so.
"""

from __future__ import annotations

import errno
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


def new_comparison_id(prefix: str = "cmp") -> str:
    """An id the runs of one comparison share (``cmp-...`` from `stratpack compare`, ``bench-...`` from bench)."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


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
    """A run folder that cannot be read as a run (no meta, wrong schema, not JSON, fields of the wrong type)."""


_RANK_FILE = re.compile(r"rank(\d+)\.jsonl")

# The fields readers use, and their shapes: a file that differs is refused (meta.json) or left out (a record, the
# summary) with a message saying where, instead of failing later in what draws it. A shape is "int", "num" (finite),
# "str", None (null), a tuple (any one of), [item] (a list of), [a, b] (a list of exactly those), or {key: shape} (an
# object: those keys where present, "*" any other key, "!" the keys it must have). Keys not named are not checked.
_NUM = ("num", None)
_MEMORY = {k: _NUM for k in ("params", "grads", "optimizer", "host", "activations", "total", "activations_peak")}
_EVENT = {"!": ("action", "start", "end"), "action": "str", "phase": "str", "start": "num", "end": "num"}
META_SHAPE = {
    "!": ("schema", "run_id", "label"), "schema": "int", "run_id": "str", "label": "str", "comparison": ("str", None),
    "plan": ("str", None), "degrees": ({"*": ("int", None)}, None), "world_size": ("int", None), "devices": ["str"],
    "num_params": ("int", None), "predicted": ({"memory": [_MEMORY]}, None),
}
RECORD_SHAPE = {"!": ("schema",), "schema": "int", "step": ("int", None), "time": _NUM, "step_time_s": _NUM,
                "loss": _NUM, "tokens_per_s": _NUM, "memory": (_MEMORY, None)}
SUMMARY_SHAPE = {
    "losses": [_NUM], "tokens_per_s": _NUM, "mfu": _NUM, "comm_per_step": {"*": {"bytes_sent": _NUM, "wait_s": _NUM}},
    "pipeline": ({"bubble_ideal": _NUM, "bubble_measured": _NUM, "partition": ["str"], "timeline": [_EVENT],
                  "timelines": {"*": [_EVENT]}, "ideal": {"*": [["str", "num"]]}}, None),
}
_NAMES = {"int": "an integer", "num": "a number", "str": "a string", None: "null", list: "a list", dict: "an object"}


def _kind(value: Any) -> str:
    """What a JSON value is, in words."""
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int):
        return "a number" if abs(value) < 2**63 else "an integer too large (2**63 or more)"
    if isinstance(value, float):
        return "a number" if math.isfinite(value) else "NaN or infinity"
    return _NAMES.get(type(value) if isinstance(value, (list, dict)) else "str" if isinstance(value, str) else None,
                      "null")


def _fits(value: Any, shape: Any) -> bool:
    """``value`` is of ``shape``'s kind, outside only (`_misfit` looks inside)."""
    if shape is None or shape == "str":
        return value is None if shape is None else isinstance(value, str)
    if isinstance(shape, (list, dict)):
        return isinstance(value, type(shape))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, int):
        return abs(value) < 2**63  # an int64: a bigger one counts nothing a run measures
    return shape == "num" and math.isfinite(value)


def _misfit(value: Any, shape: Any, where: str = "") -> str | None:
    """Where ``value`` is not of ``shape`` (see META_SHAPE), in words; None when it is."""
    shapes = shape if isinstance(shape, tuple) else (shape,)
    shape = next((s for s in shapes if _fits(value, s)), ...)
    if shape is ...:
        expected = " or ".join(_NAMES[type(s) if isinstance(s, (list, dict)) else s] for s in shapes)
        return f"{where or 'it'} is {_kind(value)}, not {expected}"
    if isinstance(shape, list):
        if len(shape) > 1 and len(value) != len(shape):
            return f"{where or 'it'} has {len(value)} items, not {len(shape)}"
        items = ((item, shape[i] if len(shape) > 1 else shape[0], f"{where}[{i}]") for i, item in enumerate(value))
    elif isinstance(shape, dict):
        missing = [key for key in shape.get("!", ()) if key not in value]
        if missing:
            return f"{where or 'it'} has no {missing[0]!r}"
        items = ((item, shape[key] if key in shape and key not in ("!", "*") else shape["*"],
                  f"{where}.{key:.40}" if where else f"{key:.40}")
                 for key, item in value.items() if (key in shape and key not in ("!", "*")) or "*" in shape)
    else:
        return None
    return next(filter(None, (_misfit(*item) for item in items)), None)


_OPEN = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)  # no link; a pipe must not block


def _read(folder: int, run: str, name: str, max_bytes: int | None) -> bytes | None:
    """The bytes of the plain file ``name`` in the run folder open as ``folder`` (None when there is none). A link
    (wherever it points), a device, a pipe or a folder is not read, nor a file over ``max_bytes``: RunError says so."""
    try:
        fd = os.open(name, _OPEN, dir_fd=folder)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise RunError(f"{run}: {name} is not a regular file (a link or a device): not read; copy the file "
                           "itself into the run folder") from None
        raise RunError(f"{run}: {name} cannot be read ({err.strerror}): not read") from None
    try:  # what was opened is what is checked: no window between a check and the open
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RunError(f"{run}: {name} is not a regular file (a link or a device): not read")
        if max_bytes is not None and info.st_size > max_bytes:
            raise RunError(f"{run}: {name} is {info.st_size:,} bytes, over the {max_bytes:,} a reader takes from one "
                           "file: not read (no run writes that much; move the file out of the run folder)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if max_bytes is not None and len(data) > max_bytes:  # it grew while being read
        raise RunError(f"{run}: {name} grew past the {max_bytes:,} bytes a reader takes from one file: not read")
    return data


def _json(data: bytes, run: str, name: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as err:  # UnicodeDecodeError too: binary, or not UTF-8
        raise RunError(f"{run}: {name} is not JSON ({str(err)[:120]})") from None
    except RecursionError:
        raise RunError(f"{run}: {name} is not JSON a reader takes (nested too deeply)") from None


def _records(data: bytes) -> tuple[list[dict[str, Any]], list[str], bool]:
    """One rank's log: its records, what is wrong with each line that is not a record of this schema, and whether
    it ends in half a line (a run being written, or one cut by a crash: readers take complete lines only)."""
    lines = data.split(b"\n")
    partial = lines.pop() != b""
    out, bad = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            bad.append(f"line {number} is not JSON")
            continue
        misfit = f"it is {_kind(record)}, not an object" if not isinstance(record, dict) else \
            _misfit(record, RECORD_SHAPE) or (f"schema {record['schema']}" if record["schema"] != SCHEMA else None)
        if misfit:
            bad.append(f"line {number}: {misfit}")
        else:
            out.append(record)
    return out, bad, partial


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete lines of one rank's log (a half-written last line is left out; lines not records too)."""
    return _records(Path(path).read_bytes())[0]


def read_run(path: str | os.PathLike, max_bytes: int | None = None) -> dict[str, Any]:
    """``{"meta", "records": {rank: [...]}, "summary" or None, "status", "problems"}`` of one run folder. Only the
    folder's own plain files are read (a folder or file that is a link is refused: nothing outside the store is
    read), each at most ``max_bytes``. A meta.json that is not of this schema raises RunError saying what is wrong;
    record lines and a summary that are not leave out just themselves, and "problems" says so."""
    path = Path(path)
    run = path.name
    try:
        folder = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        kind = "a link, not a folder of the run store" if path.is_symlink() else f"not a folder ({err.strerror})"
        raise RunError(f"{run}: {kind}: not read; copy the run itself into the store") from None
    try:
        return _read_run(folder, path, max_bytes)
    finally:
        os.close(folder)


def _read_run(folder: int, path: Path, max_bytes: int | None) -> dict[str, Any]:
    run = path.name
    raw = _read(folder, run, META, max_bytes)
    if raw is None:
        raise RunError(f"{run}: no {META} (not a run, or one that crashed before it started)")
    meta = _json(raw, run, META)
    if not isinstance(meta, dict):
        raise RunError(f"{run}: {META} holds {_kind(meta)}, not an object: not a run of this pack")
    if type(meta.get("schema")) is not int or meta["schema"] != SCHEMA:
        raise RunError(f"{run}: schema {meta.get('schema')!r:.40}, this version reads schema {SCHEMA}"
                       + (" (the integer)" if meta.get("schema") == SCHEMA else ""))
    misfit = _misfit(meta, META_SHAPE)
    if misfit:
        raise RunError(f"{run}: {META}: {misfit}, which schema {SCHEMA} does not allow (see strategies/runstore.py): "
                       "not read")
    records, problems, partial = {}, [], []
    for name in sorted(os.listdir(folder)):
        match = _RANK_FILE.fullmatch(name)
        raw = _read(folder, run, name, max_bytes) if match else None
        if raw is not None:
            records[int(match.group(1))], bad, cut = _records(raw)
            if bad:
                problems.append(f"{run}: {name}: {len(bad)} line(s) are not records of schema {SCHEMA} ({bad[0]}"
                                f"{', ...' if len(bad) > 1 else ''}): left out, the rest of the run is shown")
            if cut:
                partial.append(name)
    summary, raw = None, _read(folder, run, SUMMARY, max_bytes)
    if raw is not None:
        try:
            summary = _json(raw, run, SUMMARY)
            misfit = f"it holds {_kind(summary)}, not an object" if not isinstance(summary, dict) else \
                _misfit(summary, SUMMARY_SHAPE)
            if misfit:
                raise RunError(f"{run}: {SUMMARY}: {misfit}")
        except RunError as err:
            summary = None
            problems.append(f"{err}: the end-of-run summary is left out, the steps are shown")
        if partial:  # a finished run's logs end in whole lines: these were cut (a copy, a full disk)
            problems.append(f"{run}: {', '.join(partial)} end(s) in half a line (cut by a copy or a full disk?): "
                            "that line is left out")
    return {"meta": meta, "records": records, "summary": summary, "problems": problems,
            "status": "complete" if raw is not None else "incomplete", "path": str(path)}


def list_runs(root: str | os.PathLike | None = None) -> list[Path]:
    """Run folders under the runs directory, oldest first."""
    root = runs_dir(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / META).exists())
