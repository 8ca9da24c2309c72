"""Async tensor parallel (the plan's ``async``, with ``sp``): sequence parallel's all-gathers and reduce-scatters cut
into pieces along the sequence, each in flight while the matmul of the piece before computes (torchtitan's async TP,
Megatron / Transformer Engine's ``tp_comm_overlap`` with split collectives).

Under sequence parallel a rank holds 1/t of the sequence, ``(b, s/t, h)``. Cut that into k pieces of m = s/(tk) rows;
piece c of every rank, all-gathered, is the ``(t, b, m, h)`` block of rows ``{r s/t + c m + j}`` of the whole
sequence, and a matmul on it gives those rows of the output. So:

    column layers, forward:   piece c+1's all-gather issued, piece c's products with every column layer of the module
                              (q, k and v share one gather) computed while it travels;
    column layers, backward:  the input's gradient by piece, each piece's reduce-scatter in flight beside the next
                              piece's products and then the weights' gradients;
    row layers, forward:      piece c's partial sums (rows of every rank's piece c) computed, their reduce-scatter
                              issued, piece c+1's computed while it travels;
    row layers, backward:     the output's gradient all-gathered by piece, each piece's input gradient computed as the
                              next arrives.

What stays exposed is one piece's collective (the first gather, the last reduce-scatter) where a piece's matmul takes
longer than its collective (NCCL runs collectives on a stream of their own; gloo on threads of its own). The bytes are
those of the whole collectives, in k calls. The products are the unsplit layers' row by row, so the values agree with
them to the rounding of a matmul cut into row blocks (tests state the tolerance). Under autocast each weight is cast
once per step (`mixed_precision.shared_cast`), as autocast's cache would; the gathered input is saved once, in the
matmuls' dtype, for every column layer of the module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from strategies import comm
from strategies.comm import Axis
from strategies.mixed_precision import shared_cast
from strategies.sizes import pieces
from strategies.tensors import autocast_dtype

PROBE = object()  # a column layer called with it returns the (weight, bias) its forward would compute with
_AT: list[tuple[int, int] | None] = [None]  # (piece, layer of the call) whose matmul runs now: `piece_at`


def piece_at() -> tuple[int, int] | None:
    """Which piece and which of the call's layers the matmul running now computes, or None outside async TP's
    pieces: selective recompute (`activation_checkpoint`) decides once per layer, at its first piece, so that it
    keeps the layers it keeps without async."""
    return _AT[0]


@contextlib.contextmanager
def _piece(c: int, i: int) -> Iterator[None]:
    _AT[0] = (c, i)
    try:
        yield
    finally:
        _AT[0] = None


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """``x A + b`` for a weight stored ``(out, in)`` (``nn.Linear``) or ``(in, out)`` (``transposed``: a Conv1D)."""
    return F.linear(x, weight.t() if transposed else weight, bias)


def _input_grad(g: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    return g @ (weight.t() if transposed else weight)


def _weight_grad(x2d: torch.Tensor, g2d: torch.Tensor, transposed: bool) -> torch.Tensor:
    return x2d.t() @ g2d if transposed else g2d.t() @ x2d


def _check(x: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"async tensor parallel cuts hidden states shaped (batch, sequence, features) along the "
                         f"sequence, but a split layer got shape {tuple(x.shape)}; drop 'async' for this model")


def _cast(params: list[tuple[torch.Tensor, torch.Tensor | None]], dtype: torch.dtype | None) -> list:
    """Each (weight, bias) in autocast's ``dtype`` where autocast is on, cast once a step; flat."""
    out: list[torch.Tensor | None] = []
    for weight, bias in params:
        out += [t if t is None or dtype is None or t.dtype == dtype else shared_cast(t, dtype) for t in (weight, bias)]
    return out


def gather_project(x: torch.Tensor, layers: list[Any], axis: Axis) -> tuple[torch.Tensor, ...]:
    """``x`` (this rank's piece of the sequence) gathered whole, and each column layer's output on it, computed piece
    by piece beside the gathers: ``(gathered, y_1, ..., y_n)``. Each layer is asked for the weights its own forward
    would use (`PROBE`: its hooks run, so a half copy another technique swaps in is the one used)."""
    _check(x)
    flat = _cast([layer(PROBE) for layer in layers], autocast_dtype(x))
    transposed = tuple(bool(layer.transposed) for layer in layers)
    return _GatherProject.apply(x, axis, pieces(x.shape[1], axis.size), transposed, *flat)


