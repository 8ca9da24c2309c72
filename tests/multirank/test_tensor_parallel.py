"""Tensor-parallel layers and the demo GPT under tp (and sequence parallel) against unsplit ones.

Layers (picotron's method): build the full layer, split it, run both on the same input and upstream
gradient, and compare outputs, input gradients and weight gradients (this rank's slice), fp32, within
relative 1e-5 / absolute 1e-6 (only the order of the sums differs).

The demo GPT: per-step losses within relative 1e-5; the final parameters, gathered back to the full layout,
within relative 1e-5 and absolute 5e-5. The absolute floor is attention's key bias, whose exact gradient is
zero (softmax ignores a constant added to every key): its float noise differs between runs and AdamW's
normalised update turns it into steps of a few 1e-6.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from demos.gpt import GPT, GPTConfig
from strategies.comm import Axis, CommStats
from strategies.data_parallel import BucketedDataParallel
from strategies.mesh import ParallelMesh
from strategies.plan import ParallelPlan
from strategies.sizes import pieces
from strategies.tensor_parallel import layers as tp_layers
from strategies.tensor_parallel import overlap
from strategies.tensor_parallel.families import detect_plan
from strategies.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_rows,
)
from strategies.tensor_parallel.plans import apply_plan, split_params
from strategies.tensor_parallel.sequence_parallel import SequenceParallel, find_region
from strategies.tensor_parallel.state import full_state_dict
from strategies.tensor_parallel.vocab import vocab_parallel_cross_entropy
from strategies.testing import run_ranks

RTOL, ATOL = 1e-5, 1e-6
B, S, H = 2, 8, 16


def _close(a, b, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _column_case(axis: Axis, chunks: int, gather: bool, sp: bool) -> None:
    full = nn.Linear(H, 2 * chunks * axis.size)
    x = torch.randn(B, S, H, requires_grad=True)
    y_ref = full(x)
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    layer = ColumnParallelLinear.from_linear(full, axis, gather_output=gather, chunks=chunks)
    layer.sequence_parallel = sp
    mine = (x.detach().chunk(axis.size, dim=1)[axis.index] if sp else x.detach()).clone().requires_grad_()
    y = layer(mine)
    rows = column_rows(full.out_features, chunks, axis)
    _close(y, y_ref if gather else y_ref[..., rows], "column output")
    y.backward(dy if gather else dy[..., rows])
    _close(mine.grad, x.grad.chunk(axis.size, dim=1)[axis.index] if sp else x.grad, "column input grad")
    _close(layer.weight.grad, full.weight.grad[rows], "column weight grad")
    _close(layer.bias.grad, full.bias.grad[rows], "column bias grad")


def _row_case(axis: Axis, sp: bool) -> None:
    full = nn.Linear(H, 6)
    x = torch.randn(B, S, H, requires_grad=True)
    y_ref = full(x)
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    layer = RowParallelLinear.from_linear(full, axis)
    layer.sequence_parallel = sp
    cols = slice(axis.index * H // axis.size, (axis.index + 1) * H // axis.size)
    mine = x.detach()[..., cols].clone().requires_grad_()
    y = layer(mine)
    seq = (lambda t: t.chunk(axis.size, dim=1)[axis.index]) if sp else (lambda t: t)
    _close(y, seq(y_ref), "row output")
    y.backward(seq(dy))
    _close(mine.grad, x.grad[..., cols], "row input grad")
    _close(layer.weight.grad, full.weight.grad[:, cols], "row weight grad")
    bias_grad = layer.bias.grad.clone()
    if sp:  # each rank's bias saw its slice of the sequence: the sum over the ranks is the full gradient
        dist.all_reduce(bias_grad)
    _close(bias_grad, full.bias.grad, "row bias grad")


def _vocab_cases(axis: Axis) -> None:
    vocab = 4 * axis.size
    emb = nn.Embedding(vocab, H)
    ids = torch.randint(0, vocab, (B, S))
    ref = emb(ids)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    layer = VocabParallelEmbedding.from_embedding(emb, axis)
    out = layer(ids)
    _close(out, ref, "embedding output")
    out.backward(dy)
    part = vocab // axis.size
    _close(layer.weight.grad, emb.weight.grad[axis.index * part : (axis.index + 1) * part], "embedding grad")

    logits = torch.randn(B, S, vocab, requires_grad=True)
    target = torch.randint(0, vocab, (B, S))
    loss_ref = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(B, S)
    dloss = torch.randn_like(loss_ref)
    loss_ref.backward(dloss)
    start = axis.index * part
    mine = logits.detach()[..., start : start + part].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, target, start, axis)
    _close(loss, loss_ref, "vocab-parallel loss")
    loss.backward(dloss)
    _close(mine.grad, logits.grad[..., start : start + part], "vocab-parallel logits grad")


def _layers_rank(rank: int, world: int):
    axis = Axis.of_group("tp", dist.group.WORLD, CommStats())
    torch.manual_seed(0)  # every rank builds the same full layers and inputs
    for chunks, gather, sp in [(1, False, False), (3, False, False), (1, True, False), (1, False, True),
                               (3, False, True)]:
        _column_case(axis, chunks, gather, sp)
    _row_case(axis, sp=False)
    _row_case(axis, sp=True)
    _vocab_cases(axis)
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_equal_the_unsplit_layers(tp: int):
    assert run_ranks(_layers_rank, tp) == [True] * tp


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operation produced (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _allocation_rank(rank: int, world: int):
    axis = Axis.of_group("tp", dist.group.WORLD, CommStats())
    vocab, part = 64 * world, 64
    torch.manual_seed(0)
    local = torch.randn(B, S, part, requires_grad=True)
    target = torch.randint(0, vocab, (B, S))
    with _LargestTensor() as ours:
        vocab_parallel_cross_entropy(local, target, rank * part, axis).sum().backward()
    full = torch.randn(B, S, vocab, requires_grad=True)
    with _LargestTensor() as unsplit:  # the check can see a full-vocabulary tensor when there is one
        F.cross_entropy(full.flatten(0, 1), target.flatten()).backward()
    return ours.largest, unsplit.largest, B * S * vocab


def test_vocab_parallel_loss_never_allocates_full_logits():
    for ours, unsplit, full_logits in run_ranks(_allocation_rank, 2):
        assert unsplit >= full_logits
        assert ours <= full_logits // 2  # at most this rank's (batch, seq, vocab / tp) slice


def _vocab_head_rank(rank: int, world: int):
    """A Hugging Face Llama whose vocabulary (1024) dwarfs its width (8), under tp with 'vp': its own loss code
    (``logits.float().view(-1, V)``, ``F.cross_entropy(..., ignore_index=-100)``) on split logits."""
    import transformers

    from strategies.tensor_parallel.families import vocab_plan

    axis = Axis.of_group("tp", dist.group.WORLD, CommStats())
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=32, tie_word_embeddings=True)
    torch.manual_seed(0)
    ref, ids = transformers.LlamaForCausalLM(config), torch.randint(0, 1024, (B, S))
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(ref.state_dict())
    ref_out = ref(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    apply_plan(model, {**vocab_plan(model, world), **detect_plan(model)}, axis)
    with _LargestTensor() as largest:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    part = 1024 // world
    grad = model.model.embed_tokens.weight.grad  # the tied weight: both uses' gradients, this rank's rows
    grad_ok = torch.allclose(grad, ref.model.embed_tokens.weight.grad[rank * part:(rank + 1) * part], atol=1e-6)
    with pytest.warns(UserWarning, match="gathered over tp"):  # needs the whole vocabulary: gathered, and right
        top = out.logits.argmax(-1)
    return (abs(out.loss.item() - ref_out.loss.item()), grad_ok, largest.largest, B * S * 1024,
            torch.equal(top, ref_out.logits.argmax(-1)), model.lm_head.weight is model.model.embed_tokens.weight)


def test_vocab_parallel_head_on_a_hugging_face_model():
    pytest.importorskip("transformers")
    for loss_diff, grad_ok, largest, full_logits, argmax_ok, tied in run_ranks(_vocab_head_rank, 2):
        assert loss_diff < 1e-5 and grad_ok and argmax_ok and tied
        assert largest <= full_logits // 2  # no rank made a (batch, seq, vocab) tensor: at most its 1/tp slice


# -- the demo GPT ------------------------------------------------------------------------------------------

CFG = dict(vocab_size=64, n_layer=2, n_head=4, n_embd=32, seq_len=16)
STEPS, BATCH = 3, 4


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG["vocab_size"], (BATCH, CFG["seq_len"] + 1), generator=g) for _ in range(STEPS)]


def _step(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _gpt_single():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for batch in _batches():
        loss = _step(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _gpt_rank(rank: int, world: int, plan_text: str):
    plan = ParallelPlan.parse(plan_text).resolve(world)
    mesh = ParallelMesh(plan, "cpu")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    found = apply_plan(model, detect_plan(model), mesh.tp)
    sp = SequenceParallel(model, found, set(split_params(model, found)), mesh.tp) if plan.sp else None
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sync = BucketedDataParallel(model, mesh.dp)
    losses = []
    for batch in _batches():
        mesh.stats.reset()  # keep the last step's traffic
        loss = _step(model, batch.chunk(plan.dp)[mesh.dp.index])
        loss.backward()
        sync.finish()
        if sp is not None:
            sp.reduce_partial_grads()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    partial = sum(p.numel() for p in sp.partial) if sp is not None else 0
    traffic = mesh.stats.snapshot()  # the last step's, before gathering the weights below
    return losses, full_state_dict(model, found, mesh.tp), traffic, partial


@pytest.fixture(scope="module")
def gpt_reference():
    return _gpt_single()


@pytest.mark.parametrize("plan,world", [("tp2", 2), ("tp4", 4), ("tp2_sp", 2), ("tp4_sp", 4), ("dp_tp2", 4),
                                        ("dp_tp2_sp", 4)])
def test_demo_gpt_matches_single_process(gpt_reference, plan: str, world: int):
    ref_losses, ref_params = gpt_reference
    results = run_ranks(_gpt_rank, world, plan)
    torch.testing.assert_close(torch.tensor([r[0] for r in results]).mean(0), torch.tensor(ref_losses),
                               rtol=RTOL, atol=ATOL)
    for _, params, _, _ in results:
        assert params.keys() == ref_params.keys()
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=5e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
    # Megatron's traffic per block per microbatch, each op over b*s*h elements of this replica's batch.
    parsed = ParallelPlan.parse(plan).resolve(world)
    tp, layers = parsed.tp, CFG["n_layer"]
    bsh_bytes = BATCH // parsed.dp * CFG["seq_len"] * CFG["n_embd"] * 4
    half = (tp - 1) / tp * bsh_bytes  # one reduce-scatter or all-gather of b*s*h
    for _, _, traffic, partial in results:
        if parsed.sp:  # all-reduces split in two: 2 gathers + 2 scatters forward and backward, + entry and exit
            assert traffic["all_gather/tp"]["bytes_sent"] == pytest.approx((4 * layers + 2) * half)
            assert traffic["reduce_scatter/tp"]["bytes_sent"] == pytest.approx(4 * layers * half)
            assert traffic["all_reduce/tp"]["bytes_sent"] == pytest.approx(2 * (tp - 1) / tp * partial * 4)
            assert partial == layers * (4 * CFG["n_embd"] + 2 * CFG["n_embd"])  # 2 norms + 2 row biases a block
        else:  # 2 all-reduces forward and 2 backward
            assert traffic["all_reduce/tp"]["bytes_sent"] == pytest.approx(4 * layers * 2 * half)
            assert "all_gather/tp" not in traffic


def test_sequence_parallel_needs_one_list_of_blocks():
    model = nn.Module()
    model.attn = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="one list of blocks"):
        find_region(model, ["attn"])
    gpt = GPT(GPTConfig(**CFG))
    assert find_region(gpt, ["blocks.0.attn.qkv", "blocks.1.mlp.fc"])[0] == "blocks"


# -- a Llama-style model (separate q/k/v/o, gated MLP, RMSNorm): the shipped separate-projection plan -------


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q.mul_(1.0)  # in place, as a model may change a projection's output (async's outputs must allow it)
        b, t = q.shape[:2]  # from the projection: under sequence parallel x holds 1/tp of the sequence
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class _Layer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.self_attn = _Attention(dim, heads)
        self.gate_proj, self.up_proj = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class _LlamaLike(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Layer(dim, heads) for _ in range(layers))
        self.norm, self.lm_head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def _llama_grads(rank: int, world: int, sp: bool | str):
    stats = CommStats()
    axis = Axis.of_group("tp", dist.group.WORLD, stats)
    torch.manual_seed(0)
    model = _LlamaLike()
    ids = torch.randint(0, 32, (2, 9))
    found = apply_plan(model, detect_plan(model), axis)
    seq = SequenceParallel(model, found, set(split_params(model, found)), axis, overlap=sp == "async") if sp else None
    calls = []  # a column or row layer's matmul made outside `overlap` (under async: a gathered output not used)
    with mock.patch.object(tp_layers, "project", lambda *a: calls.append(1) or overlap.project(*a)):
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    if seq is not None:
        seq.reduce_partial_grads()
    with torch.no_grad():  # gather the split gradients back to the full layout, as the weights are gathered
        for p in model.parameters():
            p.copy_(p.grad)
    comm = {k: (v["calls"], v["bytes_sent"]) for k, v in stats.snapshot().items()}
    return loss.item(), full_state_dict(model, found, axis), len(calls), comm


@pytest.mark.parametrize("sp", [False, True, "async"], ids=["tp2", "tp2_sp", "tp2_sp_async"])
def test_llama_style_model_gradients_match(sp: bool | str):
    """Async (`overlap`): the gradients of sp's whole collectives to float32's rounding (3.7e-9: q's, k's and v's input
    gradients summed in another order); the same bytes in four times the calls (four pieces of the 4 rows each rank
    holds); q, k and v computed beside their module's gather, none again (planted, the layers ignoring ``ready``: 6
    matmuls again)."""
    torch.manual_seed(0)
    ref = _LlamaLike()
    ids = torch.randint(0, 32, (2, 9))
    loss = F.cross_entropy(ref(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    results = run_ranks(_llama_grads, 2, sp)
    for got_loss, grads, _, _ in results:
        assert got_loss == pytest.approx(loss.item(), rel=1e-6)
        for name, p in ref.named_parameters():
            _close(grads[name], p.grad, f"grad of {name}")
    if sp == "async":
        whole = run_ranks(_llama_grads, 2, True)[0]
        _, grads, calls, comm = results[0]
        assert calls == 0
        assert max(float((grads[k] - whole[1][k]).abs().max()) for k in grads) < 1e-7  # (observed 3.7e-9)
        # each block's 5 gathers (attention's, gate's, up's; o's and down's backward) and 5 reduce-scatters in k
        # pieces (4: the 4 rows each rank holds); the region's entry and exit gather whole
        k = pieces(4, 2)
        for kind in ("all_gather/tp", "reduce_scatter/tp"):
            assert comm[kind][1] == whole[3][kind][1]
            assert comm[kind][0] == whole[3][kind][0] + 2 * 5 * (k - 1), (kind, comm[kind], whole[3][kind])
