"""Clipping by the norm of the whole model's gradient, whichever way the plan spreads it over ranks.

Each rank holds pieces of the gradient: under pipeline parallel only its stage's parameters; under tensor
parallel slices of the split weights plus whole copies of the replicated ones (identical on every tp rank);
under ZeRO only its shard of each flat. The squared norm is then: the split pieces' sum over the tp axis,
plus the replicated pieces once, and that total summed over every axis whose ranks hold disjoint pieces
(dp for ZeRO's shards, pp for the stages). Data-parallel replicas of dp/naive hold the same reduced
gradients and are not summed again. Every rank ends with the same norm and the same scale.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed import ReduceOp

from strategies import comm
from strategies.comm import Axis


def total_norm(pieces: Sequence[tuple[Tensor, Axis | None]], *, split: Sequence[Axis] = (),
               disjoint: Sequence[Axis] = (), norm_type: float = 2.0, device: torch.device | None = None) -> Tensor:
    """The norm of the whole gradient from this rank's ``pieces`` ``(tensor, the axis it is split over, or None)``;
    a collective over each of ``split`` (whose pieces are summed over it) and ``disjoint``, so every rank of those
    axes must call it."""
    device = device or (pieces[0][0].device if pieces else torch.device("cpu"))
    inf = math.isinf(norm_type)
    op = ReduceOp.MAX if inf else ReduceOp.SUM

    def local(over: Axis | None) -> Tensor:
        values = [g.detach() for g, axis in pieces if axis == over and g.numel()]
        if not values:
            return torch.zeros((), dtype=torch.float64, device=device)
        if inf:
            return torch.stack([v.abs().max().double().to(device) for v in values]).max()
        return torch.stack([v.double().pow(norm_type).sum().to(device) for v in values]).sum()

    total = local(None)  # the replicated pieces: the same on every rank of a split axis, counted once
    for axis in split:
        part = local(axis)
        comm.all_reduce(part, axis, op=op)
        total = torch.maximum(part, total) if inf else part + total
    for axis in disjoint:
        comm.all_reduce(total, axis, op=op)
    return total if inf else total.pow(1.0 / norm_type)


def clip_pieces(pieces: Sequence[tuple[Tensor, Axis | None]], max_norm: float, *, split: Sequence[Axis] = (),
                disjoint: Sequence[Axis] = (), norm_type: float = 2.0, device: torch.device | None = None,
                copies: Sequence[Tensor] = ()) -> Tensor:
    """Scale every piece in place so that the whole gradient's norm is at most ``max_norm``; returns the norm
    before clipping (torch's ``clip_grad_norm_`` formula: scale = max_norm / (norm + 1e-6), capped at 1).
    ``copies``: gradients another rank holds and counts too (a tied weight's second stage): scaled, not counted."""
    norm = total_norm(pieces, split=split, disjoint=disjoint, norm_type=norm_type, device=device)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    on: dict = {}  # the scale on each device and dtype once (offloaded pieces are in host memory, one per parameter)
    for g in [g for g, _ in pieces] + list(copies):
        key = (g.device, g.dtype)
        if key not in on:
            on[key] = scale.to(device=g.device, dtype=g.dtype)
        g.mul_(on[key])
    return norm.float()
