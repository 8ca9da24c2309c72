"""Expert parallel's refusals, each with its reason: a dense model, experts as a module list, a degree that does not
divide the experts, an experts module whose weights are not fused by expert."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from demos.gpt import GPT, GPTConfig
from strategies.comm import Axis
from strategies.expert_parallel import ExpertParallel, find_experts


def _moe(experts: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=16, n_layer=1, n_head=1, n_embd=8, seq_len=4, n_experts=experts, top_k=2))


def test_finds_the_demo_moe_experts():
    assert list(find_experts(_moe())) == ["blocks.0.mlp.experts"]


def test_dense_model_is_refused():
    with pytest.raises(ValueError, match="no mixture-of-experts layer"):
        ExpertParallel(_moe(0), Axis.solo("ep"))


def test_degree_must_divide_the_experts():
    axis = Axis("ep", None, (0, 1, 2), 0, Axis.solo("x").stats)  # three ranks (no group: refused before any call)
    with pytest.raises(ValueError, match="4 experts, which ep3 does not divide"):
        ExpertParallel(_moe(4), axis)


def test_module_list_and_unfused_experts_are_refused():
    model = _moe()
    model.blocks[0].mlp.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
    with pytest.raises(ValueError, match="module list"):
        find_experts(model)

    class Loose(nn.Module):
        num_experts = 4

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(8, 8))  # not (num_experts, ...)

        def forward(self, x, index, weights):
            return x

    model.blocks[0].mlp.experts = Loose()
    with pytest.raises(ValueError, match="not fused experts"):
        find_experts(model)
