"""A job that dies once and is restarted by torchrun: ``python -m torch.distributed.run --max-restarts 3
--nproc_per_node N _restart_job.py PLAN FAULT RANK STEP CKPT_DIR PARAMS_OUT``.

Eight optimizer steps of the demo GPT under ``PlanStrategy(PLAN, resume="auto", deterministic=True)``, a checkpoint
every two steps into CKPT_DIR, the run recorded in ``$STRATPACK_RUNS``; at the end rank 0 saves the parameters (the
single-device view) to PARAMS_OUT. In the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), FAULT happens on
rank RANK:

- ``kill``: the rank SIGKILLs itself at the start of step STEP (after STEP optimizer steps);
- ``torn``: rank 0 SIGKILLs itself as the save after step STEP is about to be moved in: its folder
  (``<path>.tmp-<token>``) holds every part, and no checkpoint is at its path (a save torn by the crash);
- ``async-torn``: as ``torn``, with ``async_save=True``: rank 0 is killed in the background thread writing the save
  while training has gone on;
- ``none``: nothing (the uninterrupted reference, run under torchrun too).
"""

import os
import signal
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from demos.gpt import GPTModule, make_demo
from strategies import PlanStrategy
from strategies.checkpoint import dcp_dir
from strategies.lightning.pretrained import full_state_blocks
from strategies.measure.monitor import StrategyMonitor

plan, fault, fault_rank, fault_step, ckpt_dir, params_out = sys.argv[1:7]
fault_rank, fault_step = int(fault_rank), int(fault_step)
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


class Kill(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = (trainer.global_rank, trainer.global_step) == (fault_rank, fault_step)
        if first_attempt and fault == "kill" and now:
            print(f"rank {fault_rank} killed at step {fault_step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class Final(Callback):
    def on_train_end(self, trainer, pl_module):
        kept = {k: v.detach().cpu() for block in full_state_blocks(pl_module) for k, v in block.items()}
        if trainer.global_rank == 0:
            torch.save(kept, params_out)


if first_attempt and fault in ("torn", "async-torn"):
    swap_in = dcp_dir.swap_in

    def moved_in(path, tmp, token):
        if f"step={fault_step}." in path:
            print(f"rank 0 killed before the save was moved in: {tmp}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return swap_in(path, tmp, token)

    dcp_dir.swap_in = moved_in

L.seed_everything(0, verbose=False)
base, dataset = make_demo(n_layer=2, n_head=2, n_embd=16, seq_len=16, max_chars=4000)
module = GPTModule(base.config)
strategy = PlanStrategy(plan, resume="auto", deterministic=True, async_save=fault.startswith("async"))
trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), max_steps=8,
                    strategy=strategy, logger=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    callbacks=[StrategyMonitor(warmup_steps=1), Kill(), Final(),
                               ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)])
trainer.fit(module, torch.utils.data.DataLoader(dataset, batch_size=8, drop_last=True))
print(f"rank {trainer.global_rank} finished", file=sys.stderr, flush=True)
torch.distributed.barrier()  # all together, as `stratpack train` ends: an exit in C++ teardown can abort, which
torch.distributed.destroy_process_group()  # torchrun would take for a failure and restart
