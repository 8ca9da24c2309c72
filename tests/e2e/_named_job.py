"""Trains the demo GPT with each named strategy class and with its plan string, in the same two processes:
``python _named_job.py OUT``. Lightning's popen launcher re-runs this script for rank 1; the later Trainers of the
script find the process group (and rank 1) already there. Rank 0 writes every run's per-step losses and final
parameters to OUT (torch.save)."""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

import strategies
from demos.gpt import make_demo

CASES = [  # (named class, its plan string); plain SGD, no clipping: a gradient's scale shows in the step
    (lambda: strategies.NaiveDataParallelStrategy(), "naive"),
    (lambda: strategies.DataParallelStrategy(), "dp"),
    (lambda: strategies.ZeroStrategy(stage=2), "zero2"),
    (lambda: strategies.ZeroStrategy(stage=3, offload=True), "zero3_offload"),
    (lambda: strategies.TensorParallelStrategy(tp=2, sequence_parallel=True), "tp2_sp"),
    (lambda: strategies.PipelineStrategy(pp=2, schedule="gpipe", microbatches=4), "pp2_gpipe_mb4"),
]


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def fit(strategy) -> tuple[list[float], dict[str, torch.Tensor]]:
    L.seed_everything(0, verbose=False)
    module, dataset = make_demo(n_layer=2, n_head=2, n_embd=16, seq_len=16, max_chars=4000, optimizer="sgd")
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[losses])
    trainer.fit(module, DataLoader(dataset, batch_size=8, drop_last=True))
    return losses.losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


def main(world: int = 2) -> dict:
    assert world == 2, world
    return {plan: {"named": fit(make()), "string": fit(plan), "class": type(make()).__name__} for make, plan in CASES}


if __name__ == "__main__":
    results = main()
    if torch.distributed.get_rank() == 0:  # and the script ends, as a user's does: no barrier, no destroy
        torch.save(results, sys.argv[1])
