"""Ring attention: causal self-attention over a sequence that N ranks hold in load-balanced chunks (`layout`).

Each rank holds its queries, keys and values for its two chunks. Step s of N (s = 0..N-1): rank r attends its
queries to the keys and values of rank j = r - s (mod N), which arrived from its left neighbour, while it passes
them on to its right one (the next step's block is in flight during this step's compute: one `comm.exchange` group
per step, a send to the right and a receive from the left, issued in the same order on every rank, so NCCL matches
them; `comm.p2p`). Each (query chunk, key chunk) pair is attended in full when the key chunk is earlier, causally
when it is the same chunk, and skipped when later; the partial results are merged with their log-sum-exp

    lse = log(exp(lse_a) + exp(lse_b)),   out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)

so the result is softmax(QKᵀ / sqrt(d) + causal mask) V over the whole sequence, row for row. The backward runs the
same ring: each block's dK and dV accumulate while the block travels, P = exp(S - lse) recomputed from the forward's
merged lse (the flash-attention backward), dS = P (dP - rowsum(dO O)); after N steps each accumulator is back with
the rank that owns the block. Bytes per rank and call: (N-1) K/V blocks forward; (N-1) K/V blocks and N float32
dK/dV accumulators backward. Grouped keys and values (fewer k/v heads than query heads, each serving a group of
consecutive query heads, as SDPA's ``enable_gqa``) travel grouped and are repeated only where a block is attended:
the ring sends heads/kv_heads times fewer bytes than it would repeated (Llama 3's 128 over 8: 16), and each dK/dV
accumulator is summed over its group before it moves on.

The block kernel is a small portable one (matmuls and accumulators in float32, float64 for float64 inputs, and an
explicit mask), so the same code runs on CPU here and on GPU; it holds a (chunk x chunk) score matrix per head at a
time, not the sequence's square.
"""

from __future__ import annotations

import math

import torch

from strategies import comm
from strategies.comm import Axis
from strategies.context_parallel.layout import chunks_of


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: Axis,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention of ``q`` over the whole sequence whose ``k``/``v`` the ranks of ``axis`` hold. Every tensor
    is ``(batch, heads, local length, head dim)``, this rank's two chunks, ``k`` and ``v`` with as many heads as ``q``
    or a divisor of them (grouped); ``scale`` defaults to 1/sqrt(head dim)."""
    grouped = k.shape[:1] + k.shape[2:] == q.shape[:1] + q.shape[2:] and k.shape[1] and q.shape[1] % k.shape[1] == 0
    if q.dim() != 4 or v.shape != k.shape or not grouped:
        raise ValueError(f"ring attention takes q, k and v of one (batch, heads, tokens, head dim) shape, k and v with "
                         f"q's heads or a divisor of them (grouped); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[-2] % 2:
        raise ValueError(f"ring attention: the local sequence holds two equal chunks, but it has {q.shape[-2]} tokens")
    return _RingAttention.apply(q, k, v, axis, q.shape[-1] ** -0.5 if scale is None else scale)


def ring_bytes(shape: tuple[int, ...], dtype: torch.dtype, size: int) -> tuple[int, int]:
    """Bytes one rank sends in one ring attention call on local q/k/v of ``shape`` and ``dtype`` over ``size``
    ranks: forward ((size - 1) K/V blocks), backward ((size - 1) K/V blocks and ``size`` dK/dV accumulators, in
    `_acc`'s dtype). It receives as many."""
    if size == 1:
        return 0, 0
    block = 2 * math.prod(shape)  # K and V
    kv = block * dtype.itemsize
    return (size - 1) * kv, (size - 1) * kv + size * block * _acc(dtype).itemsize


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, axis: Axis, scale: float):
        n, r = axis.size, axis.index
        kv = torch.stack([k, v]).contiguous()
        out = _output_buffer(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=_acc(q.dtype), device=q.device)
        for s in range(n):
            moving = _rotate(kv, axis, f"kv{s}") if s < n - 1 else None
            keys, values = _repeat(kv, q.shape[1])  # once per step: a key half serves both query halves
            for qi, ki, causal in _pairs(r, (r - s) % n, n):
                block_out, block_lse = _attend(_half(q, qi), _half(keys, ki), _half(values, ki), scale, causal)
                _merge(_half(out, qi), _half(lse, qi), block_out, block_lse)
            if moving is not None:
                kv = _arrived(moving)
        ctx.axis, ctx.scale = axis, scale
        out = out.to(q.dtype)  # keeps the layout; saved as returned: SDPA too keeps its output in q's dtype
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        axis, scale, n, r = ctx.axis, ctx.scale, ctx.axis.size, ctx.axis.index
        dout = dout.to(_acc(q.dtype))
        delta = (dout * out.to(dout.dtype)).sum(-1)  # rowsum(dO O): softmax's backward, one number per query
        dq = torch.zeros(q.shape, dtype=_acc(q.dtype), device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=_acc(q.dtype), device=q.device)  # block (r - s)'s dK, dV so far
        for s in range(n):
            moving = _rotate(kv, axis, f"bkv{s}") if s < n - 1 else None
            keys, values = _repeat(kv, q.shape[1])
            for qi, ki, causal in _pairs(r, (r - s) % n, n):
                grads = _attend_backward(_half(q, qi), _half(keys, ki), _half(values, ki), _half(dout, qi),
                                         _half(lse, qi), _half(delta, qi), scale, causal)
                _half(dq, qi).add_(grads[0])
                _half(dkv[0], ki).add_(_group_sum(grads[1], k))
                _half(dkv[1], ki).add_(_group_sum(grads[2], k))
            if n > 1:  # the block's accumulator goes on with it; the last step's reaches the block's owner
                returning = _rotate(dkv, axis, f"dkv{s}")
            if moving is not None:
                kv = _arrived(moving)
            if n > 1:
                dkv = _arrived(returning)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _acc(dtype: torch.dtype) -> torch.dtype:
    """What a block is computed and accumulated in: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _output_buffer(q: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``q`` (batch, heads, tokens, head dim) in `_acc`'s dtype, laid out in memory as (batch,
    tokens, heads, head dim) as SDPA's output is: the model's usual ``y.transpose(1, 2).reshape(b, t, width)`` is
    then a view, not a copy that the next layer keeps for backward beside the one attention keeps."""
    b, h, t, d = q.shape
    return torch.zeros(b, t, h, d, dtype=_acc(q.dtype), device=q.device).transpose(1, 2)


