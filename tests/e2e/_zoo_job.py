"""Trains models of the zoo (tests/models/zoo.py) through the Trainer with 3D plans, in one set of 8 processes:
``python _zoo_job.py OUT``. Lightning's popen launcher re-runs this script for ranks 1-7; the later Trainers find the
process group there. Rank 0 writes each run's final parameters (the module is whole again after fit) to OUT."""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import strategies  # noqa: F401  (registers the plan strings)
from tests.models import zoo

# (model, plan, gradient clipping): plain SGD; Megatron's tied head under ZeRO-3 with clipping (counted once in the
# norm), an untied GQA model under dp without clipping (a gradient's scale shows in the step).
CASES = [("llama_gqa", "dp_tp2_pp2_mb2", None), ("gpt2", "zero3_tp2_pp2_mb2", 0.5)]
DEVICES, DP, STEPS, BATCH = 8, 2, 3, 8


class Zoo(L.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.net = zoo.build(name)

    def training_step(self, batch, index):
        return self.net.loss(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def data() -> TensorDataset:
    return TensorDataset(torch.cat(zoo.batches(STEPS, batch=BATCH)))


def fit(name: str, plan: str, clip: float | None) -> dict[str, torch.Tensor]:
    module = Zoo(name)
    trainer = L.Trainer(accelerator="cpu", devices=DEVICES, strategy=plan, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=clip, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(data(), batch_size=BATCH // DP, drop_last=True))
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


if __name__ == "__main__":
    results = {(name, plan): fit(name, plan, clip) for name, plan, clip in CASES}
    if torch.distributed.get_rank() == 0:
        torch.save(results, sys.argv[1])
