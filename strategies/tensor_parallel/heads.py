"""Attention heads under tensor parallel: checked to split evenly, and counted per rank while the layers are split.

A column-parallel q/k/v projection leaves each rank whole heads, ``heads / tp`` of them. Attention code that
counts heads from the projection's width (``view(..., -1, head_dim)``: Llama, Mistral, Qwen2, GPT-2 in
``transformers`` 5) needs nothing more. Code that reads a head count or a width from the module (``num_heads``,
``split_size``, ``self.config.num_attention_heads``) must read this rank's count instead: `localise` divides those
attributes by tp on the attention modules, and gives each its own copy of the model config with the local counts;
`restore` undoes it.

Before the split, `prove_forwards` checks each module holding split layers (the pack's demo, nanoGPT, a user's
own) by simulating the ranks on a probe (`proof`): the user's forward runs on the slice if it computes what it
computes whole. nanoGPT's attention cannot (it reads the width from its input, which stays whole): it gets a
forward that reads it from the projection (`nanogpt_attention_forward`) only where that is proven to compute what
the user's forward does; anything else is refused, saying what to change.
"""

from __future__ import annotations

import copy
import gc
import inspect
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from strategies import comm
from strategies.comm import Axis
from strategies.tensor_parallel import proof

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


def split_parents(module: nn.Module, found: dict[str, Any]) -> list[tuple[str, nn.Module, dict[str, Any]]]:
    """``(name, module, {relative layer name: style})`` of each module that holds layers of the blocks tensor
    parallel splits (the attention, the MLP; the block when it holds them itself)."""
    # Only the block layers: the vocabulary's layers ('vp') sit beside the blocks, often on the model's root.
    parents: dict[str, dict[str, Any]] = {}
    for n, style in found.items():
        if type(style).__name__ in ("Colwise", "Rowwise"):
            parent, _, attr = n.rpartition(".")
            parents.setdefault(parent, {})[attr] = style
    return [(name, module.get_submodule(name) if name else module, layers) for name, layers in sorted(parents.items())]


def _is_attention(m: nn.Module) -> bool:
    kind = type(m).__name__.lower()
    return any(hasattr(m, a) for a in HEAD_COUNTS) or "attention" in kind or "attn" in kind


def attention_modules(module: nn.Module, found: dict[str, Any]) -> list[nn.Module]:
    """The modules holding a split layer that are attention: they count heads, or are named so."""
    return [m for _, m, _ in split_parents(module, found) if _is_attention(m)]


def prove_forwards(module: nn.Module, found: dict[str, Any], tp: int) -> set[str]:
    """Before the split: prove for each module holding split layers that its forward computes on every rank's slice
    what it computes whole (`proof.check`), and return the names of the nanoGPT-style attentions whose forward cannot
    run on a slice but that `nanogpt_attention_forward` is proven to compute. A module that neither is refused with
    what to change. Forwards that need more than one tensor, or fail whole on the probe (Llama's attention needs its
    position embeddings), are not probed: the first-batch check covers them."""
    replaced: set[str] = set()
    decided: dict[Any, str] = {}  # one proof per class, layout and settings: the same code computes the same way
    for name, m, layers in split_parents(module, found):
        key = (type(m), tuple(sorted(layers.items(), key=lambda item: item[0])), _settings(m))
        if key not in decided:
            decided[key] = _decide(name or type(m).__name__, m, layers, tp)
        if decided[key] == "ours":
            replaced.add(name)
    gc.collect()  # the probe's copies hold cycles: freed now, not inside a later step's memory figures
    return replaced


def _settings(m: nn.Module) -> tuple:
    """The plain values a module holds (a scale, a flag, a head count): instances that differ in them are proven
    apart, as their forwards may compute differently."""
    return tuple(sorted((k, v) for k, v in vars(m).items()
                        if isinstance(v, (bool, int, float, str)) and not k.startswith("_")))


