"""Which modules of a model are a mixture-of-experts layer's experts, found by structure, as the models people bring
lay them out: a module named ``experts`` beside a ``gate`` or ``router`` (Hugging Face Mixtral, Qwen2-MoE / Qwen3-MoE,
OLMoE; the demo GPT's MoE), holding every expert's weights fused into 3-D parameters whose first dimension is the
expert, and called as ``experts(hidden_states, top_k_index, top_k_weights)``: the router is the model's own code, and
only the experts' computation moves."""

from __future__ import annotations

import inspect

from torch import nn

ROUTERS = ("gate", "router")


def find_experts(model: nn.Module) -> dict[str, nn.Module]:
    """``{qualified name: experts module}`` of every MoE layer in ``model``; ValueError for a layout the pack cannot
    split (experts as a module list, no fused weights)."""
    found = {}
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if "experts" in children and any(r in children for r in ROUTERS):
            qualified = f"{name}.experts" if name else "experts"
            check_experts(qualified, children["experts"])
            found[qualified] = children["experts"]
    return found


def check_experts(name: str, experts: nn.Module) -> None:
    """Refuse, with the reason, experts that `dispatch` cannot run on a slice of themselves."""
    if isinstance(experts, nn.ModuleList):
        raise ValueError(
            f"expert parallel: {name} holds its experts as a module list, which the pack does not split yet (the "
            "layer's own forward loops over every expert). Fuse them into 3-D weights called as experts(hidden, "
            "top_k_index, top_k_weights), as transformers >= 4.57's Mixtral and Qwen-MoE do, or drop ep<N>")
    count = getattr(experts, "num_experts", None)
    params = dict(experts.named_parameters(recurse=False))
    if not isinstance(count, int) or not params or any(p.dim() < 2 or p.shape[0] != count for p in params.values()):
        raise ValueError(
            f"expert parallel: {name} ({type(experts).__name__}) is not fused experts: it needs an int `num_experts` "
            "and parameters of shape (num_experts, ...), one slice per expert")
    if sum(1 for _ in experts.parameters()) != len(params):
        raise ValueError(f"expert parallel: {name} has parameters in submodules; only its own (num_experts, ...) "
                         "parameters can be split by expert")
    try:
        inspect.signature(experts.forward).bind(None, None, None)
    except TypeError:
        raise ValueError(f"expert parallel: {name}.forward must take (hidden_states, top_k_index, top_k_weights), "
                         "the router's choice per token, so that the router stays the model's code") from None
