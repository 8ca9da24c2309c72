"""Attention under context parallel: every ``torch.nn.functional.scaled_dot_product_attention`` call goes round the
ring (`ring.ring_attention`) while a model runs with its sequence split.

The models whose attention is detected (the demo GPT, nanoGPT, Hugging Face GPT-2 and the Llama family with
``attn_implementation="sdpa"``) call ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on the heads of
their local tokens; that call is replaced for as long as a `RingRoute` is installed (a module attribute, looked up
at call time by each of them), so the user's attention code runs unchanged. The route refuses what ring attention
does not compute (a mask, dropout, attention that is not causal) instead of computing something else, and each
attention module is watched: one that runs without calling it (Hugging Face's "eager" attention, a hand-written
softmax) stops the run with its name, since it would attend only to its own rank's tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strategies.comm import Axis
from strategies.context_parallel.ring import ring_attention

MARK = "context_parallel"  # an attention module with this attribute True is taken as calling SDPA causally


class RingRoute:
    """While installed, ``F.scaled_dot_product_attention`` is ring attention over ``axis``; ``attention``: the
    modules that must call it (each forward of one is checked to have)."""

    def __init__(self, axis: Axis, attention: dict[str, nn.Module]) -> None:
        self.axis, self.attention = axis, attention
        self.calls = 0
        self._calls_before = 0  # the count when the attention module now running began
        self._original = None
        self._hooks: list = []

    def install(self) -> None:
        if self._original is not None:
            return
        self._original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._sdpa
        for name, module in self.attention.items():
            self._hooks.append(module.register_forward_pre_hook(self._before))
            self._hooks.append(module.register_forward_hook(self._after(name)))

    def remove(self) -> None:
        if self._original is not None:
            F.scaled_dot_product_attention = self._original
            self._original = None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _before(self, module: nn.Module, args: tuple) -> None:
        self._calls_before = self.calls

    def _after(self, name: str):
        def check(module: nn.Module, args: tuple, output) -> None:
            if self.calls == self._calls_before:
                raise RuntimeError(
                    f"context parallel: the attention module {name!r} ({type(module).__name__}) ran without calling "
                    "torch.nn.functional.scaled_dot_product_attention, so it attended to this rank's tokens only. "
                    "Under cp a model's attention must call it (is_causal=True, no mask): for a Hugging Face model "
                    "load it with attn_implementation='sdpa'; for your own, call F.scaled_dot_product_attention")
        return check

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False) -> torch.Tensor:
        _check_call(attn_mask, dropout_p, is_causal, query)
        # As autocast runs SDPA (in its half dtype), which it cannot see run here: a Hugging Face Llama's rotated q
        # and k are float32 beside a half v (a rehearsal's meta tensors follow the host's autocast)
        host = "cpu" if query.device.type == "meta" else query.device.type
        if torch.is_autocast_enabled(host):
            dtype = torch.get_autocast_dtype(host)
            query, key, value = (t.to(dtype) for t in (query, key, value))
        if key.shape[-3] != query.shape[-3] and not enable_gqa:
            raise ValueError(f"context parallel: scaled_dot_product_attention was called with {key.shape[-3]} key "
                             f"heads for {query.shape[-3]} query heads but without enable_gqa=True")
        self.calls += 1
        return ring_attention(query, key, value, self.axis, scale)


def _check_call(attn_mask, dropout_p: float, is_causal: bool, query: torch.Tensor) -> None:
    if attn_mask is not None:
        raise ValueError(
            "context parallel: scaled_dot_product_attention was called with a mask; ring attention computes causal "
            "attention over whole sequences only (pass batches without padding: no attention_mask, or one of ones)")
    if not is_causal:
        raise ValueError("context parallel: scaled_dot_product_attention was called with is_causal=False; ring "
                         "attention computes causal self-attention only (decoder models)")
    if dropout_p:
        raise ValueError(f"context parallel: attention dropout ({dropout_p}) is not supported by ring attention; set "
                         "the model's attention dropout to 0")
    if query.dim() != 4:
        raise ValueError(f"context parallel: attention on (batch, heads, tokens, head dim) tensors, got a query of "
                         f"shape {tuple(query.shape)}")


def find_attention(model: nn.Module) -> dict[str, nn.Module]:
    """The model's attention modules: those marked (``module.context_parallel = True``), else the outermost modules
    whose class is named for attention inside its blocks; the caller refuses a model with none."""
    marked = {n: m for n, m in model.named_modules() if getattr(m, MARK, False) is True}
    if marked:
        return marked
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        kind = type(module).__name__.lower()
        inside = any(name.startswith(f"{outer}.") for outer in found)
        if not inside and ("attention" in kind or "attn" in kind) and any(
                isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D" for m in module.children()):
            found[name] = module
    return found
