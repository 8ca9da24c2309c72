"""Writing the run store: one folder per run, each rank its own append-only file of step records."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from strategies.files import atomic_write, pack_version, package_version
from strategies.plan import ParallelPlan
from strategies.runs.schema import META, RESTARTS, RUNS_ENV, SCHEMA, SUMMARY


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



def write_json(path: Path, obj: Any) -> None:
    """Atomically (`atomic_write`), non-finite numbers as null."""
    atomic_write(path, lambda f: json.dump(_clean(obj), f, indent=1, allow_nan=False))



class RunWriter:
    """One rank's writer for one run: rank 0 writes meta and summary, every rank its step records."""

    def __init__(self, root: str | os.PathLike | None, run_id: str, rank: int) -> None:
        self.path = runs_dir(root) / run_id
        self.rank = rank
        self.path.mkdir(parents=True, exist_ok=True)
        self._log = _append_to(self.path / f"rank{rank:05d}.jsonl")

    def write_meta(self, meta: dict[str, Any]) -> None:
        write_json(self.path / META, {"schema": SCHEMA, **meta})

    def append(self, record: dict[str, Any]) -> None:
        self._log.write(json.dumps(_clean({"schema": SCHEMA, "rank": self.rank, **record}), allow_nan=False) + "\n")
        self._log.flush()

    def add_restart(self, entry: dict[str, Any]) -> None:
        """Rank 0, as a restarted attempt starts: its entry in the run's restarts (`runs.restarts`); the run is going
        on, so a summary an earlier attempt wrote no longer marks it complete."""
        with _append_to(self.path / RESTARTS) as f:
            f.write(json.dumps(_clean(entry), allow_nan=False) + "\n")
        (self.path / SUMMARY).unlink(missing_ok=True)

    def finish(self, summary: dict[str, Any] | None) -> None:
        """Close this rank's log; rank 0 also writes the summary that marks the run complete."""
        self._log.close()
        if summary is not None:
            write_json(self.path / SUMMARY, {"schema": SCHEMA, "status": "complete", "finished": time.time(),
                                             **summary})


def _append_to(path: Path):
    """``path`` opened to append lines: a file that a killed process left in half a line first gets its line ended
    (the half line is then one bad line readers leave out, not the start of the next record)."""
    log = open(path, "a+")
    if log.tell():
        log.seek(log.tell() - 1)
        if log.read(1) != "\n":
            log.write("\n")
    return log


def run_meta(*, run_id: str, label: str, comparison: str | None, world_size: int, devices: list[str],
             plan: ParallelPlan | None, degrees_of: ParallelPlan | None = None, model: dict | None = None,
             num_params: int | None = None, **extra: Any) -> dict[str, Any]:
    """A run's meta.json (the monitor's runs and `stratpack bench`'s alike): who ran what, where, with which
    versions. ``plan``: the resolved plan the run trained with (None for another strategy); ``degrees_of``: the plan
    whose degrees describe the run (default ``plan``; a bench peer gives its twin's)."""
    degrees_of = degrees_of or plan
    return {
        "run_id": run_id, "comparison": comparison, "label": label, "plan": str(plan) if plan is not None else None,
        "degrees": {k: getattr(degrees_of, k) for k in ("dp", "tp", "cp", "pp", "microbatches", "virtual")}
        if degrees_of is not None else None,
        "world_size": world_size, "devices": devices,
        "versions": {"torch": package_version("torch"), "lightning": package_version("lightning"),
                     "stratpack": pack_version(), "python": sys.version.split()[0]},
        "model": model, "num_params": num_params, "git": git_revision(), "started": time.time(), **extra,
    }


def precision_label(precision: Any, param_dtype: Any = None) -> str | None:
    """How a run computed, for a table: Lightning's precision, and the strategy's ``param_dtype`` where it had one
    (meta.json's ``torch.bfloat16`` and a RunConfig's ``bf16`` alike): ``bf16-mixed, param_dtype bf16``."""
    if not precision:
        return None
    half = {"bfloat16": "bf16", "float16": "fp16"}.get(str(param_dtype or "").removeprefix("torch."), param_dtype)
    return f"{precision}, param_dtype {half}" if half else str(precision)


def git_revision() -> str | None:
    """The checkout's short commit, where the run starts inside one."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None
