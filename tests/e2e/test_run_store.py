"""What a real run leaves in the run store (and in wandb, offline), including a run killed mid-way."""

from __future__ import annotations

import os
import subprocess
import sys

from strategies import runstore
from strategies.testing import train_demo

JOB = os.path.join(os.path.dirname(__file__), "_fault_job.py")


def test_a_two_rank_run_writes_meta_records_and_summary_and_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    result, _ = train_demo(tmp_path, "zero2", 2, "--wandb", "offline")
    runs = runstore.list_runs(tmp_path / "runs")
    assert len(runs) == 1
    run = runstore.read_run(runs[0])
    meta = run["meta"]
    assert run["status"] == "complete" and meta["schema"] == runstore.SCHEMA
    assert meta["label"] == "zero2" and meta["plan"] == "zero2_dp2" and meta["world_size"] == 2
    assert meta["degrees"] == {"dp": 2, "tp": 1, "pp": 1, "microbatches": None, "virtual": 1}
    assert meta["model"]["n_embd"] == 32 and meta["num_params"] == result["num_params"]
    assert set(meta["versions"]) == {"torch", "lightning", "stratpack", "python"}
    assert set(run["records"]) == {0, 1}
    for rank, records in run["records"].items():
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
        for r in records:
            assert r["schema"] == runstore.SCHEMA and r["rank"] == rank and r["step_time_s"] > 0
            assert {"params", "grads", "optimizer", "activations_peak", "peak_rss"} <= set(r["memory"])
            assert r["comm"]["reduce_scatter/dp"]["bytes_sent"] > 0  # this step's, not the running total
    assert run["summary"]["losses"] == result["losses"]
    # The same figures in wandb's offline run (its .wandb file is internal; the keys are stored as text).
    wandb_runs = [p for p in (tmp_path / "runs" / "wandb").iterdir() if p.name.startswith("offline-run-")]
    assert len(wandb_runs) == 1
    data = next(wandb_runs[0].glob("run-*.wandb")).read_bytes()
    for key in (b"memory/params", b"memory/optimizer", b"comm/reduce_scatter/dp/bytes_sent", b"tokens_per_s"):
        assert key in data, key


def test_a_killed_run_is_readable_up_to_its_last_step_and_incomplete(tmp_path):
    env = {**os.environ, "STRATPACK_TIMEOUT": "30", "STRATPACK_RUNS": str(tmp_path / "runs")}
    proc = subprocess.run([sys.executable, JOB, "dp", "2", "kill", "1", "3"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode != 0
    (folder,) = runstore.list_runs(tmp_path / "runs")
    run = runstore.read_run(folder)
    assert run["status"] == "incomplete" and run["summary"] is None
    for rank in (0, 1):  # steps 1..3 finished before rank 1 killed itself at the start of the 4th
        assert [r["step"] for r in run["records"][rank]][:3] == [1, 2, 3]
