"""TP plans: which submodules of a user's model are split, and how, as data.

A plan maps module-name patterns (``fnmatch``, ``*`` matches one or more name parts) to a style, like
``torch.distributed.tensor.parallel.parallelize_module`` does. Modules no pattern names stay replicated:
every tensor-parallel rank holds them whole and, since their inputs are identical on those ranks, computes
identical gradients for them. Shipped plans cover the usual decoder layouts and are chosen by
`families.detect_plan`; a user may pass their own.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from strategies.comm import Axis
from strategies.deferred import Deferred
from strategies.tensor_parallel import heads
from strategies.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    is_conv1d,
)
from strategies.tensor_parallel.vocab import VocabParallelHead
from strategies.tensors import unmade_shapes


@dataclass(frozen=True)
class Colwise:
    """Split the output features. ``chunks``: a fused projection of that many equal blocks (3 for [q | k | v]), or
    the blocks' sizes when they differ (grouped-query [q | k | v]: ``(heads * d, kv_heads * d, kv_heads * d)``)."""

    chunks: int | tuple[int, ...] = 1


@dataclass(frozen=True)
class Rowwise:
    """Split the input features; the partial outputs are all-reduced."""


@dataclass(frozen=True)
class VocabEmbedding:
    """Split an embedding's vocabulary."""


@dataclass(frozen=True)
class VocabHead:
    """Split the output layer over the vocabulary; the logits stay split and ``F.cross_entropy`` on them is computed
    vocab-parallel (`vocab`)."""


Style = Colwise | Rowwise | VocabEmbedding | VocabHead

# Fused q|k|v and fc/proj MLP: this pack's demo GPT. More layouts, and their detection: `families`.
FUSED_QKV_PLAN: dict[str, Style] = {
    "*.attn.qkv": Colwise(chunks=3), "*.attn.proj": Rowwise(), "*.mlp.fc": Colwise(), "*.mlp.proj": Rowwise(),
}
# Separate projections: Llama, Mistral, Qwen2, Gemma.
SEPARATE_QKV_PLAN: dict[str, Style] = {
    "*.q_proj": Colwise(), "*.k_proj": Colwise(), "*.v_proj": Colwise(), "*.o_proj": Rowwise(),
    "*.gate_proj": Colwise(), "*.up_proj": Colwise(), "*.down_proj": Rowwise(),
}


def matches(plan: dict[str, Style], module: nn.Module) -> dict[str, Style]:
    """``{module name: style}`` for every submodule some pattern of ``plan`` names."""
    out = {}
    for name, _ in module.named_modules():
        for pattern, style in plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                out[name] = style
                break
    return out


class SplitLayers(dict):
    """``{module name: style}`` of the layers `apply_plan` split; ``localised``: the attention attributes it made
    count this rank's heads (`heads.localise`), for `heads.restore`; ``tied``: groups of ``(layer, parameter)`` that
    were one parameter (an output layer tied to the embedding) and still are, split."""

    localised: list
    tied: list


def apply_plan(module: nn.Module, plan: dict[str, Style], axis: Axis,
               materialise: Deferred | None = None) -> SplitLayers:
    """Replace the planned submodules with their tensor-parallel versions over ``axis``, in place, and make the
    attention above them count this rank's heads. Each parallel layer keeps the user's layer (its parameters
    emptied) to put back at the end (`state.restore_full_layers`). ``materialise``: for a model built on meta
    (`deferred.Deferred`), each layer is made whole just before its slice is cut, and freed after: when the rank
    makes it (`_later_slice`), or at once where it is tied."""
    found = SplitLayers(matches(plan, module))
    if not found:
        raise ValueError(f"the tensor-parallel plan names no module of this model: patterns {list(plan)}")
    heads.check_heads(module, found, axis)
    heads.check_attention_parameters(module, found)
    replaced = heads.prove_forwards(module, found, axis.size)  # on the whole layers, before they are split
    found.tied = tied_groups(module, found)
    tied = {layer for group in found.tied for layer, _ in group}
    for name, style in found.items():
        child = module.get_submodule(name)
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        if materialise is not None and name not in tied and materialise.unmade(child):
            layer = _later_slice(child, style, axis, name, materialise)
        else:
            if materialise is not None:
                materialise(child)
            layer = _parallel(child, style, axis, name)
            _empty(child)
        layer.user_layer = (child,)  # a tuple: kept, but neither a submodule nor in the state dict
        setattr(parent, attr, layer)
    _retie(module, found)
    found.localised = heads.localise(module, found, axis, replaced)
    return found


def _later_slice(child: nn.Module, style: Style, axis: Axis, name: str, materialise: Deferred) -> nn.Module:
    """The tp layer of a user's layer still on meta, its slice on meta too; made (the user's layer made whole, cut,
    freed) only when the rank makes it: under pp, only on the stage that keeps it. At 405B and tp8 a rank made every
    layer's slice here, 126 of 1.6 GiB, where its stage keeps 16."""
    with unmade_shapes():
        layer = _parallel(child, style, axis, name)

    def make() -> None:
        materialise.apart(child)
        materialise.fill(layer, dict(_parallel(child, style, axis, name).named_parameters(recurse=False)))
        _empty(child)

    materialise.later(layer, make)
    return layer


