"""A job that dies and is restarted by torchrun (``--max-restarts``) resumes by itself (``resume="auto"``) from the
newest complete checkpoint, and ends with the parameters of a run that never stopped, bit for bit
(``deterministic=True``). The job is `_restart_job.py`: the demo GPT, eight steps, a checkpoint every two.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys

import pytest
import torch

JOB = os.path.join(os.path.dirname(__file__), "_restart_job.py")


def _torchrun(tmp_path, name: str, plan: str, world: int, fault: str, rank: int, step: int):
    """The job under torchrun, restarted up to 3 times: (torchrun's exit, its output, the final parameters)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    params = tmp_path / f"{name}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--max-restarts", "3",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", JOB, plan, fault, str(rank), str(step),
           str(tmp_path / f"{name}-checkpoints"), str(params)]
    env = {**os.environ, "STRATPACK_TIMEOUT": "60", "STRATPACK_RUNS": str(tmp_path / "runs")}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, env=env,
                          cwd=tmp_path)
    return proc.returncode, proc.stdout, torch.load(params) if params.exists() else None


CASES = [("dp", 2, "kill"), ("dp", 2, "torn")]


@pytest.mark.parametrize("plan,world,fault", CASES, ids=[f"{p}@{w}-{f}" for p, w, f in CASES])
def test_a_job_restarted_by_torchrun_resumes_by_itself_and_ends_as_if_never_stopped(tmp_path, plan, world, fault):
    draw = random.Random(f"{plan}-{fault}")  # a rank and a step of their own for each case
    rank, step = (draw.randrange(world), draw.randrange(3, 8)) if fault == "kill" else (0, 4)
    code, log, reference = _torchrun(tmp_path, "reference", plan, world, "none", rank, step)
    assert code == 0 and "no complete checkpoint" in log, log[-3000:]
    code, log, got = _torchrun(tmp_path, "restarted", plan, world, fault, rank, step)
    assert code == 0, log[-4000:]
    assert ("killed at step" if fault == "kill" else "killed before the manifest") in log
    # the second attempt resumed from the newest complete checkpoint: the last save before the fault
    newest = f"step={(step // 2) * 2}" if fault == "kill" else f"step={step - 2}"
    assert f"resuming from {tmp_path / 'restarted-checkpoints'}" in log and newest in log.split("resuming from")[1]
    if fault == "torn":
        assert f"passed over {tmp_path / 'restarted-checkpoints'}" in log  # the torn save, named
    assert got.keys() == reference.keys()
    assert all(torch.equal(got[k], reference[k]) for k in reference), plan
