"""The router's load-balancing loss over the whole step's tokens, as one process computes it.

Hugging Face's MoE models (Mixtral, Qwen2-MoE, OLMoE...) add ``router_aux_loss_coef`` times Switch Transformer's
loss when ``output_router_logits`` is on: E x sum over experts of f_e x P_e, f_e the share of (token, choice) pairs
routed to expert e and P_e its mean router probability, each a mean over the tokens of the forward. On a data rank
those are its own tokens' means, and the mean over ranks of such products is not the product of the batch's means.

So, while expert parallel runs, the module's ``load_balancing_loss_func`` is replaced by one that sums f's counts
and the token count over the data ranks (no gradient flows through f, a count), and returns D x E x sum f_e x
(this rank's probability sum / the batch's tokens): its mean over the D data ranks is the batch's loss, value and
gradient, which the data-parallel average then makes. The arithmetic follows transformers 5's function (softmax,
top-k, the attention mask's weights), checked equal to one process by `tests/e2e/test_expert_parallel.py`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from strategies import comm
from strategies.comm import Axis

NAME = "load_balancing_loss_func"


def install(model: nn.Module, axis: Axis) -> list[tuple[Any, Any]]:
    """Replace ``load_balancing_loss_func`` in the modules that define ``model``'s classes; what to put back."""
    modules = {sys.modules.get(type(m).__module__) for m in model.modules()}
    replaced = [(module, getattr(module, NAME)) for module in modules if module is not None and hasattr(module, NAME)]
    for module, _ in replaced:
        setattr(module, NAME, _over(axis))
    return replaced


def restore(replaced: list[tuple[Any, Any]]) -> None:
    for module, original in replaced:
        setattr(module, NAME, original)


def _over(axis: Axis):
    def load_balancing_loss_func(gate_logits: Any, num_experts: int | None = None, top_k: int = 2,
                                 attention_mask: torch.Tensor | None = None) -> Any:
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return 0
        device = gate_logits[0].device
        counts = torch.zeros(num_experts + 1, dtype=torch.float64, device=device)  # per expert, then the tokens
        probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
        for layer_gate in gate_logits:
            weights = torch.nn.functional.softmax(layer_gate.to(device), dim=-1)
            _, chosen = torch.topk(weights, top_k, dim=-1)
            mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float64) if attention_mask is not None \
                else torch.ones(weights.shape[0], dtype=torch.float64, device=device)
            counts[:-1].scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
            counts[-1] += mask.sum()
            probs = probs + (weights.float() * mask.float().unsqueeze(-1)).sum(dim=0)
        comm.all_reduce(counts, axis)  # the step's tokens, over every data rank
        share, tokens = (counts[:-1] / counts[-1]).float(), counts[-1].float()  # (float64: counts exact past 2**24)
        return axis.size * num_experts * torch.sum(share * probs / tokens)
    return load_balancing_loss_func
