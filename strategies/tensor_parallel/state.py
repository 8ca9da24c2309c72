"""Tensor parallel's state in the single-process layout: split weights (and their optimizer state) gathered back
over the tp axis, and a full state cut into this rank's slices, the way `plans.apply_plan` split the layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from strategies import comm
from strategies.comm import Axis
from strategies.tensor_parallel import heads
from strategies.tensor_parallel.layers import block_rows
from strategies.tensor_parallel.plans import ParamSplit, Style, layer_splits, param_splits


def unsplit_state(state: dict[str, torch.Tensor], splits: dict[str, ParamSplit], axis: Axis) -> dict[str, torch.Tensor]:
    """``state`` with every split parameter (``splits``: name -> how it is cut) all-gathered over ``axis`` into the
    full layout (every rank must call this)."""
    state = dict(state)
    for key, split in splits.items():
        if key in state:
            state[key] = _unsplit(state[key], split, axis)
    return state


def full_state_dict(module: nn.Module, found: dict[str, Style], axis: Axis) -> dict[str, torch.Tensor]:
    """The single-device state dict of ``module``, whose layers ``found`` are split (every rank must call this)."""
    return unsplit_state({k: v.detach() for k, v in module.state_dict().items()}, param_splits(module, found), axis)


def split_state(state: dict[str, torch.Tensor], splits: dict[str, ParamSplit], axis: Axis) -> dict[str, torch.Tensor]:
    """The inverse of `unsplit_state`: this rank's slice of every split parameter."""
    return {k: split_like(v, splits[k], axis) if k in splits else v for k, v in state.items()}


def _unsplit(local: torch.Tensor, split: ParamSplit, axis: Axis) -> torch.Tensor:
    pieces = torch.empty((axis.size, *local.shape), dtype=local.dtype, device=local.device)
    comm.all_gather(pieces.view(-1), local.contiguous().view(-1), axis)
    if len(split.blocks) == 1:
        return torch.cat(list(pieces.unbind(0)), dim=split.dim)
    shape = list(local.shape)
    shape[split.dim] = sum(split.blocks)
    full = torch.empty(shape, dtype=local.dtype, device=local.device)
    for rank in range(axis.size):
        rows = block_rows(split.blocks, Axis(axis.name, None, axis.ranks, rank), full.device)
        full.index_copy_(split.dim, rows, pieces[rank])
    return full


def split_like(full: torch.Tensor, split: ParamSplit, axis: Axis) -> torch.Tensor:
    """This rank's slice of a full-shaped tensor (a weight, or its optimizer state), as the layers split."""
    return full.index_select(split.dim, block_rows(split.blocks, axis, full.device)).clone()


def unsplit_optimizer_state(per_param: dict[str, dict[str, Any]], order: list[str], splits: dict[str, ParamSplit],
                            shapes: dict[str, torch.Size], axis: Axis) -> dict[str, dict[str, Any]]:
    """Per-parameter optimizer states with every split parameter's tensors gathered to the full shape, in the
    optimizer's parameter ``order`` (every tp rank must call it, with the same entries)."""
    out = {}
    for name in sorted(per_param, key={n: k for k, n in enumerate(order)}.__getitem__):
        entry = dict(per_param[name])
        if name in splits:
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.shape == shapes[name]:
                    entry[key] = _unsplit(value, splits[name], axis)
        out[name] = entry
    return out


def split_optimizer_state(per_param: dict[str, dict[str, Any]], splits: dict[str, ParamSplit],
                          axis: Axis) -> dict[str, dict[str, Any]]:
    """The inverse: this rank's slice of every split parameter's full-shaped state tensors."""
    out = {}
    for name, entry in per_param.items():
        entry = dict(entry)
        if name in splits:
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > splits[name].dim and key != "step":
                    entry[key] = split_like(value, splits[name], axis)
        out[name] = entry
    return out


def restore_sliced_layers(module: nn.Module, found: dict[str, Style]) -> None:
    """Undo `apply_plan` without a collective, for a fit that leaves its weights in slices (`deferred.leave_in_slices`,
    a model built on meta): the user's layers back, their parameters on meta in the full shapes; the module the user
    wrote, holding nothing, which a checkpoint then refills whole (``test(ckpt_path="best")``)."""
    def on_meta(name: str, pname: str) -> torch.Tensor:
        split_layer = module.get_submodule(name)
        local, split = getattr(split_layer, pname), layer_splits(split_layer).get(pname)
        shape = list(local.shape)
        if split is not None:
            shape[split.dim] = sum(split.blocks)
        return torch.empty(shape, dtype=local.dtype, device="meta")
    _give_back(module, found, on_meta)


def restore_full_layers(module: nn.Module, found: dict[str, Style], axis: Axis) -> None:
    """Undo `apply_plan`: put the user's own layers back, holding the gathered weights, and the attention's head
    counts as they were (every rank must call it). After training, the user gets back the module they wrote."""
    state = full_state_dict(module, found, axis)
    _give_back(module, found, lambda name, pname: state[f"{name}.{pname}"].clone())


def _give_back(module: nn.Module, found: dict[str, Style], weight: Callable[[str, str], torch.Tensor]) -> None:
    """Each split layer replaced by the user's own, whose parameters get ``weight(layer name, parameter name)``; tied
    parameters one again, the attention's head counts as they were."""
    for name in found:
        (layer,) = module.get_submodule(name).user_layer
        for pname, param in list(layer.named_parameters(recurse=False)):
            setattr(layer, pname, nn.Parameter(weight(name, pname), requires_grad=param.requires_grad))
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, layer)
    for (first, fname), *others in getattr(found, "tied", []):  # tied before: one parameter again
        for name, pname in others:
            setattr(module.get_submodule(name), pname, getattr(module.get_submodule(first), fname))
    heads.restore(getattr(found, "localised", []))
