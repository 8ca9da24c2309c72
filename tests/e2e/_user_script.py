"""A user's script, ended as Lightning's docs end one: ``trainer.fit(...)`` and nothing after it (no barrier, no
``destroy_process_group``). Its ``training_step`` reads the loss, as users' do (``loss.item()``, a perplexity).

    python _user_script.py OUT DEVICES PLAN [PLAN ...]

Each plan is fit twice in the same processes, the model built in ``__init__`` and in ``configure_model`` (on meta,
each rank making its slice); rank 0 appends one line per fit to OUT. The test reads OUT and the exit status.
``BATCH`` (default 8): the loader's batch size (one that a plan refuses shows how an error ends the script);
``BUILDS``: which builds, in order (default ``init,configure_model``)."""

import math
import os
import sys

import lightning as L
from torch.utils.data import DataLoader

import strategies  # noqa: F401  (the plan names)
from demos.gpt import GPTModule, make_demo


class Module(GPTModule):
    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train_loss", loss.item())
        self.log("perplexity", math.exp(loss.item()))
        return loss


out, devices, plans = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for plan in plans:
    for built in os.environ.get("BUILDS", "init,configure_model").split(","):
        L.seed_everything(0, verbose=False)
        base, data = make_demo(n_layer=4, n_head=2, n_embd=16, seq_len=16, max_chars=4000,
                               n_experts=4 if "ep" in plan else 0)
        model = Module(base.config, configure_model=built == "configure_model")
        trainer = L.Trainer(strategy=plan, accelerator="cpu", devices=devices, max_steps=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, DataLoader(data, batch_size=int(os.environ.get("BATCH", 8)), drop_last=True))
        if trainer.global_rank == 0:
            with open(out, "a") as f:
                f.write(f"{plan} {built} {float(trainer.callback_metrics['perplexity']):.6f}\n")
