"""A fixture run store for the dashboard's tests: complete runs (one with a pipeline), a crashed one, a
folder whose meta.json is not JSON and one of an older schema."""

from __future__ import annotations

import json

import pytest

from strategies import runs as runstore

CMP = "cmp-test"


def _memory(total: int, act: int) -> dict:
    return {"params": total // 4, "grads": total // 4, "optimizer": total // 2, "host": 0, "total": total,
            "activations_peak": act, "peak_rss": 300 * 2**20}


def _write_run(root, run_id: str, label: str, world: int, losses: list[float], *, complete: bool = True,
               pipeline: dict | None = None, degrees: dict | None = None, param_dtype: str | None = None) -> None:
    predicted = {"memory": [{"params": 100, "grads": 100, "optimizer": 200, "host": 0, "activations": 50}] * world,
                 "comm": {"all_reduce/dp": 10.0}, "bubble": 0.0, "model_states": [400] * world,
                 "step_time": {"compute": 0.6, "recompute": 0.0, "optimizer": 0.1, "loop": 0.05, "dp comm": 0.1,
                               "bubble": 0.2 if pipeline else 0.0}, "step_basis": "this host's calibration"}
    for rank in range(world):
        writer = runstore.RunWriter(root, run_id, rank)
        if rank == 0:
            writer.write_meta({"run_id": run_id, "comparison": CMP, "label": label, "plan": label, "world_size": world,
                               "degrees": degrees or {"dp": world, "tp": 1, "pp": 1}, "devices": ["cpu"],
                               "num_params": 1000, "predicted": predicted,
                               "precision": "bf16-mixed" if param_dtype else "32-true", "param_dtype": param_dtype})
        for step, loss in enumerate(losses, start=1):
            writer.append({"step": step, "time": 100.0 + step, "step_time_s": 1.0, "loss": loss, "lr": 0.1,
                           "tokens_per_s": 1000.0 * world, "memory": _memory(400 + 100 * rank, 60),
                           "comm": {"all_reduce/dp": {"calls": 1, "bytes_sent": 10.0, "bytes_recv": 10.0,
                                                      "wait_s": 0.1}},
                           "bubble": None, "split": {"forward": 0.2, "backward": 0.4, "optimizer": 0.1,
                                                     "bubble": 0.2 if pipeline else 0.0}})
        if not complete and rank == 1:  # what StrategyMonitor.on_exception writes last on a failed rank
            writer.append({"error": "CollectiveError: all_gather on dp timed out", "last_calls": ["#7 all_gather"]})
        summary = None
        if complete and rank == 0:
            summary = {"losses": losses, "tokens_per_s": 1000.0 * world, "mfu": None,
                       "comm_per_step": {"all_reduce/dp": {"calls": 1, "bytes_sent": 10.0, "bytes_recv": 10.0,
                                                           "wait_s": 0.1}}}
            if pipeline:
                summary["pipeline"] = pipeline
        writer.finish(summary)


PIPELINE = {
    "bubble_ideal": 0.2, "bubble_measured": 0.3, "partition": ["stage 0: blocks[0:1]", "stage 1: blocks[1:2]"],
    "timelines": {"0": [{"action": "F0.0", "phase": "F", "stage": 0, "microbatch": 0, "start": 0.0, "end": 1.0},
                        {"action": "B0.0", "phase": "B", "stage": 0, "microbatch": 0, "start": 3.0, "end": 5.0}],
                  "1": [{"action": "F1.0", "phase": "F", "stage": 1, "microbatch": 0, "start": 1.0, "end": 2.0},
                        {"action": "B1.0", "phase": "B", "stage": 1, "microbatch": 0, "start": 2.0, "end": 3.0}]},
    "ideal": {"0": [["F0.0", 0], ["B0.0", 3]], "1": [["F1.0", 1], ["B1.0", 2]]},
}


@pytest.fixture
def store(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    _write_run(root, "r1-single", "single", 1, [2.0, 1.5, 1.2])
    _write_run(root, "r2-dp", "dp", 2, [2.0, 1.5, 1.2], param_dtype="torch.bfloat16")
    _write_run(root, "r3-pp2", "pp2", 2, [2.0, 1.5, 1.2], pipeline=PIPELINE, degrees={"dp": 1, "tp": 1, "pp": 2})
    _write_run(root, "r4-crashed", "zero3", 2, [2.0, 1.5], complete=False)
    (root / "r5-corrupt").mkdir()
    (root / "r5-corrupt" / "meta.json").write_text("{ not json")
    (root / "r6-old").mkdir()
    (root / "r6-old" / "meta.json").write_text(json.dumps({"schema": 0, "label": "dp"}))
    monkeypatch.setenv(runstore.RUNS_ENV, str(root))
    return root


