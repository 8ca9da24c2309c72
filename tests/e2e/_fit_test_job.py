"""A user's script as Lightning's docs write one: ``trainer.fit(model, train, val)`` with a ``ModelCheckpoint``, then
``trainer.validate(model, val)`` (the weights fit left), ``trainer.test(model, test, ckpt_path="best")``,
``trainer.predict(model, data, ckpt_path="best")``, and a new Trainer's fit from ``ckpt_path=".../last.ckpt"`` for
two more steps, tested from its own last checkpoint.

    python _fit_test_job.py OUT DEVICES PLAN BUILT

``BUILT``: ``init`` or ``configure_model`` (the model built on meta there, each rank making what it keeps). Rank 0
writes to OUT the best checkpoint's test loss, the resumed fit's, the validation loss after the first fit, and its
own predictions (a loss per batch), and to OUT.held the share of the model's parameter bytes it held as it tested
from the best checkpoint, and in the fit's sanity check."""

import sys

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Subset

import strategies  # noqa: F401  (the plan names)
from demos.gpt import GPTModule, make_demo


class Held(L.Callback):
    """The bytes of parameters this rank holds after its first test batch (under pp the one that cut the stages),
    over the whole model's: a model built on meta tested from a checkpoint keeps the plan's slices. ``sanity``: the
    same after the fit's sanity check's first batch (under pp, before any training batch: it cuts the stages)."""

    share = sanity = None

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if self.share is None:
            self.share = _share(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.sanity_checking and self.sanity is None:
            self.sanity = _share(trainer)


def _share(trainer) -> float:
    return trainer.strategy.model_state_bytes()["params"] / (trainer.strategy.built_num_params * 4)


class Module(GPTModule):
    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.compute_loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.compute_loss(batch)


out, devices, plan, built = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
L.seed_everything(0, verbose=False)
base, data = make_demo(n_layer=2, n_head=2, n_embd=16, seq_len=16, max_chars=4000)
model = Module(base.config, configure_model=built == "configure_model", optimizer="sgd-plain", lr=0.1)
held_out = Subset(data, range(8))
common = dict(strategy=plan, accelerator="cpu", devices=devices, val_check_interval=2, limit_val_batches=1,
              logger=False, enable_progress_bar=False, enable_model_summary=False)
held = Held()
trainer = L.Trainer(max_steps=4, **common,
                    callbacks=[ModelCheckpoint(dirpath=out + ".ckpt", monitor="val_loss", save_last=True), held])
trainer.fit(model, DataLoader(data, batch_size=4, drop_last=True), DataLoader(held_out, batch_size=4))
trainer.validate(model, DataLoader(held_out, batch_size=4))  # no ckpt_path: the weights fit left (in slices)
after_fit = float(trainer.callback_metrics["val_loss"])
trainer.test(model, DataLoader(held_out, batch_size=4), ckpt_path="best")
best = float(trainer.callback_metrics["test_loss"])
predictions = trainer.predict(model, DataLoader(held_out, batch_size=4), ckpt_path="best")
again = L.Trainer(max_steps=6, **common, callbacks=[ModelCheckpoint(dirpath=out + ".again", save_last=True)])
again.fit(model, DataLoader(data, batch_size=4, drop_last=True), DataLoader(held_out, batch_size=4),
          ckpt_path=out + ".ckpt/last.ckpt")
again.test(model, DataLoader(held_out, batch_size=4), ckpt_path="last")
figures = [best, float(again.callback_metrics["test_loss"]), after_fit, *map(float, predictions)]
if again.global_rank == 0:
    with open(out, "w") as f:
        f.write(" ".join(f"{v:.8f}" for v in figures))
    with open(out + ".held", "w") as f:
        f.write(f"{held.share:.4f} {held.sanity:.4f}")
