"""A Lightning fit under a plan whose checkpoint each rank writes by slice (`trainer.save_checkpoint` at the end of
training: the strategy's DCP directory, `checkpoint.dcp_dir`), and the same state gathered whole to compare with.

    python _slices_job.py OUT DEVICES PLAN [FROM]

The demo GPT built in ``configure_model``, AdamW, two steps. Rank 0 writes OUT.pt: the gathered weights (the
strategy's `full_state`) and AdamW's state by parameter name (`optimizer_state`'s, gathered under
``checkpoint_format="gathered"``); every rank writes its part of the DCP directory OUT.dcp. With FROM (another run's
OUT), the fit resumes from FROM.dcp (``ckpt_path``: each rank reads its slice) and OUT.pt is written at the start of
training, before a step: what this plan loaded."""

import sys
from dataclasses import replace

import lightning as L
import torch
from torch.utils.data import DataLoader

import strategies  # noqa: F401  (the plan names)
from demos.gpt import GPTModule, make_demo


class SaveBySlice(L.Callback):
    def on_train_start(self, trainer, pl_module):  # resumed: what the checkpoint restored, before a step changes it
        if source:
            gather(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        if not source:
            trainer.save_checkpoint(out + ".dcp")
            gather(trainer, pl_module)


def gather(trainer, pl_module):
    strategy = trainer.strategy
    # what the module computes with: each parameter this rank holds whole (not a placeholder, nor freed)
    module = {n: p.detach().clone() for n, p in pl_module.named_parameters()
              if p.untyped_storage().nbytes() >= p.numel() * p.element_size() > 0}
    weights = {k: v.clone() for k, v in strategy.full_state().items()}
    options, strategy.options = strategy.options, replace(strategy.options, checkpoint_format="gathered")
    optimizer = strategy.optimizer_state(trainer.optimizers[0])  # (gathered whole, by index)
    strategy.options = options
    if trainer.global_rank == 0:  # (indices in the single-process order: the module's parameters, one group)
        names = [name for name, _ in pl_module.named_parameters()]
        moments = {names[i]: entry for i, entry in optimizer["state"].items()}
        torch.save({"weights": weights, "moments": moments, "module": module}, out + ".pt")


out, devices, plan, source = sys.argv[1], int(sys.argv[2]), sys.argv[3], (sys.argv[4:] or [""])[0]
L.seed_everything(1 if source else 0, verbose=False)  # (a loading run starts elsewhere: only the load makes it equal)
base, data = make_demo(n_layer=2, n_head=2, n_embd=16, seq_len=16, max_chars=4000)
model = GPTModule(base.config, configure_model=True, optimizer="adamw", lr=0.01)
trainer = L.Trainer(strategy=plan, accelerator="cpu", devices=devices, max_steps=3 if source else 2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[SaveBySlice()])
trainer.fit(model, DataLoader(data, batch_size=8, drop_last=True), ckpt_path=source + ".dcp" if source else None)
