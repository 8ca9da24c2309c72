"""The suite's second lane (tests/lane.py): work a reader finds not started runs once, where the reader is, and each
later reader gets that result (or its error); work registered twice (a conftest imported again by a test file, with
fixtures and caches of its own) stops the session at once instead of handing two readers two different folders."""

import itertools
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from tests import lane, ports, python


def test_work_not_queued_runs_once_where_it_is_read_and_is_kept():
    calls = []
    key = "test_lane:inline"
    assert lane.result(key, lambda: calls.append(1) or len(calls)) == 1
    assert lane.result(key, lambda: calls.append(1) or len(calls)) == 1 and calls == [1]
    assert not lane.in_lane()


def test_an_error_is_kept_for_every_reader():
    def fails():
        raise ValueError("the run failed")

    for _ in range(2):
        with pytest.raises(ValueError, match="the run failed"):
            lane.result("test_lane:error", fails)


def test_work_registered_twice_is_refused():
    lane.register("test_lane:twice", lambda item: False, lambda factory, readers: [])
    try:
        with pytest.raises(RuntimeError, match="registered twice"):
            lane.register("test_lane:twice", lambda item: False, lambda factory, readers: [])
    finally:
        del lane.PREFETCH["test_lane:twice"]


def test_a_lane_job_whose_first_process_failed_ends_with_its_group(monkeypatch):
    """Rank 0 exits 3; the rank it started (holding stdout open, as Lightning's children do) is ended after the
    grace, not waited for: a clean-clone run hung 20 minutes so at the last stop."""
    monkeypatch.setattr(lane, "GRACE_S", 0.5)
    script = "sleep 120 & echo $! > child; echo started; exit 3"
    with tempfile.TemporaryDirectory() as cwd:
        start = time.monotonic()
        proc = lane._in_lane(lambda: lane.run(["sh", "-c", script], cwd=cwd, timeout=60))
        child = int(open(os.path.join(cwd, "child")).read())
    assert proc.returncode == 3 and proc.stdout == "started\n" and time.monotonic() - start < 30
    deadline = time.monotonic() + 10  # (SIGKILL is delivered, not waited for: the process may be seen for a moment)
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child), "the failed job's other process is still running"
    assert not lane.in_lane()  # (the tests after this one are not in the lane)


def _running(pid: int) -> bool:
    try:  # (a killed process re-parented to init may stay a zombie: dead)
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_lane_job_does_not_inherit_a_fit_in_fronts_port(monkeypatch):
    """A fit in pytest's own process sets MASTER_PORT while its test runs: a job the lane starts then gets a port of
    its own, below the ephemeral range."""
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setattr(lane, "_START", {})
    code = "import os; print(os.environ['MASTER_PORT'], os.environ['STRATPACK_TIMEOUT'])"
    port, slack = lane._in_lane(lambda: lane.run([sys.executable, "-c", code], timeout=60)).stdout.split()
    assert port != "29999" and int(port) < 32768 and slack == lane.SLACK_ENV["STRATPACK_TIMEOUT"]


def test_ports_are_below_the_ephemeral_range_each_once_and_never_one_held(monkeypatch):
    """Every launch's port (`tests/ports.py`): below 32768, none handed out twice, one a socket holds passed over."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]  # (an ephemeral one: only to plant a held port at the head of the order)
        monkeypatch.setattr(ports, "_order", itertools.chain([taken], range(ports.LOW, ports.HIGH)))
        got = [int(ports.take()) for _ in range(3)]
    assert taken not in got and len(set(got)) == 3 and all(ports.LOW <= p < ports.HIGH for p in got)


def test_the_core_interpreter_has_the_pack_and_no_transformers():
    """`tests/python.py`'s core (scripts/setup.sh --dev's .venv-core): the pack, Lightning and the dashboard, and no
    transformers, so that what runs there proves the pack needs it for nothing but Hugging Face models."""
    exe = python.core()
    if exe == sys.executable:
        pytest.skip("no .venv-core beside this checkout's .venv (scripts/setup.sh --dev makes it)")
    code = ("import importlib.util as u, lightning, strategies, streamlit; "
            "print(u.find_spec('transformers') is None, lightning.__file__.startswith(sys.prefix))")
    out = subprocess.run([exe, "-c", "import sys; " + code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["True", "True"], out.stderr[-2000:]
