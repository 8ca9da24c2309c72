"""Mid-epoch resume with random draws in the step (issue 20, part 7): each case trains STEPS steps straight through,
saving every SAVE_EVERY steps, then again from the checkpoint saved mid-epoch; the two must end with the same
parameters, bit for bit (same plan, same world: the same operations in the same order). The step applies dropout to
the logits, so a resumed run that restarted the epoch's data or drew its masks from the seed again ends elsewhere.
``python _resume_job.py OUT WORLD DIR``; Lightning's popen launcher re-runs this script for the other ranks."""

import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import strategies  # noqa: F401  (registers the plan strings)
from demos.gpt import GPT, GPTConfig

BATCH, EPOCH_STEPS, STEPS, SAVE_EVERY = 8, 4, 6, 3  # saves at step 3 (mid-epoch 0) and 6; resumes from step 3
CONFIG = GPTConfig(vocab_size=32, n_layer=2, n_head=2, n_embd=16, seq_len=8)
CASES = (("zero3", 2), ("pp2_mb2", 1))  # (plan, accumulate) at 2 ranks: data-parallel and a pipeline


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(CONFIG)

    def training_step(self, batch, index):
        x, y = batch
        logits = F.dropout(self.model(x), p=0.2)  # draws from the global generator at every step
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data(dp: int, accumulate: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH * accumulate * EPOCH_STEPS, CONFIG.seq_len + 1), generator=g)
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=BATCH // dp, shuffle=True, drop_last=True)


def fit(plan: str, accumulate: int, world: int, folder: str, resume: str | None = None) -> dict[str, torch.Tensor]:
    from strategies.plan import ParallelPlan

    L.seed_everything(0, verbose=False)
    module = Module()
    save = [] if resume else [ModelCheckpoint(dirpath=folder, every_n_train_steps=SAVE_EVERY, save_top_k=-1)]
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=plan, max_steps=STEPS, logger=False,
                        accumulate_grad_batches=accumulate, enable_checkpointing=not resume, callbacks=save,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, data(ParallelPlan.parse(plan).resolve(world).dp, accumulate), ckpt_path=resume)
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}


if __name__ == "__main__":
    out, world, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    results = {}
    for plan, accumulate in CASES:
        folder = os.path.join(root, plan)
        straight = fit(plan, accumulate, world, folder)
        resumed = fit(plan, accumulate, world, folder, resume=os.path.join(folder, f"epoch=0-step={SAVE_EVERY}.ckpt"))
        results[plan] = (straight, resumed)
    if torch.distributed.get_rank() == 0:  # and the script ends, as a user's does: no barrier, no destroy
        torch.save(results, out)
