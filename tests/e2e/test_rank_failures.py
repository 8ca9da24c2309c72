"""A rank that dies or raises ends the whole job, quickly, with a message that names it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

JOB = os.path.join(os.path.dirname(__file__), "_fault_job.py")
TIMEOUT_S = 30  # the collective timeout the job runs with (STRATPACK_TIMEOUT)


def _run_job(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "STRATPACK_TIMEOUT": str(TIMEOUT_S)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, JOB, *args], capture_output=True, text=True, timeout=4 * TIMEOUT_S,
                          env=env, cwd=tmp_path)
    return proc, time.monotonic() - start


def _leftovers(tmp_path) -> list[str]:
    # Ranks of the job still running: their command line is the job's, and their cwd is this test's folder.
    out = subprocess.run(["pgrep", "-f", JOB], capture_output=True, text=True).stdout.split()
    return [pid for pid in out if os.path.realpath(f"/proc/{pid}/cwd") == os.path.realpath(tmp_path)]


@pytest.mark.parametrize("killed", [3, 0])
def test_rank_killed_mid_step_stops_the_job_and_is_named(tmp_path, killed: int):
    proc, elapsed = _run_job(tmp_path, "zero2_pp2", "4", "kill", str(killed), "2")
    assert proc.returncode != 0
    assert elapsed < TIMEOUT_S, f"the job took {elapsed:.0f}s to stop"  # a dead peer is seen, not waited out
    if killed == 3:
        # The ranks that were waiting for it say which call they were in, their last calls, and that rank 3
        # (a process on this host) has exited.
        gone = [set(m.split(", ")) for m in re.findall(r"rank\(s\) ([\d, ]+) on this host have exited", proc.stderr)]
        assert gone and all("3" in ranks for ranks in gone), proc.stderr[-3000:]
        assert "CollectiveError" in proc.stderr and "last calls on rank" in proc.stderr
    deadline = time.monotonic() + 15
    while _leftovers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _leftovers(tmp_path), "ranks were left running after the job failed"


def test_rank_that_raises_stops_the_job_with_its_error(tmp_path):
    proc, elapsed = _run_job(tmp_path, "zero2_pp2", "4", "raise", "3", "2")
    assert proc.returncode != 0
    assert elapsed < TIMEOUT_S
    assert "[rank 3] zero2_pp2 failed: ValueError: boom on purpose at step 2" in proc.stderr
