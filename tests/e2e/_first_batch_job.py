"""The first-batch check against planted errors, through the Trainer at 2 ranks: ``python _first_batch_job.py OUT``
fits every case in one set of processes (a fit stopped by the check stops on every rank alike, so the next one finds
the process group as it was) and writes what each ended with (the check's outcome, or the error's text) to OUT from
rank 0.

Cases: ``chunks`` a user's tp_plan that forgets ``chunks=3`` on a fused q|k|v (each rank gets q and half of k, or
half of k and v: it trains, silently wrong), on an attention the set-up proof cannot probe (it takes a mask);
``row_as_col`` a Llama whose tp_plan declares the row-parallel ``o_proj`` column-parallel; ``stage_order`` the
pipeline's stages run in the wrong order (planted in the pack: stage 0 gets the last blocks); ``ok_tp`` the
masked model with the right plan (the check passes; nanoGPT under pp passes in test_model_zoo_trainer)."""

import dataclasses
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import strategies
from strategies import Colwise, Rowwise
from strategies.pipeline import stages
from tests.models import zoo

_PARTITION = stages.partition


def planted(case: str) -> None:
    """``stage_order``: the stages' block ranges handed out last to first; every other case: the pack as it is."""
    stages.partition = (lambda *a, **k: _PARTITION(*a, **k)[::-1]) if case == "stage_order" else _PARTITION


class MaskedAttention(nn.Module):
    """Fused q|k|v attention that takes a mask: its forward needs two tensors, so the set-up proof cannot probe it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out, self.head = nn.Linear(zoo.WIDTH, 3 * zoo.WIDTH), nn.Linear(zoo.WIDTH, zoo.WIDTH), 8

    def forward(self, x, mask):
        B, T = x.shape[:2]
        q, k, v = (t.view(B, T, -1, self.head).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(zoo.WIDTH), MaskedAttention()

    def forward(self, x, mask):
        return x + self.attn(self.norm(x), mask)


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.blocks = nn.Embedding(zoo.VOCAB, zoo.WIDTH), nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(zoo.WIDTH, zoo.VOCAB)

    def loss(self, ids):
        mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool, device=ids.device).tril()
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, mask)
        return F.cross_entropy(self.head(x)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class Module(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, index):
        return self.net.loss(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


LLAMA_WRONG = {"*.q_proj": Colwise(), "*.k_proj": Colwise(), "*.v_proj": Colwise(), "*.o_proj": Colwise(),
               "*.gate_proj": Colwise(), "*.up_proj": Colwise(), "*.down_proj": Rowwise()}
FORGOT_CHUNKS = {"*.attn.qkv": Colwise(), "*.attn.out": Rowwise()}
CASES = {"chunks": (Masked, "tp2", FORGOT_CHUNKS), "ok_tp": (Masked, "tp2", {**FORGOT_CHUNKS, "*.attn.qkv":
                                                                               Colwise(chunks=3)}),
         "row_as_col": (lambda: zoo.build("llama"), "tp2", LLAMA_WRONG), "stage_order": (zoo.nanogpt, "pp2", None)}

def fit(case: str):
    build, plan, tp_plan = CASES[case]
    planted(case)
    torch.manual_seed(0)
    module = Module(build())
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        strategy=strategies.PlanStrategy(plan, check_first_batch=True, tp_plan=tp_plan))
    try:
        trainer.fit(module, DataLoader(TensorDataset(torch.cat(zoo.batches(2, batch=4))), batch_size=4))
        return dataclasses.asdict(trainer.strategy.first_batch)
    except strategies.FirstBatchMismatch as error:
        return f"FirstBatchMismatch: {error}"


if __name__ == "__main__":
    results = {case: fit(case) for case in CASES}
    if torch.distributed.get_rank() == 0:  # and the script ends, as a user's does: no barrier, no destroy
        torch.save(results, sys.argv[1])
