"""A training job that a test breaks on purpose: ``python _fault_job.py PLAN DEVICES FAULT RANK STEP``.

At global step STEP (after STEP optimizer steps), on rank RANK (-1: every rank), FAULT happens:

- ``kill``: the rank SIGKILLs itself at the start of the step;
- ``raise``: its training_step raises ValueError;
- ``nan``: its training_step returns a NaN loss;
- ``oom``: a forward hook raises torch.OutOfMemoryError (what CUDA raises; simulated, as on CPU nothing does);
- ``split``: its batch arrives with 3 samples, which do not split into the plan's microbatches;
- ``none``: nothing.

Lightning's popen launcher re-runs this script for ranks 1..N-1; the run store is ``$STRATPACK_RUNS`` or ./runs.
"""

import os
import signal
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

import strategies  # noqa: F401  (registers the plan names)
from demos.gpt import GPTModule, make_demo
from strategies.measure.monitor import StrategyMonitor

plan, devices, fault = sys.argv[1], int(sys.argv[2]), sys.argv[3]
fault_rank, fault_step = int(sys.argv[4]), int(sys.argv[5])


class Faulty(GPTModule):
    def _now(self, kind: str) -> bool:
        return (fault == kind and fault_rank in (-1, self.global_rank) and self.trainer.training
                and self.trainer.global_step == fault_step)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        if self._now("split"):
            return tuple(t[:3] for t in batch)
        return batch

    def training_step(self, batch, batch_idx):
        if self._now("raise"):
            raise ValueError(f"boom on purpose at step {fault_step}")
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self._now("nan") else loss


class Kill(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        print(f"rank {trainer.global_rank} starts step {trainer.global_step}", file=sys.stderr, flush=True)
        if fault == "kill" and fault_rank in (-1, trainer.global_rank) and trainer.global_step == fault_step:
            os.kill(os.getpid(), signal.SIGKILL)


def out_of_memory(module, args):
    if module._now("oom"):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated on purpose)")


L.seed_everything(0, verbose=False)
base, dataset = make_demo(n_layer=2, n_head=2, n_embd=16, seq_len=16, max_chars=4000)
module = Faulty(base.config)
module.register_forward_pre_hook(out_of_memory)
trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=plan, max_steps=6, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[Kill(), StrategyMonitor(warmup_steps=0)])  # the run store: $STRATPACK_RUNS
trainer.fit(module, torch.utils.data.DataLoader(dataset, batch_size=4, drop_last=True))
print(f"rank {trainer.global_rank} finished", file=sys.stderr, flush=True)
