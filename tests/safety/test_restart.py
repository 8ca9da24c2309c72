"""A job that dies and is restarted by torchrun (``--max-restarts``) resumes by itself (``resume="auto"``) from the
newest complete checkpoint, and ends with the parameters of a run that never stopped, bit for bit
(``deterministic=True``); the run store holds one run: every step once, the steps done again after the restart
marked, and the restart itself (`runs.restarts`). The job is `_restart_job.py`: the demo GPT, eight steps, a
checkpoint every two.
"""

from __future__ import annotations

import functools
import os
import random
import subprocess

import pytest
import torch

from strategies.runs import list_runs, read_run
from tests import ports, python
from tests.helpers import record_figure

JOB = os.path.join(os.path.dirname(__file__), "_restart_job.py")


def _torchrun(folder, plan: str, world: int, fault: str, rank: int, step: int):
    """The job under torchrun, restarted up to 3 times: (torchrun's exit, its output, the final parameters)."""
    os.makedirs(folder, exist_ok=True)
    port = ports.take()  # the rendezvous' (below the ephemeral range: see tests/ports.py)
    params = os.path.join(folder, "params.pt")
    cmd = [python.core(), "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--max-restarts", "3",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", JOB, plan, fault, str(rank), str(step),
           os.path.join(folder, "checkpoints"), params]
    env = {**os.environ, "STRATPACK_TIMEOUT": "60", "STRATPACK_RUNS": os.path.join(folder, "runs")}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900, env=env,
                          cwd=folder)
    return proc.returncode, proc.stdout, torch.load(params) if os.path.exists(params) else None


@functools.cache
def _reference(plan: str, world: int, folder: str):
    """The uninterrupted run's final parameters, once per plan."""
    code, log, params = _torchrun(os.path.join(folder, f"reference-{plan}"), plan, world, "none", 0, 0)
    assert code == 0 and "no complete checkpoint" in log, log[-3000:]
    return params


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("restart"))
    return lambda plan, world: _reference(plan, world, folder)


_DRAW = random.Random(47)  # a rank and a step of their own for each kill, drawn in CASES' order
CASES = [("dp", 2, "kill", _DRAW.randrange(2), _DRAW.randrange(3, 8)), ("dp", 2, "torn", 0, 4),
         ("zero3_tp2_pp2", 8, "kill", _DRAW.randrange(8), _DRAW.randrange(3, 8)), ("dp", 2, "async-torn", 0, 4),
         ("zero3_pp2", 4, "kill", _DRAW.randrange(4), _DRAW.randrange(3, 8))]
# CI: a kill under ZeRO-3 sharded over dp beside pipeline stages at 4 ranks (a checkpoint's every kind of part:
# shards, stages), and dp's torn saves; under `pytest -m matrix`, the 3D plan at 8 ranks (3 runs of 8 processes: 100 s
# here) and the kill under dp (what the 4-rank kill proves, on whole-model checkpoints).
MATRIX = {("zero3_tp2_pp2", 8, "kill"), ("dp", 2, "kill")}
PARAMS = [pytest.param(*c, id=f"{c[0]}@{c[1]}-{c[2]}", marks=pytest.mark.matrix if c[:3] in MATRIX else ())
          for c in CASES]


@pytest.mark.parametrize("plan,world,fault,rank,step", PARAMS)
def test_a_job_restarted_by_torchrun_resumes_by_itself_and_ends_as_if_never_stopped(tmp_path, reference, plan, world,
                                                                                    fault, rank, step):
    code, log, got = _torchrun(tmp_path, plan, world, fault, rank, step)
    assert code == 0, log[-4000:]
    assert ("killed at step" if fault == "kill" else "killed before the save was moved in") in log
    # the second attempt resumed from the newest complete checkpoint: the last save before the fault
    saved = (step // 2) * 2 if fault == "kill" else step - 2
    assert f"resuming from {tmp_path / 'checkpoints'}" in log and f"step={saved}" in log.split("resuming from")[1]
    if fault.endswith("torn"):
        assert f"passed over {tmp_path / 'checkpoints'}" in log  # the torn save, named
    expected = reference(plan, world)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected), plan
    run = _one_run_with_the_restart_marked(tmp_path / "runs", world, saved, step, rank if fault == "kill" else 0,
                                           asynchronous=fault.startswith("async"))
    record_figure("restart", plan=plan, world=world, fault=fault, time_lost_s=run["restarts"][0]["time_lost_s"])
    if fault.startswith("async"):  # the stall of each save is in the records, after a save's step
        stalls = [r["checkpoint"] for r in run["records"][0] if "checkpoint" in r]
        assert stalls and all(c["saves"] == 1 and c["stall_s"] > 0 for c in stalls)


def _one_run_with_the_restart_marked(store, world: int, saved: int, last: int, killed: int, asynchronous: bool):
    """One run in the store, complete: each rank has every step once unmarked plus the redone ones marked, and the
    restart names the killed rank and the steps done again (an asynchronous save's: the steps from the torn save's on,
    which training went on with while it was written)."""
    (path,) = list_runs(store)
    run = read_run(path)
    assert run["status"] == "complete" and not run["problems"], run["problems"]
    (restart,) = run["restarts"]
    assert restart["attempt"] == 2 and restart["resumed_step"] == saved
    lasts = restart["last_steps"]  # how far each rank had got: its steps after the checkpoint are done again
    if asynchronous:  # training went on while the torn save was written: the ranks got at least that far
        assert min(lasts) >= last
    else:
        assert lasts == [last] * world
    assert restart["redone"] == ([saved + 1, max(lasts)] if max(lasts) > saved else None)
    assert restart["ranks"] == [killed] and f"rank {killed} stopped without an error" in restart["cause"]
    assert restart["time_lost_s"] > 0 and restart["checkpoint"].endswith(f"step={saved}.ckpt")
    for rank in range(world):
        steps = [r["step"] for r in run["records"][rank] if not r.get("redone")]
        redone = [r["step"] for r in run["records"][rank] if r.get("redone")]
        assert sorted(steps) == list(range(1, 9)) and redone == list(range(saved + 1, lasts[rank] + 1)), (rank, redone)
    return run
