"""Tensor parallel's state in the single-process layout: split weights (and their optimizer state) gathered back
over the tp axis, and a full state cut into this rank's slices, the way `plans.apply_plan` split the layers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from strategies import comm
from strategies.comm import Axis
from strategies.tensor_parallel.layers import VocabParallelEmbedding, column_rows
from strategies.tensor_parallel.plans import Colwise, Rowwise, Style, split_styles


def unsplit_state(state: dict[str, torch.Tensor], styles: dict[str, Style], axis: Axis) -> dict[str, torch.Tensor]:
    """``state`` with every split parameter (``styles``: name -> style) all-gathered over ``axis`` into the full
    layout (every rank must call this)."""
    state = dict(state)
    for key, style in styles.items():
        if key in state:
            state[key] = _unsplit(state[key], style, axis, dim=1 if isinstance(style, Rowwise) else 0)
    return state


def full_state_dict(module: nn.Module, found: dict[str, Style], axis: Axis) -> dict[str, torch.Tensor]:
    """The single-device state dict of ``module``, whose layers ``found`` are split (every rank must call this)."""
    return unsplit_state({k: v.detach() for k, v in module.state_dict().items()}, split_styles(module, found), axis)


def split_state(state: dict[str, torch.Tensor], styles: dict[str, Style], axis: Axis) -> dict[str, torch.Tensor]:
    """The inverse of `unsplit_state`: this rank's slice of every split parameter."""
    return {k: split_like(v, styles[k], axis) if k in styles else v for k, v in state.items()}


def _unsplit(local: torch.Tensor, style: Style, axis: Axis, dim: int) -> torch.Tensor:
    pieces = torch.empty((axis.size, *local.shape), dtype=local.dtype, device=local.device)
    comm.all_gather(pieces.view(-1), local.contiguous().view(-1), axis)
    if isinstance(style, Colwise) and style.chunks > 1:
        full_rows = local.shape[0] * axis.size
        full = torch.empty((full_rows, *local.shape[1:]), dtype=local.dtype, device=local.device)
        for rank in range(axis.size):
            full[column_rows(full_rows, style.chunks, Axis(axis.name, None, axis.ranks, rank))] = pieces[rank]
        return full
    return torch.cat(list(pieces.unbind(0)), dim=dim)


def split_like(full: torch.Tensor, style: Style, axis: Axis) -> torch.Tensor:
    """This rank's slice of a full-shaped tensor (a weight, or its optimizer state), as the layers split."""
    if isinstance(style, Rowwise):
        return full.chunk(axis.size, dim=1)[axis.index].clone() if full.dim() > 1 else full.clone()
    if isinstance(style, Colwise):
        return full[column_rows(full.shape[0], style.chunks, axis)].clone()
    return full.chunk(axis.size, dim=0)[axis.index].clone()



def unsplit_optimizer_state(per_param: dict[str, dict[str, Any]], order: list[str], styles: dict[str, Style],
                            shapes: dict[str, torch.Size], axis: Axis) -> dict[str, dict[str, Any]]:
    """Per-parameter optimizer states with every split parameter's tensors gathered to the full shape, in the
    optimizer's parameter ``order`` (every tp rank must call it, with the same entries)."""
    out = {}
    for name in sorted(per_param, key={n: k for k, n in enumerate(order)}.__getitem__):
        entry = dict(per_param[name])
        if name in styles:
            style = styles[name]
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.shape == shapes[name]:
                    entry[key] = _unsplit(value, style, axis, 1 if isinstance(style, Rowwise) else 0)
        out[name] = entry
    return out


def split_optimizer_state(per_param: dict[str, dict[str, Any]], styles: dict[str, Style],
                          axis: Axis) -> dict[str, dict[str, Any]]:
    """The inverse: this rank's slice of every split parameter's full-shaped state tensors."""
    out = {}
    for name, entry in per_param.items():
        entry = dict(entry)
        if name in styles:
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and key != "step":
                    entry[key] = split_like(value, styles[name], axis)
        out[name] = entry
    return out


def restore_full_layers(module: nn.Module, found: dict[str, Style], axis: Axis) -> None:
    """Undo `apply_plan`: put plain single-device layers with the gathered weights back (every rank must
    call it). After training, the user gets back the module they wrote."""
    state = full_state_dict(module, found, axis)
    for name in found:
        layer = module.get_submodule(name)
        weight = state[f"{name}.weight"]
        if isinstance(layer, VocabParallelEmbedding):
            full = nn.Embedding(weight.shape[0], weight.shape[1], device=weight.device, dtype=weight.dtype)
        else:
            bias = f"{name}.bias" in state
            full = nn.Linear(weight.shape[1], weight.shape[0], bias=bias, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            full.weight.copy_(weight)
            if getattr(full, "bias", None) is not None:
                full.bias.copy_(state[f"{name}.bias"])
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, full)