def _pairs(rank: int, owner: int, size: int) -> list[tuple[int, int, bool]]:
    """(query half, key half, causal) for each pair of ``rank``'s query chunks and ``owner``'s key chunks that
    causal attention reads: a key chunk before the query chunk in full, the same chunk causally, a later one not."""
    mine, theirs = chunks_of(rank, size), chunks_of(owner, size)
    return [(qi, ki, qc == kc) for qi, qc in enumerate(mine) for ki, kc in enumerate(theirs) if kc <= qc]


def _repeat(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Stacked grouped keys and values, (2, batch, k/v heads, tokens, head dim), repeated to ``heads`` query heads
    (key head i serves query heads i·g .. i·g + g - 1)."""
    groups = heads // kv.shape[-3]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=-3)


def _group_sum(grad: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """A repeated block's gradient summed back over each group of query heads, to ``kv``'s heads."""
    b, h, t, d = grad.shape
    return grad if h == kv.shape[1] else grad.view(b, kv.shape[1], h // kv.shape[1], t, d).sum(2)


def _half(x: torch.Tensor, which: int) -> torch.Tensor:
    """The first or second chunk of ``x``'s local sequence: a view (dim -2 of a (batch, heads, tokens, head dim)
    tensor, dim -1 of a (batch, heads, tokens) one)."""
    dim = -2 if x.dim() == 4 else -1
    return x.chunk(2, dim=dim)[which]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = torch.matmul(q.to(_acc(q.dtype)), k.to(_acc(q.dtype)).transpose(-2, -1)) * scale
    if causal:
        t = s.shape[-1]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _attend(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and log-sum-exp (in `_acc`'s dtype)."""
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(s.dtype)), lse


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's output and lse into the running (out, lse), in place: a softmax over the union of their
    keys."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _attend_backward(q, k, v, dout, lse, delta, scale: float, causal: bool):
    """One block's share of dQ, dK, dV (in `_acc`'s dtype), from the whole row's lse and rowsum(dO O)."""
    p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-2, -1), dout)
    ds = p * (torch.matmul(dout, v.to(p.dtype).transpose(-2, -1)) - delta.unsqueeze(-1))
    return torch.matmul(ds, k.to(p.dtype)) * scale, torch.matmul(ds.transpose(-2, -1), q.to(p.dtype)) * scale, dv


def _rotate(x: torch.Tensor, axis: Axis, label: str) -> tuple[comm.GroupHandle, torch.Tensor]:
    """Send ``x`` to the right neighbour and receive the left one's into a new buffer, as one group (in flight)."""
    incoming = torch.empty_like(x)
    right, left = (axis.index + 1) % axis.size, (axis.index - 1) % axis.size
    handle = comm.exchange([comm.P2P(True, x, right, label), comm.P2P(False, incoming, left, label)], axis)
    return handle, incoming


def _arrived(moving: tuple[comm.GroupHandle, torch.Tensor]) -> torch.Tensor:
    handle, incoming = moving
    handle.wait()
    return incoming
