"""A second lane for the suite's long subprocess work, at low priority, so that it runs on the core the test in front
leaves idle.

The suite runs one test after another, and for a quarter of its time one of this machine's two cores waits: a
one-process test, a rehearsal, a job whose rank 0 imports torch before its other ranks start (Lightning's popen
launcher), a fault test waiting for a timeout (vmstat through a full run, 29 November 2026: 716 of 2,760 core-seconds
idle). The session fixtures whose work is only to run processes and keep what they wrote (the shared jobs, the
`compare` run store, a checkpoint to resume from, the docs' command lines) are registered here; at the session's start
each one that a selected test needs is queued, and two threads run the queue in order, its processes under `nice`.
A fixture that finds its work not yet started runs it itself, at normal priority; one that finds it running waits.

What is run here must not depend on timing: values, bytes, exit codes. Tests that compare sampled figures (heap
peaks, elapsed times) take the ``quiet`` fixture, which waits until the lane is empty. And what it runs inside pytest's
own process must draw nothing from torch's, numpy's or Python's global generators, which the tests in front seed and
draw from (a lane thread that built models beside a one-process reference changed its weights); build such things
in the work's registration, which runs in pytest's thread before the lane starts, or on meta, or in a subprocess.
"""

from __future__ import annotations

import concurrent.futures
import glob
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tests import ports

NICE = 10  # the lane's share under contention: about a tenth (CFS weights 110 against 1024)
# Two threads: once the tests in front have run out, they wait on what the lane has left, and one thread running
# one-process work (a rehearsal, a page of the docs' lines) left a core idle for the suite's last three minutes
WORKERS = 2
# Wait limits for the lane's ranks: a collective or a strict receive may wait while the test in front takes both cores
SLACK_ENV = {"STRATPACK_TIMEOUT": "1200", "STRATPACK_STRICT_P2P": "1200"}

# What a Trainer fit inside pytest's own process sets in os.environ while its test runs (tests/conftest.py
# `_no_launch_left` undoes it after): a job the lane starts meanwhile must not inherit them (its rank 0 would try to
# listen on the foreground's MASTER_PORT, and fail at once: EADDRINUSE). The likely cause of a clean-clone run's chance
# failure at the last stop (a lane job's rank 0 ended after 4 s of CPU).
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK", "OMP_NUM_THREADS")
_START = {k: v for k, v in os.environ.items() if k in LAUNCH_ENV}  # (as the session began)
GRACE_S = 10.0  # how long the other ranks may take to end after the first process failed

_state = threading.local()
_futures: dict[str, concurrent.futures.Future] = {}
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_running: set[subprocess.Popen] = set()
_lock = threading.Lock()
_closed = threading.Event()


@dataclass(frozen=True)
class Queued:
    """Work the lane runs ahead: ``reads(item)``, whether a test reads it; ``work(tmp_path_factory, readers)``, the
    [(key, function)] those selected readers need, in the order they read them."""

    reads: Callable
    work: Callable


PREFETCH: dict[str, Queued] = {}


def register(name: str, reads: Callable, work: Callable) -> None:
    """Called by the conftest or test file that reads the work, at its import: once (a file that imports a conftest
    runs it again as another module, whose fixtures and caches the suite's would not see)."""
    if name in PREFETCH:
        raise RuntimeError(f"lane work {name!r} registered twice: is a conftest imported by a test file?")
    PREFETCH[name] = Queued(reads, work)


def reads_lane(item) -> bool:
    return any(queued.reads(item) for queued in PREFETCH.values())


def in_lane() -> bool:
    return getattr(_state, "lane", False)


