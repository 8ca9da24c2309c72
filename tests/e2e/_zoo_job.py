"""Trains models of the zoo (tests/models/zoo.py) through the Trainer with 3D plans, in one set of 8 processes:
``python _zoo_job.py OUT [ci|full]`` (`CASES` or `FULL`). Lightning's popen launcher re-runs this script for ranks
1-7; the later Trainers find the process group there. Rank 0 writes each run's final parameters (the module is whole
again after fit) to OUT."""

import dataclasses
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import strategies  # (registers the plan strings)
from tests.models import zoo

# (model, plan, optimizer, gradient clipping). CI's cases: every model of the issue once, under one of the two 8-rank
# plans, with plain SGD without clipping (a gradient's scale shows in the step) or AdamW; Megatron's tied head under
# ZeRO-3 (by registration: Llama tied, nanoGPT; with vp and clipping, counted once in the norm: GPT-2).
CASES = [("llama", "dp_tp2_pp2_mb2", "adamw", None), ("llama_tied", "zero3_tp2_pp2_mb2", "sgd", None),
         ("llama_gqa", "dp_tp2_pp2_mb2", "sgd", None), ("qwen2", "zero3_tp2_pp2_mb2", "adamw", None),
         ("mistral", "dp_tp2_pp2_mb2", "sgd", None), ("gpt2", "zero3_tp2_pp2_vp_mb2", "sgd", 0.5),
         ("nanogpt", "zero3_tp2_pp2_mb2", "adamw", None), ("head_first", "dp_tp2_pp2_mb2", "sgd", None)]
# Context parallel (#23) with rotary positions (Llama) and learned ones (GPT-2, labels shifted inside the model): each
# sequence of 16 in 4 or 2 parts, with dp, ZeRO-3 over dp x cp, tp and pp; SGD and AdamW.
CASES += [("llama", "dp_cp4", "adamw", None), ("llama_gqa", "zero3_tp2_cp2", "sgd", None),
          ("llama", "cp2_pp2_mb2", "sgd", None), ("gpt2", "zero3_cp4", "adamw", None)]
# The whole cross (`pytest -m matrix`): every model x both plans x both optimizers.
FULL = [(name, plan, optimizer, None) for name in ("llama", "llama_tied", "llama_gqa", "qwen2", "mistral", "gpt2",
                                                   "nanogpt", "head_first")
        for plan in ("dp_tp2_pp2_mb2", "zero3_tp2_pp2_mb2") for optimizer in ("sgd", "adamw")]
DEVICES, DP, STEPS, BATCH = 8, 2, 3, 8


def optimizer_for(name: str, params):
    return torch.optim.SGD(params, lr=0.5) if name == "sgd" else torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


class Zoo(L.LightningModule):
    def __init__(self, name: str, optimizer: str) -> None:
        super().__init__()
        self.net, self.optimizer = zoo.build(name), optimizer

    def training_step(self, batch, index):
        return self.net.loss(batch[0])

    def configure_optimizers(self):
        return optimizer_for(self.optimizer, self.parameters())


def data() -> TensorDataset:
    return TensorDataset(torch.cat(zoo.batches(STEPS, batch=BATCH)))


def fit(name: str, plan: str, optimizer: str, clip: float | None) -> dict[str, torch.Tensor]:
    module = Zoo(name, optimizer)
    strategy = strategies.PlanStrategy(plan, check_first_batch=True)  # what the first-batch check found: "check"
    trainer = L.Trainer(accelerator="cpu", devices=DEVICES, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=clip, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(data(), batch_size=BATCH // DP, drop_last=True))
    return {**{k: v.detach().clone() for k, v in module.net.state_dict().items()},
            "check": dataclasses.asdict(trainer.strategy.first_batch)}


def main(world: int = DEVICES, which: str = "ci") -> dict:
    assert world == DEVICES, world
    return {case: fit(*case) for case in (FULL if which == "full" else CASES)}


if __name__ == "__main__":
    results = main(DEVICES, *sys.argv[2:])
    if torch.distributed.get_rank() == 0:  # and the script ends, as a user's does: no barrier, no destroy
        torch.save(results, sys.argv[1])
