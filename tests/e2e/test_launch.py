"""Launching: strategy objects under the spawn launcher, cluster environments, models a plan cannot split,
the `stratpack compare` table, and the acceptance one-liners."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import strategies
from demos.gpt import make_demo
from strategies.checkpoint import ShardedCheckpointIO
from tests import ports, python

TINY = dict(n_layer=2, n_head=2, n_embd=16, seq_len=16, max_chars=4000)


def _fit(strategy, devices: int, loader_batch: int) -> torch.nn.Module:
    L.seed_everything(0, verbose=False)
    module, dataset = make_demo(**TINY)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    sampler = None
    if devices == 1:  # the permutation Lightning's DistributedSampler would shard over the ranks
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(module, DataLoader(dataset, batch_size=loader_batch, sampler=sampler))
    return module


@pytest.mark.parametrize("cls", [strategies.DataParallelStrategy, strategies.NaiveDataParallelStrategy])
def test_strategy_object_with_spawn_matches_single_device(cls):
    # Lightning's spawn launcher copies rank 0's trained weights back into this process's module.
    ref = _fit("auto", 1, 8)
    got = _fit(cls(start_method="spawn", timeout=__import__("datetime").timedelta(seconds=60)), 2, 4)
    for (name, a), b in zip(got.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_slurm_environment_gives_ranks_and_dp_sampler(monkeypatch):
    env = dict(SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="2", SLURM_PROCID="3", SLURM_LOCALID="1",
               SLURM_NODEID="1", SLURM_JOB_NAME="train", SLURM_NODELIST="node[1-2]", SLURM_JOB_ID="7")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    trainer = L.Trainer(strategy="tp2", accelerator="cpu", devices=2, num_nodes=2, logger=False)
    strategy = trainer.strategy
    assert type(strategy.cluster_environment).__name__ == "SLURMEnvironment"
    assert (strategy.global_rank, strategy.world_size, strategy.node_rank) == (3, 4, 1)
    # rank 3 of dp2_tp2 is tp index 1 of data-parallel replica 1: it reads replica 1's samples.
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([python.core(), "-m", "strategies.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_model_a_plan_cannot_split_fails_clearly_without_hanging():
    # One block: 2 pipeline stages cannot each get one. Every rank fails at setup, with the reason.
    proc = _cli("train", "zero2_pp2", "--devices", "2", "--steps", "2", "--n-layer", "1", "--n-embd", "16",
                "--max-chars", "4000", "--wandb", "off", timeout=120)
    assert proc.returncode != 0
    assert "cannot cut 1 blocks into 2 pipeline stages" in proc.stderr


def test_a_rank_that_train_started_and_that_fails_ends_the_job_at_once():
    # `stratpack train` starts a plan's other ranks itself (`cli.ranks`); where one fails before it joins the group,
    # rank 0 would wait at the rendezvous for the whole timeout: its watcher ends the job within a second or two.
    # Here rank 0 is a script that starts two ranks given a command that does not exist (each exits 2).
    script = ("import time\nfrom strategies.cli import ranks\nranks.start_other_ranks(['no-such-command'], 3)\n"
              "time.sleep(60)\n")
    env = {k: v for k, v in os.environ.items() if k not in ranks_env()}
    start = time.monotonic()
    proc = subprocess.run([python.core(), "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == -signal.SIGTERM and time.monotonic() - start < 20, proc.stderr[-2000:]
    assert re.search(r"stratpack: rank [12] exited with code 2: ending the job", proc.stderr), proc.stderr[-2000:]


def ranks_env() -> tuple[str, ...]:
    from strategies.cli.ranks import LAUNCHED

    return LAUNCHED + ("MASTER_PORT", "MASTER_ADDR", "NODE_RANK")


def test_compare_prints_one_row_per_strategy_with_equal_losses(compared):
    from strategies import runs as runstore

    proc = compared.proc  # `stratpack compare` of single, dp, ddp, zero2 and pp2 at 2 ranks (tests/conftest.py)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[####################] 5/5" in proc.stderr  # the progress bar
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:7]}
    assert set(rows) == {"single", "dp", "ddp", "zero2", "pp2"}
    assert rows["single"][1] == "1" and all(rows[k][1] == "2" for k in ("dp", "ddp", "zero2", "pp2"))
    assert len({rows[k][2] for k in rows}) == 1  # final loss, 4 decimals
    assert all(float(rows[k][3]) < 1e-5 for k in rows)  # loss match against single
    # state KiB measured / predicted: the estimator's ZeRO formulas, to the KiB (dp 16 Psi, ZeRO-2 4 + 12/N)
    assert rows["dp"][6] == rows["dp"][8] and rows["zero2"][6] == rows["zero2"][8]
    assert rows["dp"][9] == rows["dp"][11] != "-" and rows["ddp"][9] == "-"  # comm: only the pack counts its own
    # Activations are counted alike for Lightning's own strategies (the monitor's meter): ddp saves what dp saves,
    # one process twice that (the whole global batch).
    assert rows["ddp"][12] == rows["dp"][12] != "-" and int(rows["single"][12].replace(",", "")) == 2 * int(
        rows["dp"][12].replace(",", ""))
    # No set-up column beside the estimator's without --heap: resident memory's growth is not what it predicts; last,
    # each run's precision
    assert all(len(rows[k]) == 14 and rows[k][13] == "32-true" for k in rows)
    assert "set-up memory beside the estimator's: with --heap" in proc.stdout
    runs = [runstore.read_run(p) for p in runstore.list_runs(compared.runs)]
    ours = [r for r in runs if r["meta"].get("comparison")]
    assert len(ours) == 5 and len({r["meta"]["comparison"] for r in ours}) == 1
    assert all(r["status"] == "complete" for r in ours)


def test_acceptance_one_liners():
    ok = subprocess.run([python.core(), "-c", "import strategies, lightning as L; "
                         "L.Trainer(strategy='zero3_tp2_pp2', accelerator='cpu', devices=8)"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = subprocess.run([python.core(), "-c", "import strategies, lightning as L; "
                          "L.Trainer(strategy='zero3_tp3', accelerator='cpu', devices=8)"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0
    assert "tp(3) * pp(1) = 3 does not divide world_size 8" in bad.stderr


class _WithValidation(type(make_demo(**TINY)[0])):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.compute_loss(batch), sync_dist=True)


def _fit_epochs(tmp_path, epochs: int, ckpt_path=None, plan: str = "dp", devices: int = 2, replicas: int = 2):
    L.seed_everything(0, verbose=False)
    base, dataset = make_demo(**TINY)
    module = _WithValidation(base.config)
    small = torch.utils.data.Subset(dataset, range(24))  # 24 samples: one epoch is 24 / (devices * 4) steps
    single = plan == "single"
    strategy = "auto" if single else strategies.PlanStrategy(plan, start_method="spawn")
    sampler = torch.utils.data.DistributedSampler(small, num_replicas=1, rank=0, seed=0) if single else None
    trainer = L.Trainer(accelerator="cpu", devices=1 if single else devices, max_epochs=epochs, logger=False,
                        default_root_dir=tmp_path, strategy=strategy, limit_val_batches=1,
                        enable_progress_bar=False, enable_model_summary=False,
                        plugins=[ShardedCheckpointIO()] if single else None)  # reads the plans' checkpoints
    batch = 4 * replicas if single else 4  # one process sees every data-parallel replica's samples
    trainer.fit(module, DataLoader(small, batch_size=batch, sampler=sampler), DataLoader(small, batch_size=4),
                ckpt_path=ckpt_path)
    return module, trainer


def _assert_same_params(got, want):
    # Absolute 5e-5: attention's key bias has an exactly-zero gradient whose float noise AdamW turns into
    # moves of ~1e-5 that depend on the order of sums (seen: 1.2e-5 after 6 steps under tp2).
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-5, msg=lambda m, name=name: f"{name}: {m}")


# CI runs pp2 (spawned ranks, validation, epoch-end resume, then in one process); dp and tp2 resume in test_reshard
# too, zero3 (accumulating, bit-identical) in test_resume.
@pytest.mark.parametrize("plan,devices,replicas", [
    pytest.param("dp", 2, 2, marks=pytest.mark.matrix), pytest.param("zero3", 4, 4, marks=pytest.mark.matrix),
    pytest.param("tp2", 2, 1, marks=pytest.mark.matrix), ("pp2", 2, 1)])
def test_checkpoint_resume_and_validation(tmp_path, plan: str, devices: int, replicas: int):
    # Saved after epoch 1 and resumed: the same parameters (and Adam state) as two uninterrupted epochs.
    straight, trainer = _fit_epochs(tmp_path / "straight", 2, plan=plan, devices=devices)
    assert "val_loss" in trainer.callback_metrics
    _, first = _fit_epochs(tmp_path / "split", 1, plan=plan, devices=devices)
    ckpt = first.checkpoint_callback.best_model_path
    resumed, _ = _fit_epochs(tmp_path / "split2", 2, ckpt_path=ckpt, plan=plan, devices=devices)
    _assert_same_params(resumed, straight)
    if plan != "dp":
        # Every plan saves the single-process layout (in parts): one process resumes it the same way.
        single, _ = _fit_epochs(tmp_path / "single", 2, ckpt_path=ckpt, plan="single", replicas=replicas)
        _assert_same_params(single, straight)


class SequentialRegression(L.LightningModule):
    """A LightningModule around a plain nn.Sequential, written as for one device."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                       torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_mse", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit_sequential(strategy, devices: int):
    torch.manual_seed(0)
    module = SequentialRegression()
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=2)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, seed=0) if devices == 1 else None
    trainer.fit(module, DataLoader(data, batch_size=8, sampler=sampler), DataLoader(data, batch_size=8))
    return module, trainer.callback_metrics["val_mse"], trainer.callback_metrics["train_mse"]


