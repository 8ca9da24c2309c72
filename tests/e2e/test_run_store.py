"""What a real run leaves in the run store (and in wandb, offline), including a run killed mid-way."""

from __future__ import annotations

from pathlib import Path

from strategies import runs as runstore
from tests.helpers import train_demo


def test_a_two_rank_run_writes_meta_records_and_summary_and_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    result, _ = train_demo(tmp_path, "zero2", 2, "--wandb", "offline")
    runs = runstore.list_runs(tmp_path / "runs")
    assert len(runs) == 1
    run = runstore.read_run(runs[0])
    meta = run["meta"]
    assert run["status"] == "complete" and meta["schema"] == runstore.SCHEMA
    assert meta["label"] == "zero2" and meta["plan"] == "zero2_dp2" and meta["world_size"] == 2
    assert meta["degrees"] == {"dp": 2, "tp": 1, "cp": 1, "pp": 1, "microbatches": None, "virtual": 1}
    assert meta["model"]["n_embd"] == 32 and meta["num_params"] == result["num_params"]
    assert set(meta["versions"]) == {"torch", "lightning", "stratpack", "python"}
    assert set(run["records"]) == {0, 1}
    for rank, records in run["records"].items():
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
        for r in records:
            assert r["schema"] == runstore.SCHEMA and r["rank"] == rank and r["step_time_s"] > 0
            assert {"params", "grads", "optimizer", "activations_peak", "peak_rss"} <= set(r["memory"])
            assert r["comm"]["reduce_scatter/dp"]["bytes_sent"] > 0  # this step's, not the running total
            # where the step went (`measure.split`): each phase's compute, inside the step with the waits
            waited = sum(c["wait_s"] for c in r["comm"].values())
            assert min(r["split"][k] for k in ("forward", "backward", "optimizer")) > 0 and r["split"]["bubble"] == 0
            assert sum(r["split"].values()) + waited < r["step_time_s"]
    assert run["summary"]["losses"] == result["losses"]
    # The same figures in wandb's offline run (its .wandb file is internal; the keys are stored as text).
    wandb_runs = [p for p in (tmp_path / "runs" / "wandb").iterdir() if p.name.startswith("offline-run-")]
    assert len(wandb_runs) == 1
    assert Path(meta["wandb_run"]).resolve() == wandb_runs[0].resolve()  # the dashboard shows it; `wandb sync` takes it
    data = next(wandb_runs[0].glob("run-*.wandb")).read_bytes()
    for key in (b"memory/params", b"memory/optimizer", b"comm/reduce_scatter/dp/bytes_sent", b"tokens_per_s",
                b"time/backward"):
        assert key in data, key


def test_a_long_run_records_steps_sparser_and_says_how_many_each_covers(tmp_path):
    # full_steps=2: steps 1 and 2, then every 2nd step up to 4, every 4th up to 8 (`keep_record`), and always the
    # last step (7), which stands for the 3 since the record of step 4. A killed run
    # (incomplete, every step up to the fault) is tests/safety/test_faults.py's.
    import lightning as L
    import torch

    from demos.gpt import GPTModule, make_demo
    from strategies.measure.monitor import StrategyMonitor

    L.seed_everything(0, verbose=False)
    base, dataset = make_demo(n_layer=1, n_head=2, n_embd=16, seq_len=16, max_chars=4000)
    monitor = StrategyMonitor(warmup_steps=1, runs_dir=tmp_path / "runs", full_steps=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=7, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor])
    trainer.fit(GPTModule(base.config), torch.utils.data.DataLoader(dataset, batch_size=4, drop_last=True))
    (folder,) = runstore.list_runs(tmp_path / "runs")
    run = runstore.read_run(folder)
    records = run["records"][0]
    assert [r["step"] for r in records] == [1, 2, 4, 7] and [r["steps"] for r in records] == [1, 1, 2, 3]
    assert len(run["summary"]["losses"]) == 4 and run["summary"]["steps"] == 7
    assert run["summary"]["tokens_per_s"] > 0  # over the 6 steps after the warm-up, recorded or not
