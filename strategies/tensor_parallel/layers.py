"""Megatron tensor parallel layers over one mesh axis, built by splitting a full, initialised layer.

Each layer is made *from* the single-device layer (``ColumnParallelLinear.from_linear(linear, axis)``), so
every rank holds exactly its slice of the weights the single process would have, and the equivalence with
one process holds from the first step. The two conjugate operators that carry all the communication:

    f = `copy_to_tp`:     identity forward, all-reduce of the gradient backward;
    g = `reduce_from_tp`: all-reduce forward, identity backward.

An MLP ``Y = GeLU(X A) B`` is then ``g(GeLU(f(X) A_i) B_i)``: A split by columns, B by rows, one
all-reduce forward and one backward per pair (Megatron-LM, Shoeybi et al. 2019, section 3).

Sequence parallel (Korthikanti et al. 2022) keeps the activations *between* the pairs (norms, dropout,
residuals) split along the sequence, 1/p per rank, and replaces each all-reduce by its two halves:

    f becomes `gather_sequence`:  all-gather along the sequence forward, reduce-scatter backward;
    g becomes `scatter_sequence`: reduce-scatter along the sequence forward, all-gather backward.

The same bytes move (an all-reduce is a reduce-scatter plus an all-gather), but no rank holds the full
sequence's activations outside the split layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strategies import comm
from strategies.comm import Axis
from strategies.tensor_parallel.overlap import PROBE, gather_project, project, project_scatter


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce (sum) of the input gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, ctx.axis)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out, axis)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis) -> torch.Tensor:
        ctx.axis = axis
        shards = torch.empty((axis.size, *x.shape), dtype=x.dtype, device=x.device)
        comm.all_gather(shards.view(-1), x.contiguous().view(-1), axis)
        return torch.cat(list(shards.unbind(0)), dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _own(grad.chunk(ctx.axis.size, dim=-1)[ctx.axis.index]), None


def _gather_dim(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (axis order): one all-gather of the dim moved first."""
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((axis.size * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out.view(-1), moved.view(-1), axis)
    return out.movedim(0, dim)


def _reduce_scatter_dim(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's 1/p slice along ``dim``: one reduce-scatter."""
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // axis.size, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out.view(-1), moved.view(-1), axis)
    return out.movedim(0, dim)


def _split_dim(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    return _own(x.chunk(axis.size, dim=dim)[axis.index])


def _own(piece: torch.Tensor) -> torch.Tensor:
    """``piece`` in storage of its own: ``contiguous`` returns a piece that is contiguous already (a sequence's slice of
    one sample, say) as a view, which would hold the whole tensor's storage for as long as autograd keeps the piece
    (each microbatch's whole embedding output, under sp with one sample per microbatch: 8 GiB at 405B, rank 0)."""
    return piece.clone(memory_format=torch.contiguous_format)


class _Conjugate(torch.autograd.Function):
    """``forward_op`` along ``dim`` forward, its conjugate ``backward_op`` on the gradient backward. The four
    sequence-parallel operators are pairs of `_gather_dim`, `_reduce_scatter_dim` and `_split_dim`:

        gather_sequence (f):      all-gather      /  reduce-scatter
        scatter_sequence (g):     reduce-scatter  /  all-gather
        enter_sequence_parallel:  keep my slice   /  all-gather (every replica then holds the full gradient)
        leave_sequence_parallel:  all-gather      /  keep my slice (replicated layers follow, so the gradient
                                                     that comes back is the same on every rank)
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis, dim: int, forward_op, backward_op) -> torch.Tensor:
        ctx.axis, ctx.dim, ctx.backward_op = axis, dim, backward_op
        return forward_op(x, axis, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.backward_op(grad, ctx.axis, ctx.dim), None, None, None, None


def _check_sequence(x: torch.Tensor, axis: Axis, dim: int) -> None:
    if x.shape[dim] % axis.size:
        raise ValueError(
            f"sequence parallel splits the sequence (dim {dim}, length {x.shape[dim]}) over tp = {axis.size} "
            "ranks, and it does not divide; use a sequence length that divides by tp, or drop 'sp'"
        )


def gather_sequence(x: torch.Tensor, axis: Axis, dim: int = 1) -> torch.Tensor:
    if x.dim() < 3 and axis.size > 1:
        raise ValueError(f"sequence parallel gathers hidden states shaped (batch, sequence, features), but a split "
                         f"layer got shape {tuple(x.shape)}: this model reshapes its hidden states before its split "
                         "layers. Drop 'sp' for this model.")
    return x if axis.size == 1 else _Conjugate.apply(x, axis, dim, _gather_dim, _reduce_scatter_dim)


def scatter_sequence(x: torch.Tensor, axis: Axis, dim: int = 1) -> torch.Tensor:
    if axis.size > 1:
        _check_sequence(x, axis, dim)
    return x if axis.size == 1 else _Conjugate.apply(x, axis, dim, _reduce_scatter_dim, _gather_dim)


def enter_sequence_parallel(x: torch.Tensor, axis: Axis, dim: int = 1) -> torch.Tensor:
    if axis.size > 1:
        _check_sequence(x, axis, dim)
    return x if axis.size == 1 else _Conjugate.apply(x, axis, dim, _split_dim, _gather_dim)


def leave_sequence_parallel(x: torch.Tensor, axis: Axis, dim: int = 1) -> torch.Tensor:
    return x if axis.size == 1 else _Conjugate.apply(x, axis, dim, _gather_dim, _split_dim)


def copy_to_tp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _CopyToTP.apply(x, axis)


def reduce_from_tp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _ReduceFromTP.apply(x, axis)


def gather_from_tp(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    return x if axis.size == 1 else _GatherFromTP.apply(x, axis)


def _check_divides(what: str, size: int, axis: Axis) -> None:
    if size % axis.size:
        raise ValueError(f"{what} = {size} does not divide by tp = {axis.size}; choose a tp that divides it")


def linear_parts(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """``(weight, bias, transposed)`` of a layer computing ``x A + b``: an ``nn.Linear`` (weight ``(out, in)``) or a
    GPT-2 style ``Conv1D`` (Hugging Face ``transformers``: the same map with the weight stored ``(in, out)``)."""
    if isinstance(layer, nn.Linear):
        return layer.weight, layer.bias, False
    if is_conv1d(layer):
        return layer.weight, layer.bias, True
    raise TypeError(f"a tensor-parallel split needs an nn.Linear or a transformers Conv1D, found "
                    f"{type(layer).__name__}")


def is_conv1d(layer: nn.Module) -> bool:
    """A ``transformers`` ``Conv1D`` (or a copy of it, as nanoGPT ports have): a linear map with weight ``(nx, nf)``."""
    weight = getattr(layer, "weight", None)
    return (type(layer).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and tuple(weight.shape) == (getattr(layer, "nx", None), getattr(layer, "nf", None)))


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split along its columns, A = [A_1, ..., A_p]: rank i computes Y_i = X A_i + b_i.

    Identity forward / all-reduce backward on X (f). ``gather_output`` all-gathers the Y_i into Y. With
    ``sequence_parallel`` X arrives split along the sequence (dim 1) and f is `gather_sequence`; with
    ``sequence_parallel = "gathered"`` the module above did that for all its layers, and X is used as it comes.
    ``chunks`` > 1 (or a tuple of block sizes) splits each column block separately: a fused [q | k | v]
    projection keeps a [q_i | k_i | v_i] layout on each rank, so every rank holds whole heads.
    ``transposed``: the weight is kept as the user's layer stored it, ``(in, out)`` for a ``Conv1D``, so that its
    state keeps the single-process layout. With ``sequence_parallel = "async"`` the gather runs by pieces beside the
    matmul (`overlap`); a module that gathers for its layers that way leaves each its output in ``ready``.
    """

    autocast_casts = ("weight", "bias")  # (`mixed_precision.ParamDtype`: both reach the matmul)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, axis: Axis, gather_output: bool = False,
                 transposed: bool = False):
        super().__init__()
        self.axis, self.gather_output, self.transposed = axis, gather_output, transposed
        self.sequence_parallel: bool | str = False
        self.ready: tuple[torch.Tensor, torch.Tensor] | None = None  # (gathered input, this layer's output on it)
        self.blocks = (weight.shape[1 if transposed else 0] * axis.size,)  # full sizes of the column blocks
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Module, axis: Axis, gather_output: bool = False,
                    chunks: int | tuple[int, ...] = 1):
        weight, bias, transposed = linear_parts(linear)
        out_dim = 1 if transposed else 0
        blocks = column_blocks(weight.shape[out_dim], chunks, axis)
        rows = block_rows(blocks, axis, weight.device)  # (a checkpoint's lazy weight: on the CPU)
        weight = weight.detach().index_select(out_dim, rows).clone()
        bias = bias.detach()[rows].clone() if bias is not None else None
        layer = cls(weight, bias, axis, gather_output, transposed)
        layer.blocks = blocks
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x is PROBE:  # (`overlap.gather_project`: the weights this call computes with, after the hooks)
            return self.weight, self.bias
        ready, self.ready = self.ready, None
        if ready is not None and ready[0] is x:  # computed beside the module's gather (async)
            y = ready[1]
        elif self.sequence_parallel == "async" and self.axis.size > 1:
            y = gather_project(x, [self], self.axis)[1]
        else:
            if self.sequence_parallel == "gathered":  # the module above gathered the sequence (`SequenceParallel`)
                pass
            elif self.sequence_parallel:
                x = gather_sequence(x, self.axis)
            else:
                x = copy_to_tp(x, self.axis)
            y = project(x, self.weight, self.bias, self.transposed)
        return gather_from_tp(y, self.axis) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split along its rows, A = [A_1; ...; A_p] and X = [X_1, ..., X_p] split along its
    columns: rank i computes X_i A_i; the partial sums are all-reduced forward (g), identity backward; the
    bias is added once, after the sum. With ``sequence_parallel`` g is `scatter_sequence`: each rank gets
    the summed output for its 1/p of the sequence (and the bias's gradient is then a partial sum).
    ``transposed`` as for `ColumnParallelLinear`. With ``sequence_parallel = "async"`` the reduce-scatter runs by
    pieces beside the matmul (`overlap`)."""

    autocast_casts = ("weight",)  # (`mixed_precision.ParamDtype`: the bias is added after the reduction)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, axis: Axis, transposed: bool = False):
        super().__init__()
        self.axis, self.transposed = axis, transposed
        self.sequence_parallel: bool | str = False
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Module, axis: Axis):
        weight, bias, transposed = linear_parts(linear)
        in_dim = 0 if transposed else 1
        _check_divides("input features", weight.shape[in_dim], axis)
        cols = weight.detach().chunk(axis.size, dim=in_dim)[axis.index].clone()
        return cls(cols, bias.detach().clone() if bias is not None else None, axis, transposed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel == "async" and self.axis.size > 1:
            y = project_scatter(x, self.weight, self.axis, self.transposed)
        else:
            y = project(x, self.weight, None, self.transposed)
            y = scatter_sequence(y, self.axis) if self.sequence_parallel else reduce_from_tp(y, self.axis)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split into p contiguous ranges: rank i looks up the ids in its range
    (zeros elsewhere) and the partial results are all-reduced forward (g)."""

    embeds = True  # (`mixed_precision.ParamDtype` casts its output)

    def __init__(self, weight: torch.Tensor, start: int, axis: Axis, padding_idx: int | None = None):
        super().__init__()
        self.axis, self.start = axis, start
        self.weight = nn.Parameter(weight)
        # The padding row gets no gradient, as in nn.Embedding: kept where it falls in this rank's range.
        inside = padding_idx is not None and start <= padding_idx < start + weight.shape[0]
        self.local_padding_idx = padding_idx - start if inside else None

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, axis: Axis):
        _check_divides("vocabulary size", embedding.num_embeddings, axis)
        part = embedding.num_embeddings // axis.size
        weight = embedding.weight.detach()[axis.index * part : (axis.index + 1) * part].clone()
        return cls(weight, axis.index * part, axis, embedding.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.axis)


def column_blocks(out: int, chunks: int | tuple[int, ...], axis: Axis) -> tuple[int, ...]:
    """The sizes of the column blocks a fused projection of ``out`` features is made of (``chunks`` equal ones, or
    the sizes given), each checked to split over ``axis``."""
    blocks = (out // chunks,) * chunks if isinstance(chunks, int) else tuple(chunks)
    if sum(blocks) != out or (isinstance(chunks, int) and out % chunks):
        raise ValueError(f"output features = {out} do not split into the blocks {chunks}")
    for size in blocks:
        _check_divides("output features per block", size, axis)
    return blocks


def block_rows(blocks: tuple[int, ...], axis: Axis, device: torch.device | str | None = None) -> torch.Tensor:
    """Indices, along the split dimension, that rank ``axis.index`` keeps: its 1/p slice of each block. On
    ``device``: the tensor they index (CUDA's index_select and index_copy_ refuse an index on the CPU)."""
    out, start = [], 0
    for size in blocks:
        part = size // axis.size
        out.append(torch.arange(start + axis.index * part, start + (axis.index + 1) * part, device=device))
        start += size
    return torch.cat(out)


def column_rows(out: int, chunks: int | tuple[int, ...], axis: Axis) -> torch.Tensor:
    """Rows of the full weight that rank ``axis.index`` keeps: its slice of each of ``chunks`` blocks."""
    return block_rows(column_blocks(out, chunks, axis), axis)
