"""A model whose state dict holds buffers, saved by slice under a pipeline and resumed under one (#59): each block
counts the forwards it ran in a buffer of its own (as BatchNorm's ``num_batches_tracked``). Under pp only the stage
that runs a block counts, so only that stage's copy is right: the save writes that one, and a resume reads it into
every rank's copy.

    python _buffers_job.py OUT PLAN STEPS [FROM]

2 ranks, the demo GPT (4 blocks) built in ``__init__``, AdamW; a ``ModelCheckpoint`` saves OUT/last.ckpt at the last
step, while the stages still hold their blocks (after fit every rank's copies are made alike)."""

import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import strategies  # noqa: F401  (the plan names)
from demos.gpt import GPTModule, make_demo


class Counted(torch.nn.Module):
    """A block that counts its forwards in training (in a buffer of its own)."""

    def __init__(self, block):
        super().__init__()
        self.block = block
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.seen += 1
        return self.block(x)


class Counting(GPTModule):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.model.blocks = torch.nn.ModuleList(Counted(block) for block in self.model.blocks)


out, plan, steps, source = sys.argv[1], sys.argv[2], int(sys.argv[3]), (sys.argv[4:] or [None])[0]
L.seed_everything(0, verbose=False)
base, data = make_demo(n_layer=4, n_head=2, n_embd=16, seq_len=16, max_chars=4000)
model = Counting(base.config, optimizer="adamw", lr=0.01)
last = ModelCheckpoint(dirpath=out, filename="last", every_n_train_steps=steps)
trainer = L.Trainer(strategy=plan, accelerator="cpu", devices=2, max_steps=steps, logger=False, callbacks=[last],
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, DataLoader(data, batch_size=8, drop_last=True), ckpt_path=source)
