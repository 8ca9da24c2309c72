"""Context parallel (#23) on gloo ranks: ring attention against one process's causal SDPA (outputs and gradients,
float64: equal to rounding), the bytes each rank sends against the ring's formula, and whole models (the demo GPT,
Hugging Face Llama with rotary positions and GPT-2 with learned ones, whose labels it shifts inside) whose loss and
gradients on split sequences equal one process's on whole ones (fp32)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from strategies.comm import Axis, CommStats, Op
from strategies.context_parallel import layout
from strategies.context_parallel.ring import ring_attention, ring_bytes
from strategies.context_parallel.technique import ContextParallel
from strategies.testing import run_ranks
from tests.models import zoo

MODELS = ("gpt", "llama", "gpt2", "llama_gqa")


def _ring(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8 * world, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    axis = Axis.of_group("cp", dist.group.WORLD, CommStats())
    mine = [layout.shard(t.detach(), 2, rank, world).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, axis)
    sent_forward = axis.stats.total(Op.SEND, "cp").bytes_sent
    out.backward(layout.shard(grad, 2, rank, world))
    errors = [(out - layout.shard(ref, 2, rank, world)).abs().max().item()]
    errors += [(t.grad - layout.shard(r.grad, 2, rank, world)).abs().max().item() for t, r in zip(mine, (q, k, v))]
    sent = (sent_forward, axis.stats.total(Op.SEND, "cp").bytes_sent - sent_forward)
    # Laid out as SDPA's output is, so that the usual merge of the heads is a view (no second copy kept for backward)
    merged = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
    return {"errors": errors, "sent": sent, "formula": ring_bytes(tuple(mine[0].shape), torch.float64, world),
            "merged_is_view": merged.data_ptr() == out.data_ptr() and merged._base is not None}


def _grouped(rank: int, world: int) -> dict:
    """Grouped keys and values (6 query heads over 2 k/v heads, SDPA's ``enable_gqa``): they travel grouped, so the
    ring sends a third of what repeated ones would, and their gradients come back summed over each group."""
    torch.manual_seed(0)
    q = torch.randn(2, 6, 8 * world, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 8 * world, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    axis = Axis.of_group("cp", dist.group.WORLD, CommStats())
    mine = [layout.shard(t.detach(), 2, rank, world).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, axis)
    out.backward(layout.shard(grad, 2, rank, world))
    errors = [(out - layout.shard(ref, 2, rank, world)).abs().max().item()]
    errors += [(t.grad - layout.shard(r.grad, 2, rank, world)).abs().max().item() for t, r in zip(mine, (q, k, v))]
    sent = axis.stats.total(Op.SEND, "cp").bytes_sent
    return {"errors": errors, "sent": sent, "formula": sum(ring_bytes(tuple(mine[1].shape), torch.float64, world))}


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "gpt":
        from demos.gpt import GPT, GPTConfig

        model = GPT(GPTConfig(vocab_size=zoo.VOCAB, seq_len=32, n_layer=2, n_head=4, n_embd=32, dropout=0.0))
        return model, lambda m, batch: F.cross_entropy(m(batch[0]).flatten(0, 1), batch[1].flatten())
    return getattr(zoo, kind)(), lambda m, batch: m.loss(batch[0])  # labels=ids: shifted inside the model


def _equal(rank: int, world: int, kind: str) -> dict:
    model, loss_of = _model(kind)
    ids = torch.randint(0, zoo.VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    ref = loss_of(model, batch)
    ref.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    cp = ContextParallel(model, Axis.of_group("cp", dist.group.WORLD, CommStats()))
    loss = loss_of(model, cp.shard(batch))
    loss.backward()
    cp.teardown(True)
    dist.all_reduce(loss := loss.detach().clone())  # the mean over cp is the batch's loss
    grads = {}
    for n, p in model.named_parameters():  # averaged over cp as over dp
        dist.all_reduce(p.grad)
        grads[n] = ((p.grad / world - expected[n]).abs().max() / expected[n].abs().max()).item()
    return {"loss": abs(loss.item() / world - ref.item()) / ref.item(), "grad": max(grads.values()),
            "sources": cp.positions.sources}


def _all(rank: int, world: int, kinds: tuple[str, ...]) -> dict:
    return {"ring": _ring(rank, world), "grouped": _grouped(rank, world),
            **{kind: _equal(rank, world, kind) for kind in kinds}}


def test_ring_attention_and_models_equal_one_process_at_cp2_and_cp4():
    for world, kinds in ((2, MODELS), (4, ("gpt", "llama"))):
        for rank, got in enumerate(run_ranks(_all, world, kinds, timeout_s=240)):
            assert max(got["ring"]["errors"]) < 1e-12, (world, rank, got["ring"])
            assert got["ring"]["sent"] == got["ring"]["formula"], (world, rank, got["ring"])
            assert got["ring"]["merged_is_view"], "attention's output merges its heads by a copy"
            assert max(got["grouped"]["errors"]) < 1e-12 and got["grouped"]["sent"] == got["grouped"]["formula"], \
                (world, rank, got["grouped"])
            for kind in kinds:
                assert got[kind]["loss"] < 1e-6 and got[kind]["grad"] < 1e-5, (world, rank, kind, got[kind])
        assert got["llama"]["sources"] == ["model.model.rotary_emb"] and got["gpt"]["sources"] == ["pos_emb"]
