"""A training job that a test breaks on purpose: ``python _fault_job.py PLAN DEVICES FAULT RANK STEP``.

FAULT: ``kill`` (the rank SIGKILLs itself at the start of step STEP), ``raise`` (its training_step raises
ValueError), or ``none``. Lightning's popen launcher re-runs this script for ranks 1..N-1.
"""

import os
import signal
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

import strategies  # noqa: F401  (registers the plan names)
from demos.gpt import GPTModule, make_demo
from strategies.monitor import StrategyMonitor

plan, devices, fault, fault_rank, fault_step = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])


class Faulty(GPTModule):
    def training_step(self, batch, batch_idx):
        if fault == "raise" and self.global_rank == fault_rank and self.trainer.global_step == fault_step:
            raise ValueError(f"boom on purpose at step {fault_step}")
        return super().training_step(batch, batch_idx)


class Kill(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        print(f"rank {trainer.global_rank} starts step {trainer.global_step}", file=sys.stderr, flush=True)
        if fault == "kill" and trainer.global_rank == fault_rank and trainer.global_step == fault_step:
            os.kill(os.getpid(), signal.SIGKILL)


L.seed_everything(0, verbose=False)
base, dataset = make_demo(n_layer=2, n_head=2, n_embd=16, seq_len=16, max_chars=4000)
module = Faulty(base.config)
trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=plan, max_steps=6, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[Kill(), StrategyMonitor(warmup_steps=0)])  # the run store: $STRATPACK_RUNS
trainer.fit(module, torch.utils.data.DataLoader(dataset, batch_size=4, drop_last=True))
print(f"rank {trainer.global_rank} finished", file=sys.stderr, flush=True)