def run(cmd: list[str], *, env: dict | None = None, timeout: float | None = None, **kwargs):
    """`subprocess.run(cmd, capture_output=True, text=True, ...)`; in the lane, niced, in a session of its own, with
    `environ` (ended with its children if the suite stops first). The lane waits for the first process and then for
    its process group, with output in files: a rank left running after rank 0 failed (re-parented, holding pipes
    open) is ended, not waited for until its collective timeout (CI, 29 November: a hang of 20 minutes)."""
    if not in_lane():
        return subprocess.run(cmd, env=environ(env), timeout=timeout, capture_output=True, text=True, **kwargs)
    if _closed.is_set():  # (the session ended: start nothing more)
        raise RuntimeError("the test session ended")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(["nice", "-n", str(NICE), *cmd], env=environ(env), stdout=out, stderr=err,
                                text=True, start_new_session=True, **kwargs)
        with _lock:
            _running.add(proc)
        try:
            proc.wait(timeout)
            _wait_group(proc.pid, GRACE_S if proc.returncode else timeout)
        finally:
            _kill(proc)
            with _lock:
                _running.discard(proc)
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def environ(env: dict | None = None) -> dict:
    """What a process started through `run` gets: ``env`` (default this process's) with a ``MASTER_PORT`` of its own
    (`tests/ports.py`: below the kernel's ephemeral range, so that no socket's outgoing connection takes it before
    rank 0 listens); in the lane, also without the launch variables a fit in front may have set meanwhile
    (`LAUNCH_ENV`), and with `SLACK_ENV`."""
    env = dict(env if env is not None else os.environ)
    if in_lane():
        env = {k: v for k, v in env.items() if k not in LAUNCH_ENV or k in _START}
        env.update(SLACK_ENV)
    env["MASTER_PORT"] = ports.take()
    return env


def _wait_group(pgid: int, timeout: float | None) -> None:
    """Until no process of group ``pgid`` is left but zombies, or ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while _alive(pgid) and (deadline is None or time.monotonic() < deadline):
        time.sleep(0.2)


def _alive(pgid: int) -> bool:
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def prefix() -> list[str]:
    """What a process started outside `run` (a `Popen`) is prefixed with: ``nice`` in the lane."""
    if in_lane() and _closed.is_set():
        raise RuntimeError("the test session ended")
    return ["nice", "-n", str(NICE)] if in_lane() else []


def start(items, factory) -> None:
    """Queue the registered work the selected ``items`` need."""
    global _pool
    work = []
    for queued in PREFETCH.values():
        readers = [item for item in items if queued.reads(item)]
        work += queued.work(factory, readers) if readers else []
    if not work:
        return
    # The session's base temp directory, made here, before a lane thread asks for it: made by two threads at once
    # (a lane job's mktemp and a test's tmp_path), each makes its own, and pytest's check of the path then compares
    # the one with the other ("... is not a normalized and relative path": 2 of the first 3 runs of three tests
    # here, 0 of 8 after).
    factory.getbasetemp()
    _pool = concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="lane")
    for key, fn in work:
        _futures[key] = _pool.submit(_in_lane, fn)


def takes(item, *fixtures: str) -> bool:
    return bool(set(fixtures) & set(getattr(item, "fixturenames", ())))


def _in_lane(fn: Callable):
    _state.lane = True
    try:
        return fn()
    finally:  # (a test of the lane runs work so in pytest's own thread: the tests after it are not in the lane)
        _state.lane = False


def result(key: str, fn: Callable):
    """What ``fn()`` returns (or raises): from the lane if it ran or is running there, else run here, at once (and
    taken off the queue), and kept for the next reader."""
    future = _futures.get(key)
    if future is None or future.cancel():
        future = _futures[key] = concurrent.futures.Future()
        try:
            future.set_result(fn())
        except BaseException as e:  # (kept, as the lane keeps it: each reader gets the error)
            future.set_exception(e)
    return future.result()


def drain() -> None:
    """Wait until the lane has run everything queued (before a test that samples timing or the heap)."""
    for future in list(_futures.values()):
        future.exception()


def close() -> None:
    """At the session's end: drop what has not started and end what runs (a `-k` run that needed only part)."""
    _closed.set()
    for future in _futures.values():
        future.cancel()
    with _lock:
        for proc in list(_running):
            _kill(proc)
    if _pool is not None:
        _pool.shutdown(wait=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
