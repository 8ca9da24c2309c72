"""Attention heads under tensor parallel: checked to split evenly, and counted per rank while the layers are split.

A column-parallel q/k/v projection leaves each rank whole heads, ``heads / tp`` of them. Attention code that
counts heads from the projection's width (``view(..., -1, head_dim)``: Llama, Mistral, Qwen2, GPT-2 in
``transformers`` 5) needs nothing more. Code that reads a head count or a width from the module (``num_heads``,
``split_size``, ``self.config.num_attention_heads``) must read this rank's count instead: `localise` divides those
attributes by tp on the attention modules, and gives each its own copy of the model config with the local counts;
`restore` undoes it. nanoGPT's attention reads the width from its input, which stays whole, so it gets a forward
that reads it from the projection (`nanogpt_attention_forward`), the same computation on this rank's heads.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from strategies.comm import Axis

# Attributes that count attention heads, and the ones that count key/value heads (grouped-query attention).
HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_head", "num_key_value_heads", "n_kv_heads", "num_kv_heads")
KV_HEAD_COUNTS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
# Attributes of an attention module that hold the width of its heads together (the model width when unsplit).
WIDTHS = ("split_size", "embed_dim", "n_embd", "all_head_size", "hidden_size")
_MISSING = object()


def head_counts(m: nn.Module) -> dict[str, int]:
    """The head counts ``m`` declares, on itself or on its ``config`` (a Hugging Face model or attention module)."""
    out = {}
    for source in (getattr(m, "config", None), m):
        for attr in HEAD_COUNTS:
            value = getattr(source, attr, None) if source is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                out[attr] = value
    return out


def check_heads(module: nn.Module, found: dict[str, Any], axis: Axis) -> None:
    """Every head count declared above a split layer must divide by tp: each rank computes whole heads."""
    for name, m in module.named_modules():
        if not any(n.startswith(f"{name}.") or not name for n in found):
            continue
        counts = head_counts(m)
        heads = counts.get("num_attention_heads", counts.get("num_heads", counts.get("n_head")))
        for attr, value in counts.items():
            if value % axis.size == 0:
                continue
            where = name or type(m).__name__
            if attr in KV_HEAD_COUNTS and heads is not None and value < axis.size:
                raise ValueError(
                    f"{where}: grouped-query attention with {value} key/value heads ({attr}) and {heads} query "
                    f"heads cannot split over tp = {axis.size}: each rank needs whole key/value heads, and "
                    f"{value} / {axis.size} is not whole (copying key/value heads across ranks, as Megatron does "
                    f"when kv heads < tp, is not supported). Use a tp that divides {value}.")
            raise ValueError(f"{where}: {value} attention heads ({attr}) do not divide by tp = {axis.size}; "
                             f"choose a tp that divides {value}")


def check_attention_parameters(module: nn.Module, found: dict[str, Any]) -> None:
    """Refuse parameters of an attention module that no plan splits (a per-head norm, as Qwen3's ``q_norm``): they
    would see only this rank's heads, so their gradient is a partial sum over heads, or a whole one if they act
    before the split, and which cannot be told from the structure."""
    for m in attention_modules(module, found):
        name = next(n for n, x in module.named_modules() if x is m)
        inside = [f"{name}.{n}" for n, _ in m.named_parameters()
                  if not any(f"{name}.{n}".startswith(f"{layer}.") for layer in found)]
        if inside:
            raise ValueError(
                f"{name}: tensor parallel splits this attention's projections, but it also holds {inside[:4]}, "
                "which act on this rank's heads only (their gradient would be a partial sum). Not supported yet: "
                "drop tp for this model, or pass a plan that keeps this attention whole.")


def attention_modules(module: nn.Module, found: dict[str, Any]) -> list[nn.Module]:
    """The modules holding a split layer that are attention: they count heads, or are named so."""
    # Only the block layers: the vocabulary's layers ('vp') sit beside the blocks, often on the model's root.
    parents = {n.rpartition(".")[0] for n, style in found.items() if type(style).__name__ in ("Colwise", "Rowwise")}
    out = []
    for name in sorted(parents):
        m = module.get_submodule(name) if name else module
        kind = type(m).__name__.lower()
        if any(hasattr(m, a) for a in HEAD_COUNTS) or "attention" in kind or "attn" in kind:
            out.append(m)
    return out


def localise(module: nn.Module, found: dict[str, Any], axis: Axis) -> list[tuple[Any, str, Any]]:
    """Make the attention modules above the split layers count this rank's heads; returns what to `restore`."""
    changed: list[tuple[Any, str, Any]] = []
    for m in attention_modules(module, found):
        for attr in HEAD_COUNTS + WIDTHS:
            value = getattr(m, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                changed.append((m, attr, value))
                setattr(m, attr, value // axis.size)
        config = getattr(m, "config", None)
        if config is not None and isinstance(getattr(config, "num_attention_heads", None), int):
            local = copy.copy(config)  # this module's own copy: the model's config stays whole
            for attr in ("num_attention_heads", "num_key_value_heads"):
                if isinstance(getattr(config, attr, None), int):
                    setattr(local, attr, getattr(config, attr) // axis.size)
            changed.append((m, "config", config))
            m.config = local
        if _is_nanogpt_attention(m):
            changed.append((m, "forward", m.__dict__.get("forward", _MISSING)))
            m.forward = types.MethodType(nanogpt_attention_forward, m)
    return changed


def restore(changed: list[tuple[Any, str, Any]]) -> None:
    for obj, attr, value in reversed(changed):
        if value is _MISSING:
            delattr(obj, attr)
        else:
            setattr(obj, attr, value)


def _is_nanogpt_attention(m: nn.Module) -> bool:
    # nanoGPT's CausalSelfAttention (Linear c_attn/c_proj, n_head, n_embd) reshapes with ``C`` read from its input.
    return all(hasattr(m, a) for a in ("c_attn", "c_proj", "n_head", "n_embd")) and not hasattr(m, "split_size")


def nanogpt_attention_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """nanoGPT's ``CausalSelfAttention.forward`` with the width read from the projection, not the input: the same
    causal attention over this rank's ``n_head`` heads (``n_embd`` is this rank's width)."""
    B, T = x.shape[:2]
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
    q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
    dropout = getattr(self, "dropout", 0.0) if self.training else 0.0
    if getattr(self, "flash", True):
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=dropout, is_causal=True)
    else:
        att = (q @ k.transpose(-2, -1)) * (1.0 / k.size(-1) ** 0.5)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = self.attn_dropout(F.softmax(att, dim=-1)) @ v
    y = y.transpose(1, 2).contiguous().view(B, T, -1)
    return self.resid_dropout(self.c_proj(y))
