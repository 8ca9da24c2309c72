"""Reading the run store: only a run folder's own plain files, each checked against the schema."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from strategies.runs.schema import (
    META,
    META_SHAPE,
    RECORD_SHAPE,
    RESTART_SHAPE,
    RESTARTS,
    SCHEMA,
    SUMMARY,
    SUMMARY_SHAPE,
    kind_of,
    misfit,
)
from strategies.runs.write import runs_dir


class RunError(ValueError):
    """A run folder that cannot be read as a run (no meta, wrong schema, not JSON, fields of the wrong type)."""


_RANK_FILE = re.compile(r"rank(\d+)\.jsonl")

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


def _records(data: bytes, shape: dict = RECORD_SHAPE) -> tuple[list[dict[str, Any]], list[str], bool]:
    """One rank's log (or the run's restarts, ``shape`` theirs): its records, what is wrong with each line that is
    not a record of this schema, and whether it ends in half a line (a run being written, or one cut by a crash:
    readers take complete lines only)."""
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
        wrong = f"it is {kind_of(record)}, not an object" if not isinstance(record, dict) else \
            misfit(record, shape) or (f"schema {record['schema']}" if record["schema"] != SCHEMA else None)
        if wrong:
            bad.append(f"line {number}: {wrong}")
        else:
            out.append(record)
    return out, bad, partial


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
    meta = _read_meta(folder, run, max_bytes)
    records, problems, partial = _read_records(folder, run, max_bytes)
    summary, raw = None, _read(folder, run, SUMMARY, max_bytes)
    if raw is not None:
        try:
            summary = _json(raw, run, SUMMARY)
            wrong = f"it holds {kind_of(summary)}, not an object" if not isinstance(summary, dict) else \
                misfit(summary, SUMMARY_SHAPE)
            if wrong:
                raise RunError(f"{run}: {SUMMARY}: {wrong}")
        except RunError as err:
            summary = None
            problems.append(f"{err}: the end-of-run summary is left out, the steps are shown")
        if partial:  # a finished run's logs end in whole lines: these were cut (a copy, a full disk)
            problems.append(f"{run}: {', '.join(partial)} end(s) in half a line (cut by a copy or a full disk?): "
                            "that line is left out")
    records, errors = _split_errors(records)
    restarts, bad, _ = _records(_read(folder, run, RESTARTS, max_bytes) or b"", RESTART_SHAPE)
    if bad:
        problems.append(f"{run}: {RESTARTS}: {len(bad)} line(s) left out ({bad[0]})")
    return {"meta": meta, "records": records, "summary": summary, "problems": problems, "restarts": restarts,
            "status": "complete" if raw is not None else "incomplete", "path": str(path), "errors": errors}


def _split_errors(records: dict[int, list]) -> tuple[dict[int, list], dict[int, dict[str, Any]]]:
    """Each rank's steps, and each failed rank's last line apart (its error and last calls, written by
    `StrategyMonitor.on_exception`)."""
    steps = {rank: [r for r in lines if "error" not in r] for rank, lines in records.items()}
    errors = {rank: failed[-1] for rank, lines in records.items() if (failed := [r for r in lines if "error" in r])}
    return steps, errors


def _read_meta(folder: int, run: str, max_bytes: int | None) -> dict[str, Any]:
    """The run's meta.json, or RunError saying why the folder is no run of this schema."""
    raw = _read(folder, run, META, max_bytes)
    if raw is None:
        raise RunError(f"{run}: no {META} (not a run, or one that crashed before it started)")
    meta = _json(raw, run, META)
    if not isinstance(meta, dict):
        raise RunError(f"{run}: {META} holds {kind_of(meta)}, not an object: not a run of this pack")
    if type(meta.get("schema")) is not int or meta["schema"] != SCHEMA:
        raise RunError(f"{run}: schema {meta.get('schema')!r:.40}, this version reads schema {SCHEMA}"
                       + (" (the integer)" if meta.get("schema") == SCHEMA else ""))
    wrong = misfit(meta, META_SHAPE)
    if wrong:
        raise RunError(f"{run}: {META}: {wrong}, which schema {SCHEMA} does not allow (see strategies/runs): "
                       "not read")
    return meta


def _read_records(folder: int, run: str, max_bytes: int | None) -> tuple[dict[int, list], list[str], list[str]]:
    """Every rank's records, what was left out of them, and the rank files that end in half a line."""
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
    return records, problems, partial


def list_runs(root: str | os.PathLike | None = None) -> list[Path]:
    """Run folders under the runs directory, oldest first."""
    root = runs_dir(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / META).exists())