def project_scatter(x: torch.Tensor, weight: torch.Tensor, axis: Axis, transposed: bool) -> torch.Tensor:
    """A row layer's ``x A`` summed over the tp ranks, this rank keeping its 1/t of the sequence: by pieces, each
    piece's reduce-scatter in flight beside the next piece's matmul."""
    _check(x)
    if x.shape[1] % axis.size:
        raise ValueError(f"sequence parallel splits the sequence (dim 1, length {x.shape[1]}) over tp = {axis.size} "
                         "ranks, and it does not divide; use a sequence length that divides by tp, or drop 'sp'")
    dtype = autocast_dtype(x)
    if dtype is not None:
        x = x.to(dtype)
        weight = weight if weight.dtype == dtype else shared_cast(weight, dtype)
    return _ProjectScatter.apply(x, weight, axis, pieces(x.shape[1] // axis.size, axis.size), transposed)


def _gather_piece(x: torch.Tensor, c: int, m: int, axis: Axis) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """Every rank's rows ``[c m, (c+1) m)`` of ``x`` (``(b, local, h)``) into a ``(t, b, m, h)`` buffer, in flight;
    the piece sent is returned too, to be held until the gather is waited for."""
    piece = x[:, c * m:(c + 1) * m].contiguous()
    buf = torch.empty((axis.size, *piece.shape), dtype=x.dtype, device=x.device)
    return buf, comm.all_gather(buf.view(-1), piece.view(-1), axis, async_op=True), piece


def _gathered(x: torch.Tensor, k: int, m: int, axis: Axis) -> Iterator[torch.Tensor]:
    """The k pieces of ``x`` gathered (`_gather_piece`), in order: the next one in flight while the caller uses this
    one."""
    ahead = _gather_piece(x, 0, m, axis)
    for c in range(k):
        buf, handle, _ = ahead  # (the piece sent held until its gather is waited for)
        if c + 1 < k:
            ahead = _gather_piece(x, c + 1, m, axis)
        handle.wait()
        yield buf


def _scatter_piece(part: torch.Tensor, axis: Axis, held: list) -> torch.Tensor:
    """``part`` (``(t, b, m, h)``) summed over the ranks, this rank's ``(b, m, h)`` kept, in flight; the piece before,
    which has had this one's products to travel, waited for. ``held``: the one in flight (the last: `_drain`)."""
    shard = torch.empty(part.shape[1:], dtype=part.dtype, device=part.device)
    handle = comm.reduce_scatter(shard.view(-1), part.view(-1), axis, async_op=True)
    if held:
        held.pop()[1].wait()
    held.append((part, handle))
    return shard


def _drain(held: list) -> None:
    if held:
        held.pop()[1].wait()


class _GatherProject(torch.autograd.Function):
    """The column layers' all-gather by pieces, their matmuls beside it (`gather_project`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis, k: int, transposed: tuple[bool, ...],
                *params: torch.Tensor | None):
        ctx.set_materialize_grads(False)
        weights, biases = params[0::2], params[1::2]
        (b, local, h), t, m = x.shape, axis.size, x.shape[1] // k
        dtype = weights[0].dtype
        # (made whole and written through views: outputs that are not views, so that a forward may change them in
        # place, as it may change F.linear's)
        whole = torch.empty((b, t * local, h), dtype=x.dtype, device=x.device)
        full = whole.view(b, t, k, m, h)
        made = [torch.empty((b, t * local, w.shape[1] if tr else w.shape[0]), dtype=dtype, device=x.device)
                for w, tr in zip(weights, transposed)]
        outs = [y.view(b, t, k, m, -1) for y in made]
        for c, buf in enumerate(_gathered(x, k, m, axis)):  # the next piece travels while this one is multiplied
            full[:, :, c] = buf.transpose(0, 1)
            a = buf.to(dtype)
            for i, (w, bias, out, tr) in enumerate(zip(weights, biases, outs, transposed)):
                with _piece(c, i):
                    out[:, :, c] = project(a, w, bias, tr).transpose(0, 1)
        ctx.save_for_backward(whole if whole.dtype == dtype else whole.to(dtype), *params)
        ctx.axis, ctx.k, ctx.transposed, ctx.x_dtype = axis, k, transposed, x.dtype
        return (whole, *made)

    @staticmethod
    def backward(ctx: Any, g_full: torch.Tensor | None, *g_outs: torch.Tensor | None):
        saved, *params = ctx.saved_tensors
        weights, biases = params[0::2], params[1::2]
        axis, k, transposed = ctx.axis, ctx.k, ctx.transposed
        (b, s, h), t = saved.shape, axis.size
        m = s // t // k
        pieces5 = [g.reshape(b, t, k, m, -1) if g is not None else None for g in (g_full, *g_outs)]
        shards, held = [], []
        for c in range(k):  # the input's gradient, piece by piece, each reduce-scattered while the next is made
            # (a copy: the incoming gradient's piece is a view where b = 1 and k = 1, which the sums below change)
            acc = pieces5[0][:, :, c].transpose(0, 1).clone(memory_format=torch.contiguous_format) \
                if pieces5[0] is not None else None
            for g, w, tr in zip(pieces5[1:], weights, transposed):
                if g is not None:  # (a product is a tensor of its own: summed into in place)
                    part = _input_grad(g[:, :, c].transpose(0, 1), w, tr)
                    acc = part.to(ctx.x_dtype) if acc is None else acc.add_(part)
            if acc is None:  # (no gradient came back at all)
                acc = torch.zeros((t, b, m, h), dtype=ctx.x_dtype, device=saved.device)
            shards.append(_scatter_piece(acc, axis, held))
        grads: list[torch.Tensor | None] = []  # the weights' gradients, while the last pieces travel
        x2d = saved.reshape(-1, h)
        for i, (g, bias, tr) in enumerate(zip(g_outs, biases, transposed)):
            need_w, need_b = ctx.needs_input_grad[4 + 2 * i], ctx.needs_input_grad[5 + 2 * i]
            g2d = g.reshape(-1, g.shape[-1]) if g is not None else None
            grads.append(_weight_grad(x2d, g2d, tr) if g2d is not None and need_w else None)
            grads.append(g2d.sum(0) if g2d is not None and bias is not None and need_b else None)
        _drain(held)
        return (torch.cat(shards, dim=1), None, None, None, *grads)


class _ProjectScatter(torch.autograd.Function):
    """A row layer's matmul by pieces, each piece's reduce-scatter beside the next (`project_scatter`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, axis: Axis, k: int, transposed: bool):
        x = x.contiguous()
        (b, s, n), t = x.shape, axis.size
        m = s // t // k
        x5 = x.view(b, t, k, m, n)
        shards, held = [], []
        for c in range(k):
            with _piece(c, 0):  # (t, b, m, out): partial sums
                part = project(x5[:, :, c].transpose(0, 1), weight, None, transposed)
            shards.append(_scatter_piece(part, axis, held))
        _drain(held)
        ctx.save_for_backward(x, weight)
        ctx.axis, ctx.k, ctx.transposed = axis, k, transposed
        return torch.cat(shards, dim=1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        axis, k, transposed = ctx.axis, ctx.k, ctx.transposed
        (b, s, n), t = x.shape, axis.size
        m = s // t // k
        dx = torch.empty((b, t, k, m, n), dtype=x.dtype, device=x.device) if ctx.needs_input_grad[0] else None
        g_full = torch.empty((b, t, k, m, g.shape[-1]), dtype=g.dtype, device=g.device)
        for c, buf in enumerate(_gathered(g, k, m, axis)):  # the input's gradient by piece, as the next arrives
            g_full[:, :, c] = buf.transpose(0, 1)
            if dx is not None:
                dx[:, :, c] = _input_grad(buf, weight, transposed).transpose(0, 1)
        dw = _weight_grad(x.reshape(-1, n), g_full.view(-1, g.shape[-1]), transposed) \
            if ctx.needs_input_grad[1] else None
        return (dx.view(b, s, n) if dx is not None else None), dw, None, None, None