@pytest.mark.parametrize("balance", ["params", "time"])
def test_pipeline_on_a_plain_sequential(balance: str):
    # pp cuts the Sequential itself (balanced by parameters, or by each layer's forward time measured on the
    # first batch); validation runs through the stages and logs the same value on every rank.
    ref, ref_val, ref_train = _fit_sequential("auto", 1)
    strategy = strategies.PlanStrategy("pp2_1f1b_mb4", start_method="spawn", pipeline_balance=balance,
                                       timeout=__import__("datetime").timedelta(seconds=60))
    got, val, train = _fit_sequential(strategy, 2)
    torch.testing.assert_close(val, ref_val, rtol=1e-5, atol=1e-7)
    # training_step's self.log(sync_dist=True) runs on the last stage per microbatch: replayed on every rank
    # as the mean over the microbatches, it is the batch's value, as in one process.
    torch.testing.assert_close(train, ref_train, rtol=1e-5, atol=1e-7)
    for (name, a), b in zip(got.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


class _SavePredictions(L.Callback):
    def __init__(self, folder) -> None:
        self.folder = folder

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        torch.save(outputs, self.folder / f"rank{trainer.global_rank}-batch{batch_idx}.pt")


def test_pipeline_predict_returns_the_model_output_on_every_rank(tmp_path):
    # (Lightning's spawn launcher returns no predictions to the caller, so each rank saves what it got.)
    torch.manual_seed(0)
    module = SequentialRegression()
    x = torch.randn(8, 4)
    with torch.no_grad():
        expected = module.net(x)
    strategy = strategies.PlanStrategy("pp2", start_method="spawn",
                                       timeout=__import__("datetime").timedelta(seconds=60))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[_SavePredictions(tmp_path)])
    trainer.predict(module, DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(8, 1)), batch_size=4))
    for rank in (0, 1):
        got = torch.cat([torch.load(tmp_path / f"rank{rank}-batch{b}.pt") for b in (0, 1)])
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_two_torchrun_agents_as_two_nodes_match_one_process(tmp_path):
    # Two torchrun agents on this host, joined by c10d rendezvous, act as two nodes of two ranks each: tp2_pp2
    # keeps each tp pair inside a node and runs the pipeline's messages across the two. Equal to one process.
    import os

    from tests.helpers import ATOL, COMMON, PARAM_ATOL, RTOL, train_demo

    ref, ref_params = train_demo(tmp_path, "single", 1)
    port = ports.take()  # the rendezvous' (below the ephemeral range: see tests/ports.py)
    out, params = tmp_path / "two-nodes.json", tmp_path / "two-nodes.pt"
    agent = [python.core(), "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
             "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes",
             "-m", "strategies.cli", "train", "tp2_pp2", "--devices", "2", "--num-nodes", "2", "--out", str(out),
             "--params-out", str(params), "--wandb", "off", *COMMON]
    env = {**os.environ, "STRATPACK_TIMEOUT": "120", "STRATPACK_RUNS": str(tmp_path / "runs")}
    agents = [subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
              for _ in range(2)]
    logs = [a.communicate(timeout=420)[1] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(log[-3000:] for log in logs)
    result, got = json.loads(out.read_text()), torch.load(params)
    assert result["world_size"] == 4 and result["node_of_rank"] == [0, 0, 1, 1]
    assert not any("spans nodes" in log for log in logs)  # tp stayed inside each node
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
    for name in ref_params:
        torch.testing.assert_close(got[name], ref_params[name], rtol=RTOL, atol=PARAM_ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