def _decide(name: str, m: nn.Module, layers: dict[str, Any], tp: int) -> str:
    """``"own"``: the user's forward runs on the slice; ``"ours"``: nanoGPT's forward replaced by one proven equal;
    ``"unprobed"``: nothing to probe it with. Raises when neither is proven."""
    nano = _is_nanogpt_attention(m)
    if comm.rehearsing() and not nano:  # a rehearsal (shapes only): the probe's real float64 copies cost a minute
        return "unprobed"               # at 8B, for a verdict that leaves the split as it is; a real run probes
    x = proof.probe_input(m, layers)
    own = proof.check(m, layers, tp, lambda c, x: c(x), x, _localise_copy) if x is not None else None
    if own is None or not own.probed:
        if nano:
            raise ValueError(
                f"tensor parallel: {name} ({type(m).__name__}) is laid out as nanoGPT's attention, whose forward "
                "reads the width from its input and so cannot run on a rank's slice as written; the pack would run "
                "nanoGPT's forward instead, but yours cannot be run on a probe of one tensor "
                f"{tuple(inspect.signature(m.forward).parameters)}"
                f"{f' ({own.why})' if own is not None else ''}, so it cannot prove that it computes the same. "
                + _ADVICE)
        return "unprobed"
    if own.same:
        return "own"
    if nano:
        ours = proof.check(m, layers, tp, nanogpt_attention_forward, x, _localise_copy)
        if ours.same:
            return "ours"
        raise ValueError(
            f"tensor parallel: {name} ({type(m).__name__}) cannot be split as written: your forward {own.why}, and "
            f"nanoGPT's attention forward, which the pack runs instead on nanoGPT's layout, {ours.why}: your "
            "attention computes something other than nanoGPT's. " + _ADVICE)
    raise ValueError(
        f"tensor parallel: {name} ({type(m).__name__}) computes something else on a rank's slice than whole: its "
        f"forward {own.why}. Between the split layers ({', '.join(layers)}) everything must act per head or per "
        "element (a norm over the whole width, or a width read from the input, does not). Pass a tp_plan that "
        "keeps this module whole (leave its layers out), or drop tp.")


_ADVICE = ("To run your own forward on each rank's heads, read widths and head counts from the module, not from "
           "the input: the pack divides n_head and n_embd by tp on every rank (e.g. `y.view(B, T, self.n_embd)` and "
           "head size `self.n_embd // self.n_head` instead of `C` from `x.size()`). Or pass a tp_plan that keeps "
           "this attention whole, or drop tp.")


def _local_counts(m: nn.Module, tp: int) -> list[tuple[Any, str, Any]]:
    """Divide ``m``'s head counts and widths by tp (and give it a config of its own with local counts); returns
    what to `restore`."""
    changed: list[tuple[Any, str, Any]] = []
    for attr in HEAD_COUNTS + WIDTHS:
        value = getattr(m, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            changed.append((m, attr, value))
            setattr(m, attr, value // tp)
    config = getattr(m, "config", None)
    if config is not None and isinstance(getattr(config, "num_attention_heads", None), int):
        local = copy.copy(config)  # this module's own copy: the model's config stays whole
        for attr in ("num_attention_heads", "num_key_value_heads"):
            if isinstance(getattr(config, attr, None), int):
                setattr(local, attr, getattr(config, attr) // tp)
        changed.append((m, "config", config))
        m.config = local
    return changed


def _localise_copy(m: nn.Module, tp: int) -> None:
    if _is_attention(m):
        _local_counts(m, tp)


def localise(module: nn.Module, found: dict[str, Any], axis: Axis,
             replaced: set[str] = frozenset()) -> list[tuple[Any, str, Any]]:
    """Make the attention modules above the split layers count this rank's heads, and give the ones named in
    ``replaced`` (`prove_forwards`) nanoGPT's forward on the slice; returns what to `restore`."""
    changed: list[tuple[Any, str, Any]] = []
    for name, m, _ in split_parents(module, found):
        if _is_attention(m):
            changed += _local_counts(m, axis.size)
        if name in replaced:
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
    causal attention over this rank's ``n_head`` heads (``n_embd`` is this rank's width). Its dropout modules are
    used where the module has them. Run only where `prove_forwards` showed it computes what the user's forward does."""
    B, T = x.shape[:2]
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
    q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
    dropout = getattr(self, "dropout", 0.0) if self.training else 0.0
    if getattr(self, "flash", True):
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=dropout, is_causal=True)
    else:
        att = (q @ k.transpose(-2, -1)) * (1.0 / k.size(-1) ** 0.5)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = _maybe(self, "attn_dropout", F.softmax(att, dim=-1)) @ v
    y = y.transpose(1, 2).contiguous().view(B, T, -1)
    return _maybe(self, "resid_dropout", self.c_proj(y))


def _maybe(m: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    layer = getattr(m, name, None)
    return layer(x) if isinstance(layer, nn.Module) else x
