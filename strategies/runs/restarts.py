"""One run across restarts: a run resumed from its own checkpoint goes on in the same run folder.

The checkpoint carries the run's id (`StrategyMonitor.state_dict`). When a fit resumes from it and the run's folder is
in the store, rank 0 of the new attempt appends an entry to the run's ``restarts.jsonl`` (`restart_entry`) and every
rank appends its records to its own file as before, each with ``attempt`` (2, 3, ...). The steps the previous
attempt had recorded past the checkpoint are done again: their new records carry ``redone: true``, so the store
holds every step once unmarked, plus the redone ones. An entry:

    attempt        the attempt that starts here (the run's first is 1)
    time           when it started (unix)
    resumed_step   the checkpoint's optimizer step
    redone         [first, last] steps the previous attempt recorded past it, or null
    last_steps     each rank's last step recorded in the previous attempt: its records up to there are redone
    cause, ranks   what stopped the previous attempt and which ranks (`_cause`)
    time_lost_s    from the checkpoint's step (its record on rank 0) to this start: the work done again and the
                   time the job was down
    downtime_s     from the previous attempt's last record to this start
    checkpoint     the checkpoint resumed from
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from pathlib import Path
from typing import Any

from strategies.runs.schema import SCHEMA


def attempt_of(record: dict[str, Any]) -> int:
    return record.get("attempt", 1)


def sigterm_file(run_path: str | os.PathLike, rank: int, attempt: int) -> Path:
    return Path(run_path) / f"rank{rank:05d}-attempt{attempt}.sigterm"


def note_sigterm(run_path: str | os.PathLike, rank: int, attempt: int) -> Any:
    """Have a SIGTERM leave a mark (`sigterm_file`: the stack it came in) before Python's handlers run, so that the
    next attempt can tell the ranks the launcher stopped from the one that died first. Written from the C handler:
    a rank blocked in a collective never runs a Python handler before the launcher's SIGKILL. Returns the open file
    (`faulthandler` writes to it; close it with `stop_noting`), or None where signals cannot be watched."""
    if not hasattr(faulthandler, "register"):  # Windows
        return None
    marks = open(sigterm_file(run_path, rank, attempt), "w")  # noqa: SIM115 - kept open for the signal
    faulthandler.register(signal.SIGTERM, file=marks, all_threads=False, chain=True)
    return marks


def stop_noting(marks: Any) -> None:
    if marks is not None:
        faulthandler.unregister(signal.SIGTERM)
        marks.close()
        if not os.path.getsize(marks.name):  # no SIGTERM came: no mark
            os.remove(marks.name)


def restart_entry(run: dict[str, Any], resumed_step: int, checkpoint: str | None = None,
                  now: float | None = None) -> dict[str, Any]:
    """The entry for an attempt resuming ``run`` (as `read_run` returns it, with its "path") at ``resumed_step``."""
    now = time.time() if now is None else now
    attempt = max([1, *(r["attempt"] for r in run.get("restarts") or [])]) + 1
    previous = {rank: [r for r in records if attempt_of(r) == attempt - 1] for rank, records in run["records"].items()}
    errors = {rank: e for rank, e in (run.get("errors") or {}).items() if attempt_of(e) == attempt - 1}
    world = run["meta"].get("world_size") or (max(run["records"], default=0) + 1)
    lasts = [max((r["step"] for r in previous.get(rank, []) if isinstance(r.get("step"), int)), default=0)
             for rank in range(world)]
    last = max([resumed_step, *lasts])
    times = [r["time"] for r in (*(r for records in previous.values() for r in records), *errors.values())
             if isinstance(r.get("time"), (int, float))]
    saved = [r["time"] for r in run["records"].get(0, []) if r.get("step") == resumed_step and "time" in r]
    stopped = {rank for rank in range(world) if _marked(run, rank, attempt - 1)}
    finished = run.get("summary") is not None and run["summary"].get("attempt", 1) == attempt - 1
    cause, ranks = (f"the previous attempt finished at step {max(lasts)}: resumed to go on", []) if finished else \
        _cause(lasts, errors, stopped)
    return {"schema": SCHEMA, "attempt": attempt, "time": now, "resumed_step": resumed_step,
            "redone": [resumed_step + 1, last] if last > resumed_step else None, "last_steps": lasts,
            "cause": cause, "ranks": ranks, "time_lost_s": now - saved[-1] if saved and not finished else None,
            "downtime_s": now - max(times) if times else None, "checkpoint": checkpoint}


def _marked(run: dict[str, Any], rank: int, attempt: int) -> bool:
    file = sigterm_file(run["path"], rank, attempt)
    return file.is_file() and file.stat().st_size > 0


def _cause(last: list[int], errors: dict[int, dict[str, Any]], stopped: set[int]) -> tuple[str, list[int]]:
    """What stopped the previous attempt, in words, and the ranks it names. A rank killed outright (SIGKILL, out of
    memory, a node lost) writes nothing; the others then fail in a collective and say so, or are stopped by the
    launcher's SIGTERM (``stopped``): the ranks with neither are the cause. Else the first rank to write an error;
    else the launcher or the scheduler stopped every rank."""
    silent = [rank for rank in range(len(last)) if rank not in errors and rank not in stopped]
    first = min(errors.items(), key=lambda item: item[1].get("time") or 0) if errors else None
    if silent:
        who = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}"
        then = f"; then rank {first[0]} failed first: {first[1]['error'][:300]}" if first else ""
        return (f"{who} stopped without an error after step {max(last[r] for r in silent)} (killed: SIGKILL, out of "
                f"memory, a lost node, or a crash in native code){then}"), silent
    if first:
        return f"rank {first[0]} failed after step {last[first[0]]}: {first[1]['error'][:300]}", [first[0]]
    return (f"every rank was stopped by SIGTERM after step {max(last, default=0)} (the launcher or the "
            "scheduler: preempted, out of time, or a failure outside the ranks)"), []
