"""TP plans: which submodules of a user's model are split, and how, as data.

A plan maps module-name patterns (``fnmatch``, ``*`` matches one or more name parts) to a style, like
``torch.distributed.tensor.parallel.parallelize_module`` does. Modules no pattern names stay replicated:
every tensor-parallel rank holds them whole and, since their inputs are identical on those ranks, computes
identical gradients for them. Shipped plans cover the usual decoder layouts and are chosen by
`detect_plan`; a user may pass their own.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from strategies.comm import Axis
from strategies.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


@dataclass(frozen=True)
class Colwise:
    """Split the output features (``chunks``: a fused projection of that many equal blocks, e.g. 3 for qkv)."""

    chunks: int = 1


@dataclass(frozen=True)
class Rowwise:
    """Split the input features; the partial outputs are all-reduced."""


@dataclass(frozen=True)
class VocabEmbedding:
    """Split an embedding's vocabulary."""


Style = Colwise | Rowwise | VocabEmbedding

# Fused q|k|v and fc/proj MLP: nanoGPT, GPT-2 style and this pack's demo GPT.
FUSED_QKV_PLAN: dict[str, Style] = {
    "*.attn.qkv": Colwise(chunks=3), "*.attn.proj": Rowwise(), "*.mlp.fc": Colwise(), "*.mlp.proj": Rowwise(),
}
# Separate projections: Llama, Mistral, Qwen and most Hugging Face decoders.
SEPARATE_QKV_PLAN: dict[str, Style] = {
    "*.q_proj": Colwise(), "*.k_proj": Colwise(), "*.v_proj": Colwise(), "*.o_proj": Rowwise(),
    "*.gate_proj": Colwise(), "*.up_proj": Colwise(), "*.down_proj": Rowwise(),
}
SHIPPED_PLANS = {"fused_qkv": FUSED_QKV_PLAN, "separate_qkv": SEPARATE_QKV_PLAN}

_EXAMPLE = "{'*.attn.qkv': Colwise(chunks=3), '*.attn.proj': Rowwise(), '*.mlp.fc': Colwise(), '*.mlp.proj': Rowwise()}"


def matches(plan: dict[str, Style], module: nn.Module) -> dict[str, Style]:
    """``{module name: style}`` for every submodule some pattern of ``plan`` names."""
    out = {}
    for name, _ in module.named_modules():
        for pattern, style in plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                out[name] = style
                break
    return out


def detect_plan(module: nn.Module) -> dict[str, Style]:
    """The shipped plan that fits ``module``; a clear error listing its linear layers when none does."""
    for plan in SHIPPED_PLANS.values():
        found = matches(plan, module)
        if found and all(isinstance(module.get_submodule(n), (nn.Linear, nn.Embedding)) for n in found):
            return plan
    linears = [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    raise ValueError(
        "no tensor-parallel plan fits this model: the shipped plans look for attention projections named "
        "qkv/proj (fused) or q_proj/k_proj/v_proj/o_proj, and MLPs named fc/proj or gate_proj/up_proj/"
        f"down_proj. Linear layers found: {', '.join(linears[:12]) or 'none'}. Pass a plan, e.g. "
        f"PlanStrategy('tp2', tp_plan={_EXAMPLE}) (strategies.Colwise / Rowwise / VocabEmbedding)."
    )


def apply_plan(module: nn.Module, plan: dict[str, Style], axis: Axis) -> dict[str, Style]:
    """Replace the planned submodules with their tensor-parallel versions over ``axis``, in place."""
    found = matches(plan, module)
    if not found:
        raise ValueError(f"the tensor-parallel plan names no module of this model: patterns {list(plan)}")
    _check_heads(module, found, axis)
    for name, style in found.items():
        child = module.get_submodule(name)
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, _parallel(child, style, axis, name))
    return found


def _parallel(child: nn.Module, style: Style, axis: Axis, name: str) -> nn.Module:
    if isinstance(style, VocabEmbedding):
        if not isinstance(child, nn.Embedding):
            raise TypeError(f"{name}: VocabEmbedding needs an nn.Embedding, found {type(child).__name__}")
        return VocabParallelEmbedding.from_embedding(child, axis)
    if not isinstance(child, nn.Linear):
        raise TypeError(f"{name}: {type(style).__name__} needs an nn.Linear, found {type(child).__name__}")
    if isinstance(style, Colwise):
        return ColumnParallelLinear.from_linear(child, axis, chunks=style.chunks)
    return RowParallelLinear.from_linear(child, axis)


# How attention modules (and their configs) name their head counts: nanoGPT, Hugging Face, Llama's reference.
HEAD_ATTRIBUTES = ("n_head", "num_heads", "num_attention_heads", "num_key_value_heads", "n_kv_heads")


def _check_heads(module: nn.Module, found: dict[str, Style], axis: Axis) -> None:
    # Attention splits by whole heads: every head count a module above a split layer declares must divide by tp.
    for name, m in module.named_modules():
        if not any(n.startswith(f"{name}." if name else "") for n in found):
            continue
        for attr in HEAD_ATTRIBUTES:
            heads = getattr(m, attr, None)
            if isinstance(heads, int) and not isinstance(heads, bool) and heads % axis.size:
                where = name or type(m).__name__
                raise ValueError(f"{where}: {heads} attention heads ({attr}) do not divide by tp = {axis.size}; "
                                 f"choose a tp that divides {heads}")



def split_params(module: nn.Module, found: dict[str, Style]) -> dict[int, tuple[str, Style]]:
    """``{id(param): (name, style)}`` for the parameters the plan split (a Rowwise bias is not split)."""
    out = {}
    for name, style in found.items():
        layer = module.get_submodule(name)
        for pname, p in layer.named_parameters(recurse=False):
            if not (isinstance(style, Rowwise) and pname == "bias"):
                out[id(p)] = (f"{name}.{pname}", style)
    return out


def split_styles(module: nn.Module, found: dict[str, Style]) -> dict[str, Style]:
    """``{parameter name: style}`` for the parameters the plan split."""
    return {name: style for name, style in split_params(module, found).values()}
