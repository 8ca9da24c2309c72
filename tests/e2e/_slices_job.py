"""A Lightning fit under a plan, then each rank's slice of the state saved as it lies (`PlanStrategy.state_by_slice`,
`checkpoint.slices.save_state`) at the end of training, and the same state gathered whole to compare with.

    python _slices_job.py OUT DEVICES PLAN [FROM]

The demo GPT built in ``configure_model``, AdamW, two steps. Rank 0 writes OUT.pt: the gathered weights (the
strategy's `full_state`) and AdamW's state by parameter name (`optimizer_state`'s, gathered); every rank writes its
part of the DCP directory OUT.dcp. With FROM (another run's OUT), the state is first loaded by slice from FROM.dcp
(`PlanStrategy.load_state_by_slice`), so OUT.pt is what this plan loaded."""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

import strategies  # noqa: F401  (the plan names)
from demos.gpt import GPTModule, make_demo
from strategies.checkpoint.slices import save_state


class SaveBySlice(L.Callback):
    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        if source:
            strategy.load_state_by_slice(source + ".dcp")
        save_state(strategy.state_by_slice(), out + ".dcp")
        # what the module computes with: each parameter this rank holds whole (not a placeholder, nor freed)
        module = {n: p.detach().clone() for n, p in pl_module.named_parameters()
                  if p.untyped_storage().nbytes() >= p.numel() * p.element_size() > 0}
        weights = {k: v.clone() for k, v in strategy.full_state().items()}
        optimizer = strategy.optimizer_state(trainer.optimizers[0])
        if trainer.global_rank == 0:  # (indices in the single-process order: the module's parameters, one group)
            names = [name for name, _ in pl_module.named_parameters()]
            moments = {names[i]: entry for i, entry in optimizer["state"].items()}
            torch.save({"weights": weights, "moments": moments, "module": module}, out + ".pt")


out, devices, plan, source = sys.argv[1], int(sys.argv[2]), sys.argv[3], (sys.argv[4:] or [""])[0]
L.seed_everything(1 if source else 0, verbose=False)  # (a loading run starts elsewhere: only the load makes it equal)
base, data = make_demo(n_layer=2, n_head=2, n_embd=16, seq_len=16, max_chars=4000)
model = GPTModule(base.config, configure_model=True, optimizer="adamw", lr=0.01)
trainer = L.Trainer(strategy=plan, accelerator="cpu", devices=devices, max_steps=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[SaveBySlice()])
trainer.fit(model, DataLoader(data, batch_size=8, drop_last=True))
