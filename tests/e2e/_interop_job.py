"""A checkpoint of Lightning's own ``ModelParallelStrategy`` (FSDP2, torch's DCP) resumed under one of the pack's
plans, and the pack's read back by it (#59: the same format, both ways).

    python _interop_job.py OUT DEVICES STRATEGY STEPS [FROM]

STRATEGY: ``mps`` (Lightning's ``ModelParallelStrategy``, data parallel only) or a plan. The demo GPT built in
``configure_model`` (under ``mps``: each block and the whole put under FSDP2's ``fully_shard`` over the
data-parallel mesh, as Lightning's docs show), AdamW, trained to STEPS, then ``trainer.save_checkpoint(OUT.ckpt)``.
With FROM (another run's checkpoint) the fit resumes from it. A ``mps`` run also writes OUT-titan.ckpt, its state in
torchtitan's layout (a plain ``dcp.save``).
Rank 0 writes OUT.pt, the whole weights and AdamW's state by parameter name, at the save; a resumed fit also
OUT-start.pt, before its first optimizer step (what it read: a pipeline reads it once the first batch has cut it)."""

import sys
from dataclasses import replace

import lightning as L
import torch
import torch.distributed.checkpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.utils.data import DataLoader

import strategies
from demos.gpt import GPTModule, make_demo


class Sharded(GPTModule):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class Whole(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # (a pipeline is cut, and loaded, in step 1)
        if source and trainer.global_step == start:
            write(trainer, pl_module, out + "-start.pt")

    def on_train_start(self, trainer, pl_module):
        global start
        start = trainer.global_step

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(out + ".ckpt")
        write(trainer, pl_module, out + ".pt")
        if strategy == "mps":
            titan(pl_module.model, trainer.optimizers[0], out + "-titan.ckpt")


def titan(model, optimizer, path):
    """The same state as torchtitan saves it with DCP (no Lightning): the model's by its own names under ``model``,
    the optimizer's flattened by parameter under ``optimizer``; its learning rate changed first (read back?)."""
    optimizer.param_groups[0]["lr"] = TITAN_LR
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    torch.distributed.checkpoint.save({"model": get_model_state_dict(model),
                                       "optimizer": get_optimizer_state_dict(model, optimizer, options=flat),
                                       "train_state": {"step": torch.tensor(2)}}, checkpoint_id=path)


def write(trainer, pl_module, path):
    """The whole weights and AdamW's state, named: FSDP2's through torch's full state dicts, the pack's gathered."""
    optimizer = trainer.optimizers[0]
    if strategy == "mps":
        whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(pl_module, options=whole)
        moments = get_optimizer_state_dict(pl_module, optimizer, options=whole).get("state", {})  # (rank 0's)
    else:
        weights = {k: v.clone() for k, v in trainer.strategy.full_state().items()}
        options, trainer.strategy.options = trainer.strategy.options, replace(trainer.strategy.options,
                                                                             checkpoint_format="gathered")
        gathered = trainer.strategy.optimizer_state(optimizer)  # (by index, in the module's order)
        trainer.strategy.options = options
        names = [name for name, _ in pl_module.named_parameters()]
        moments = {names[i]: entry for i, entry in gathered["state"].items()}
    if trainer.global_rank == 0:
        torch.save({"weights": weights, "moments": moments, "lr": optimizer.param_groups[0]["lr"]}, path)


TITAN_LR = 0.02
out, devices, strategy, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
source = (sys.argv[5:] or [None])[0]
L.seed_everything(1 if source else 0, verbose=False)
base, data = make_demo(n_layer=2, n_head=2, n_embd=16, seq_len=16, max_chars=4000)
model = (Sharded if strategy == "mps" else GPTModule)(base.config, configure_model=True, optimizer="adamw", lr=0.01)
trainer = L.Trainer(strategy=ModelParallelStrategy(devices, 1) if strategy == "mps" else strategy,
                    accelerator="cpu", devices=devices, max_steps=steps, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[Whole()])
loader = DataLoader(data, batch_size=8, drop_last=True)  # (under Lightning's own strategy, made resumable as the
trainer.fit(model, strategies.resumable(loader) if strategy == "mps" else loader, ckpt_path=source)  # pack's are)
