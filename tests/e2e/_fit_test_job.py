"""A user's script as Lightning's docs write one: ``trainer.fit(model, train, val)`` with a ``ModelCheckpoint``, then
``trainer.test(model, test, ckpt_path="best")``.

    python _fit_test_job.py OUT DEVICES PLAN BUILT

``BUILT``: ``init`` or ``configure_model`` (the model built on meta there, each rank making what it keeps). Rank 0
writes the test loss to OUT."""

import sys

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Subset

import strategies  # noqa: F401  (the plan names)
from demos.gpt import GPTModule, make_demo


class Module(GPTModule):
    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.compute_loss(batch), sync_dist=True)


out, devices, plan, built = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
L.seed_everything(0, verbose=False)
base, data = make_demo(n_layer=2, n_head=2, n_embd=16, seq_len=16, max_chars=4000)
model = Module(base.config, configure_model=built == "configure_model", optimizer="sgd-plain", lr=0.1)
held_out = Subset(data, range(8))
trainer = L.Trainer(strategy=plan, accelerator="cpu", devices=devices, max_steps=4, val_check_interval=2,
                    limit_val_batches=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[ModelCheckpoint(dirpath=out + ".ckpt", monitor="val_loss")])
trainer.fit(model, DataLoader(data, batch_size=4, drop_last=True), DataLoader(held_out, batch_size=4))
trainer.test(model, DataLoader(held_out, batch_size=4), ckpt_path="best")
if trainer.global_rank == 0:
    with open(out, "w") as f:
        f.write(f"{float(trainer.callback_metrics['test_loss']):.8f}\n")
