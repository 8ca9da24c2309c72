"""The C heap each rank holds while Lightning saves a checkpoint of a fit, and while a fit resumes from one under
another plan (#59: by slice, no rank holds more than its share plus a tensor in flight).

    python _save_heap_job.py OUT DEVICES PLAN STEPS [FROM]

The demo GPT (4 x 256, batch 2 x 32: the states outweigh the activations) built in ``configure_model``, AdamW. With
FROM (a directory another run saved), the fit resumes from it. It trains to STEPS and saves OUT.ckpt at the end
(``trainer.save_checkpoint``). Each rank writes OUT.rank<N>.json: ``steady``, the heap's peak over the steps after
the first of this fit; ``save``, its peak during the save; ``load``, during the resume's reads
(`PlanStrategy.load_state_by_slice`, wherever Lightning's order puts them); ``largest``, the largest tensor of the
whole model (bytes). All in bytes above the heap in use before the fit (the data and the libraries). Run with MKL's
buffer cache off (`cli.train.HEAP_ENV`), as `stratpack train --heap`."""

import json
import sys

import lightning as L
from torch.utils.data import DataLoader

import strategies  # noqa: F401  (the plan names)
from demos.gpt import GPTModule, make_demo
from strategies import PlanStrategy
from strategies.measure.memory import HeapSampler


class Windows(L.Callback):
    """The heap's peak in each window of the fit, from one sampler (`HeapSampler.restart` at each boundary)."""

    def __init__(self, sampler: HeapSampler, base: int) -> None:
        self.sampler, self.base, self.peaks, self.first = sampler, base, {}, None

    def close(self, name: str) -> None:
        peak, _ = self.sampler.restart()
        if name:
            self.peaks[name] = max(self.peaks.get(name, 0), peak - self.base)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first is None:
            self.first = trainer.global_step
        self.close("" if trainer.global_step <= self.first + 1 else "steady")  # (the first step holds the set-up)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.close("" if trainer.global_step <= self.first + 1 else "steady")

    def on_train_end(self, trainer, pl_module):
        self.close("")
        trainer.save_checkpoint(out + ".ckpt")
        self.close("save")


def measured_loads(strategy: PlanStrategy, windows: Windows) -> None:
    """Each read of the resume (the weights at set-up, the optimizer's state after it) as a window of its own."""
    load = strategy.load_state_by_slice

    def timed(*args, **kwargs):
        windows.close("")
        load(*args, **kwargs)
        windows.close("load")

    strategy.load_state_by_slice = timed


out, devices, plan, steps, source = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5:]
L.seed_everything(0, verbose=False)
base, data = make_demo(n_layer=4, n_head=4, n_embd=256, seq_len=32, max_chars=20000)
model = GPTModule(base.config, configure_model=True, optimizer="adamw", lr=0.01)
largest = max(p.numel() for p in GPTModule(base.config, optimizer="adamw").parameters()) * 4
strategy = PlanStrategy(plan)
with HeapSampler() as sampler:
    windows = Windows(sampler, sampler.in_use())
    measured_loads(strategy, windows)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[windows])
    trainer.fit(model, DataLoader(data, batch_size=2, drop_last=True), ckpt_path=source[0] if source else None)
with open(f"{out}.rank{trainer.global_rank}.json", "w") as f:
    json.dump({**windows.peaks, "largest": largest}, f)
