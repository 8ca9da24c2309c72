"""Hugging Face checkpoints (``save_pretrained`` in several files) loaded by slice into plans at 8 ranks:
``python _pretrained_job.py OUT DIR`` (DIR holds one ``save_pretrained`` folder per model of `CASES`). Each fit builds
the model in configure_model (on meta), loads it with `strategies.load_pretrained` at ``on_fit_start``, and takes one
step at learning rate 0. Rank 0 writes, per case, the whole model's weights as training starts, the first step's loss
(the mean over the ranks' batches: the global batch's) and every rank's bytes read beside the bytes of parameters
it keeps."""

import os
import sys

import lightning as L
import torch
import torch.distributed as dist
import torch.distributed.checkpoint
from torch.utils.data import DataLoader, TensorDataset

import strategies
from tests.models import zoo

CASES = [("llama", "tp2"), ("llama", "zero3"), ("llama", "pp2_1f1b_mb2"), ("gpt2", "zero3_tp2_pp2_1f1b_mb2"),
         ("gpt2", "tp2"), ("gpt2", "zero3")]
# Trained 2 steps after loading, then written back by `strategies.ExportPretrained` (save_pretrained at the end of fit)
# to DIR/export-*
EXPORTS = [("gpt2", "zero3_tp2_pp2_1f1b_mb2"), ("llama_tied", "zero3_tp2_pp2_1f1b_mb2")]
# torchtitan's layout (``model.*``, ``train_state``) written with DCP by FSDP2 over the 8 ranks (each its shard of
# every weight), loaded with `strategies.load_pretrained` as the safetensors are
DCP_CASES = [("gpt2", "zero3_tp2_pp2_1f1b_mb2")]
DEVICES, BATCH, STEPS, LR = 8, 8, 2, 0.5


class Pretrained(L.LightningModule):
    def __init__(self, name: str, folder: str, lr: float = 0.0) -> None:
        super().__init__()
        self.name, self.folder, self.net, self.read, self.loss = name, folder, None, None, None
        self.lr, self.val_loss = lr, None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = zoo.MODELS[self.name]()

    def on_fit_start(self) -> None:
        self.read = strategies.load_pretrained(self, self.folder)

    def training_step(self, batch, index):
        return self.net.loss(batch[0])

    def validation_step(self, batch, index):
        loss = self.net.loss(batch[0])
        self.val_loss = float(loss) if self.val_loss is None else self.val_loss  # the sanity check's (it cuts pp)
        return loss

    def on_train_batch_end(self, outputs, batch, index) -> None:
        self.loss = float(outputs["loss"]) if self.loss is None else self.loss  # the first step's

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class First(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Before the first step: under pp a meta-built model is cut and made in the first batch
        if hasattr(self, "state"):
            return
        self.state = {k: v.clone() for k, v in trainer.strategy.full_state().items()}
        self.kept = trainer.strategy.model_state_bytes()["params"]


def fit(name: str, plan: str, folder: str, export: bool = False, source: str | None = None) -> dict:
    L.seed_everything(0)
    steps, lr = (STEPS, LR) if export else (1, 0.0)
    out = os.path.join(folder, f"export-{name}") if export else None
    module = Pretrained(name, os.path.join(folder, source or name), lr)
    first = First()
    dp = strategies.ParallelPlan.parse(plan).resolve(DEVICES).dp
    trainer = L.Trainer(accelerator="cpu", devices=DEVICES, strategy=strategies.PlanStrategy(plan), max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=1, limit_val_batches=1,
                        check_val_every_n_epoch=100,
                        callbacks=[first] + ([strategies.ExportPretrained(out)] if export else []))
    data = TensorDataset(torch.cat(zoo.batches(steps, batch=BATCH)))
    loader = DataLoader(data, batch_size=BATCH // dp)
    # Under pp, a sanity check before the first batch: its batch cuts the stages, each reading its own weights
    trainer.fit(module, loader, loader if plan.startswith("pp") and not export else None)
    ranks = [None] * DEVICES
    dist.all_gather_object(ranks, (module.read.bytes_read, first.kept, module.loss, module.val_loss))
    return {"first": first.state, "ranks": ranks}


def fsdp2_save(name: str, folder: str) -> str:
    """The model `conftest.hf_saved` saved (the same seed), sharded by torch's FSDP2 over every rank and saved with
    DCP as torchtitan lays its checkpoints out. Returns the folder's name under ``folder``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = zoo.build(name, seed=3).model
    mesh = init_device_mesh("cpu", (DEVICES,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = {"model": get_model_state_dict(model), "train_state": {"step": torch.tensor(5)}}
    assert all(v.placements[0].is_shard() for v in state["model"].values())  # each rank its shard
    torch.distributed.checkpoint.save(state, checkpoint_id=os.path.join(folder, f"dcp-{name}"))
    return f"dcp-{name}"


def main(world: int, saved: str) -> dict:
    assert world == DEVICES, world
    results = {(name, plan): fit(name, plan, saved) for name, plan in CASES}
    results |= {("dcp", name, plan): fit(name, plan, saved, source=fsdp2_save(name, saved)) for name, plan in DCP_CASES}
    return results | {("export", name, plan): fit(name, plan, saved, export=True) for name, plan in EXPORTS}


if __name__ == "__main__":
    results = main(DEVICES, sys.argv[2])
    if torch.distributed.get_rank() == 0:  # and the script ends, as a user's does: no barrier, no destroy
        torch.save(results, sys.argv[1])
