"""A model with a parameter no step reaches (``spare``: in configure_model, never in forward), saved by slice at the
end of a fit under PLAN at 2 ranks and resumed from it (#59: AdamW holds no state for it, so the checkpoint holds
none, and the resume must not make one up).

    python _unused_job.py OUT PLAN STEPS [FROM]

Rank 0 prints ``OK <global step> <parameters with optimizer state>`` at the end of the fit, after saving OUT."""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

import strategies  # noqa: F401  (the plan names)
from demos.gpt import GPTModule, make_demo


class Unused(GPTModule):
    def configure_model(self):
        super().configure_model()
        self.spare = torch.nn.Linear(4, 4)


class Save(L.Callback):
    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(out)
        if trainer.global_rank == 0:
            print("OK", trainer.global_step, len(trainer.optimizers[0].state), flush=True)


out, plan, steps, source = sys.argv[1], sys.argv[2], int(sys.argv[3]), (sys.argv[4:] or [None])[0]
L.seed_everything(0, verbose=False)
base, data = make_demo(n_layer=2, n_head=2, n_embd=16, seq_len=16, max_chars=4000)
model = Unused(base.config, configure_model=True, optimizer="adamw", lr=0.01)
trainer = L.Trainer(strategy=plan, accelerator="cpu", devices=2, max_steps=steps, logger=False, callbacks=[Save()],
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, DataLoader(data, batch_size=8, drop_last=True), ckpt_path=source)