def _empty(child: nn.Module) -> None:
    """The user's layer keeps its parameters' names and no data (`state.restore_full_layers` fills them again)."""
    for pname, param in list(child.named_parameters(recurse=False)):
        setattr(child, pname, nn.Parameter(param.detach().new_empty(0), requires_grad=param.requires_grad))


def tied_groups(module: nn.Module, found: dict[str, Style]) -> list[list[tuple[str, str]]]:
    """The parameters of the planned layers that are one tensor under several names (a head tied to the
    embedding), as ``[(layer, parameter), ...]`` groups. Refused when a tied partner is not split the same way:
    the split would silently untie them."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for pname, param in sub.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append((name, pname))
    groups = []
    for group in owners.values():
        planned = [(n, p) for n, p in group if n in found]
        if len(group) == 1 or not planned:
            continue
        styles = {type(found.get(n)).__name__ for n, _ in group}
        if len(planned) != len(group) or styles != {"VocabEmbedding", "VocabHead"} and len(styles) > 1:
            names = ", ".join(f"{n}.{p} ({type(found[n]).__name__ if n in found else 'not split'})" for n, p in group)
            raise ValueError(f"tensor parallel: {names} are one tied parameter, and a plan must split every name of it "
                             "the same way (an embedding tied to the output layer: VocabEmbedding() with VocabHead(), "
                             "as 'vp' does) or none of them")
        groups.append(group)
    return groups


def _retie(module: nn.Module, found: SplitLayers) -> None:
    """Make each tied group one split parameter again (VocabEmbedding and VocabHead keep the same rows)."""
    for (first, fname), *others in found.tied:
        shared = getattr(module.get_submodule(first), fname)
        for name, pname in others:
            mine = getattr(module.get_submodule(name), pname)
            if mine.shape != shared.shape or layer_splits(module.get_submodule(name))[pname] != \
                    layer_splits(module.get_submodule(first))[fname]:
                raise ValueError(f"tensor parallel: {first}.{fname} and {name}.{pname} are tied but split differently")
            setattr(module.get_submodule(name), pname, shared)


def _parallel(child: nn.Module, style: Style, axis: Axis, name: str) -> nn.Module:
    if isinstance(style, VocabEmbedding):
        if not isinstance(child, nn.Embedding) or type(child).forward is not nn.Embedding.forward or child.max_norm:
            raise TypeError(f"{name}: VocabEmbedding needs a plain nn.Embedding (torch's forward, no max_norm), found "
                            f"{type(child).__name__}")
        return VocabParallelEmbedding.from_embedding(child, axis)
    if not isinstance(child, nn.Linear) and not is_conv1d(child):
        raise TypeError(f"{name}: {type(style).__name__} needs an nn.Linear (or a transformers Conv1D), found "
                        f"{type(child).__name__}")
    if isinstance(style, VocabHead):
        return VocabParallelHead.from_linear(child, axis)
    if isinstance(style, Colwise):
        return ColumnParallelLinear.from_linear(child, axis, chunks=style.chunks)
    return RowParallelLinear.from_linear(child, axis)


@dataclass(frozen=True)
class ParamSplit:
    """How one parameter of a split layer is cut: along ``dim``, each block of ``blocks`` (full sizes along that
    dim, in order) into ``tp`` equal slices, rank i keeping the i-th slice of every block."""

    dim: int
    blocks: tuple[int, ...]


def layer_splits(layer: nn.Module) -> dict[str, ParamSplit]:
    """``{parameter name: split}`` for one parallel layer (a row-parallel bias is whole on every rank)."""
    if isinstance(layer, ColumnParallelLinear):
        out = {"weight": ParamSplit(1 if layer.transposed else 0, layer.blocks)}
        return out | ({"bias": ParamSplit(0, layer.blocks)} if layer.bias is not None else {})
    if isinstance(layer, RowParallelLinear):
        dim = 0 if layer.transposed else 1
        return {"weight": ParamSplit(dim, (layer.weight.shape[dim] * layer.axis.size,))}
    if isinstance(layer, VocabParallelEmbedding):
        return {"weight": ParamSplit(0, (layer.weight.shape[0] * layer.axis.size,))}
    raise TypeError(f"not a tensor-parallel layer: {type(layer).__name__}")


def split_params(module: nn.Module, found: dict[str, Style]) -> dict[int, tuple[str, ParamSplit]]:
    """``{id(param): (name, split)}`` for the parameters the plan split (a Rowwise bias is not split)."""
    out = {}
    for name in found:
        layer = module.get_submodule(name)
        for pname, split in layer_splits(layer).items():
            out[id(getattr(layer, pname))] = (f"{name}.{pname}", split)
    return out


def param_splits(module: nn.Module, found: dict[str, Style]) -> dict[str, ParamSplit]:
    """``{parameter name: split}`` for the parameters the plan split, under every name (a tied one has two)."""
    return {f"{name}.{pname}": split for name in found
            for pname, split in layer_splits(module.get_submodule(name)).items()}
