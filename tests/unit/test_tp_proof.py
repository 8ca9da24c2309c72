"""The set-up proof that a module tensor parallel splits computes on each rank's slice what it computes whole
(`strategies.tensor_parallel.proof`, `heads.prove_forwards`): no processes, the ranks simulated on a probe."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from strategies.tensor_parallel import Colwise, Rowwise, detect_plan
from strategies.tensor_parallel.heads import prove_forwards
from strategies.tensor_parallel.plans import matches
from tests.models import zoo

MLP_PLAN = {"*.mlp.fc": Colwise(), "*.mlp.proj": Rowwise()}


class Mlp(nn.Module):
    def __init__(self, norm: bool = False, after: bool = False) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(8, 32), nn.Linear(32, 8)
        self.norm, self.after = norm, after

    def forward(self, x):
        h = F.gelu(self.fc(x))
        y = self.proj(F.normalize(h, dim=-1) if self.norm else h)  # over whatever width the rank holds: no error
        return torch.tanh(y) if self.after else y  # after the all-reduce: the same on every rank


class Net(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Module()])
        self.blocks[0].mlp = mlp


def _prove(model: nn.Module, plan: dict, tp: int = 2) -> set[str]:
    return prove_forwards(model, matches(plan, model), tp)


def test_element_wise_mlp_runs_its_own_forward_even_with_a_nonlinearity_after_the_sum():
    assert _prove(Net(Mlp(after=True)), MLP_PLAN) == set()


def test_norm_over_the_split_width_is_refused_naming_the_module():
    # A norm over the hidden width sees a quarter of it per rank at tp = 4 and runs: it would train something else.
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp \(Mlp\) computes something else on a rank's slice") as e:
        _prove(Net(Mlp(norm=True)), MLP_PLAN, tp=4)
    assert "differs on rank 0's slice" in str(e.value) and "keeps this module whole" in str(e.value)


@pytest.mark.parametrize("name,replaced", [("nanogpt", 2), ("nanogpt_no_dropout", 2), ("nanogpt_rotary", 0)])
def test_nanogpt_runs_its_own_forward_or_one_proven_equal(name: str, replaced: int):
    model = zoo.build(name)
    assert len(_prove(model, detect_plan(model))) == replaced


def test_nanogpt_with_changed_attention_is_refused_with_what_to_change():
    model = zoo.build("nanogpt_scaled_q")
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn \(NanoScaledQ\) cannot be split") as e:
        _prove(model, detect_plan(model))
    assert "fails on a rank's slice" in str(e.value) and "self.n_embd // self.n_head" in str(e.value)


class TwoArgAttention(zoo.NanoAttention):
    def forward(self, x, freqs):  # noqa: ARG002  (a rotary table passed in, as Llama-style nanoGPT ports do)
        return super().forward(x)


def test_nanogpt_layout_whose_forward_needs_more_than_a_tensor_is_refused_not_replaced():
    model = zoo.build("nanogpt")
    for block in model.transformer.h:
        block.attn.__class__ = TwoArgAttention
    with pytest.raises(ValueError, match=r"cannot be run on a probe of one tensor \(.x., .freqs.\)"):
        _prove(model, detect_plan(model))


def test_the_proof_sees_through_a_zero_initialised_output_projection():
    # The probe draws the parameters afresh: with c_proj at zero, any two forwards would agree on the real weights.
    model = zoo.build("nanogpt_scaled_q")
    for block in model.transformer.h:
        nn.init.zeros_(block.attn.c_proj.weight)
        nn.init.zeros_(block.attn.c_proj.bias)
    with pytest.raises(ValueError, match="cannot be split"):
        _prove(model, detect_plan(model))


def test_instances_that_differ_in_a_setting_are_proven_apart():
    # The first layer unscaled (nanoGPT's forward computes it), the second scaled: one proof for both would have given
    # the second nanoGPT's forward too, dropping its scaling.
    model = zoo.build("nanogpt_scaled_q")
    model.transformer.h[0].attn.q_scale = 1.0
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.attn \(NanoScaledQ\) cannot be split"):
        _prove(model, detect_plan(model))


class DictMlp(Mlp):
    def forward(self, x):  # a dict out, and a second tensor computed from this rank's slice only
        h = F.gelu(self.fc(x))
        return {"out": self.proj(h), "aux": h.square().mean(-1)}


def test_every_output_of_the_whole_shape_is_compared_dicts_included():
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp \(DictMlp\) computes something else"):
        _prove(Net(DictMlp()), MLP_PLAN)
