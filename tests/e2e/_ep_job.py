"""Expert parallel (#48) through the Trainer: ``python _ep_job.py OUT WORLD [plant]``. Each case trains a tiny MoE model
of the zoo (Mixtral, with and without its aux loss, Qwen2-MoE, Qwen3-MoE, OLMoE, the demo GPT's MoE) for 2 steps with
plain SGD (no momentum, no clipping) in fp32; rank 0 saves the final parameters (whole again after fit). Lightning's
popen launcher re-runs this script for the other ranks. ``plant``: the return all-to-all's order broken on purpose
(`PLANT`). The cases of `SAVED` also save a checkpoint by slice at their fit's end (under ``ep-ckpts/`` in the
working folder), and `RESUMED` resumes one of them under another plan at its last step (so it only loads)."""

import contextlib
import dataclasses
import itertools
import os
import sys
from unittest import mock

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import strategies  # (registers the plan strings)
from strategies.expert_parallel import dispatch
from tests.models import zoo

STEPS, BATCH, LR = 2, 8, 0.5
# (model, plan, optimizer): plain SGD, and AdamW once (with activation checkpointing: the all-to-alls run again in
# the recomputed forward).
CASES = {2: [("gpt_moe", "ep2", "sgd"), ("mixtral_aux", "ep2", "sgd"), ("qwen2_moe", "zero3_ep2", "sgd"),
             ("qwen3_moe", "ep2", "sgd")],
         4: [("gpt_moe", "ep4", "sgd"), ("mixtral", "zero3_ep2", "sgd"), ("qwen2_moe", "ep4", "sgd"),
             ("gpt_moe", "tp2_ep2", "sgd"), ("mixtral", "ep2_pp2_mb2", "sgd"), ("gpt_moe", "zero1_ep2", "sgd"),
             ("qwen2_moe", "zero2_ep2_ac", "adamw"), ("mixtral_aux", "zero1_ep2", "sgd"), ("olmoe", "ep4", "sgd")],
         8: [("qwen2_moe", "dp2_tp2_ep2_pp2_mb2", "sgd")]}
# Saved by slice at the fit's end (#59: each rank its experts' rows, with ZeRO-3, tp and pp); at 4, mixtral's
# zero3_ep2 checkpoint resumed under ep2_pp2_mb2, each rank reading its experts of its stage
SAVED = {("mixtral", "zero3_ep2", "sgd"), ("gpt_moe", "tp2_ep2", "sgd"), ("mixtral", "ep2_pp2_mb2", "sgd"),
         ("qwen2_moe", "dp2_tp2_ep2_pp2_mb2", "sgd")}
RESUMED = {4: [(("mixtral", "ep2_pp2_mb2", "sgd"), "zero3_ep2")]}


class Save(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:  # (the plan still holds its slices)
        trainer.save_checkpoint(self.path)


class MoeModule(L.LightningModule):
    def __init__(self, name: str, optimizer: str = "sgd") -> None:
        super().__init__()
        self.net, self.optimizer = zoo.build(name), optimizer

    def training_step(self, batch, index):
        return self.net.loss(batch[0])

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-6)
        return torch.optim.SGD(self.parameters(), lr=LR)


def data() -> TensorDataset:
    return TensorDataset(torch.cat(zoo.batches(STEPS, batch=BATCH)))


def reference(name: str, optimizer: str = "sgd") -> dict[str, torch.Tensor]:
    """One process, the whole batch per step: the batches Lightning's DistributedSampler gives (shuffled with seed 0,
    PL_GLOBAL_SEED=0: the data ranks' k-th batches together are the k-th slice of that permutation)."""
    module = MoeModule(name, optimizer)
    optimizer = module.configure_optimizers()
    ids = data().tensors[0]
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    for step in range(STEPS):
        optimizer.zero_grad()
        module.net.loss(ids[order[step * BATCH : (step + 1) * BATCH]]).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


def fit(name: str, plan: str, optimizer: str, world: int, check: bool = True, source: str | None = None) -> dict:
    module = MoeModule(name, optimizer)
    data_ranks = world // (2 if "tp2" in plan else 1) // (2 if "pp2" in plan else 1)
    strategy = strategies.PlanStrategy(plan, check_first_batch=check)  # its outcome: "check"
    saved = os.path.abspath(f"ep-ckpts/{name}-{plan}.ckpt") if (name, plan, optimizer) in SAVED and not source else None
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[Save(saved)] if saved else [])
    trainer.fit(module, DataLoader(data(), batch_size=BATCH // data_ranks, drop_last=True), ckpt_path=source)
    return {"params": {k: v.detach().clone() for k, v in module.net.state_dict().items()},
            "check": dataclasses.asdict(trainer.strategy.first_batch) if check and not source else None,
            "saved": saved}


def planted_exchange():
    """PLANT: the return trip of every layer's all-to-all (each second call) gives each sender's rows back reversed."""
    calls, exchange = itertools.count(), dispatch.exchange

    def broken(rows, axis, output_splits, input_splits):
        out = exchange(rows, axis, output_splits, input_splits)
        return torch.cat([part.flip(0) for part in out.split(output_splits)]) if next(calls) % 2 else out
    return broken


def main(world: int, plant: str = "") -> dict:
    cases = CASES[world][:1] if plant else CASES[world]
    # (planted: without the first-batch check, which stops such a run at its first batch, so that it trains)
    with mock.patch.object(dispatch, "exchange", planted_exchange()) if plant else contextlib.nullcontext():
        done = {case: fit(*case, world, check=not plant) for case in cases}
    for case, source in [] if plant else RESUMED.get(world, []):
        done[("resumed", *case)] = fit(*case, world, source=os.path.abspath(f"ep-ckpts/{case[0]}-{source}.ckpt"))
    return done


if __name__ == "__main__":
    results = main(int(sys.argv[2]), *sys.argv[3:])
    if torch.distributed.get_rank() == 0:  # and the script ends, as a user's does: no barrier, no destroy
        torch.save(results, sys.argv[1])
