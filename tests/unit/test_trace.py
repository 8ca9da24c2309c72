"""Pipeline stages by use: one forward, watched, decides the list of blocks and which stage holds each parameter;
what the stages could not reproduce is refused with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from demos.gpt import GPT, GPTConfig
from strategies.pipeline.stages import plan_stages
from strategies.pipeline.trace import BLOCKS, POST, PRE, trace_forward
from tests.models import zoo


def _layout(model: nn.Module, ids: torch.Tensor, stages: int = 2):
    trace = trace_forward(model, lambda: model.loss(ids) if hasattr(model, "loss") else model(ids))
    return trace, plan_stages(model, stages, trace=trace)


def test_a_head_registered_before_the_blocks_goes_to_the_stage_that_uses_it():
    model = zoo.build("head_first")
    trace, layout = _layout(model, zoo.batches(1)[0])
    assert trace.blocks == "blocks"
    assert trace.phases("head.weight") == {POST} and trace.phases("embed.weight") == {PRE}
    assert trace.phases("pos") == {PRE} and trace.phases("blocks.0.attn.c_attn.weight") == {BLOCKS}
    assert sorted(layout.pre) == ["embed.weight", "pos"]  # registered after the blocks, used before them
    assert sorted(layout.post) == ["head.bias", "head.weight", "norm.bias", "norm.weight"]  # registered before
    registration = plan_stages(zoo.build("head_first"), 2)  # without a trace: the old, wrong guess
    assert "head.weight" in registration.pre


def test_the_demo_gpt_is_cut_as_before():
    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=16, vocab_size=32, seq_len=8))
    _, layout = _layout(model, torch.randint(0, 32, (2, 8)))
    assert layout.pre == ["tok_emb.weight", "pos_emb.weight"]
    assert layout.post == ["ln_f.weight", "ln_f.bias", "head.weight", "head.bias"]


class _Experts(nn.Module):
    """A mixture of experts inside each block: its list of experts has more elements than the list of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        return x + sum(expert(x) for expert in self.experts)


class _MoE(nn.Module):
    def __init__(self, tie_by_use: bool = False, extra: str = "") -> None:
        super().__init__()
        self.embed, self.time = nn.Embedding(16, 8), nn.Linear(1, 8)
        self.blocks = nn.ModuleList(_Experts() for _ in range(2))
        self.out = nn.Linear(8, 16)
        self.tie_by_use, self.extra = tie_by_use, extra

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
            if self.extra == "between":
                x = self.out(x)[..., :8]
        return x @ self.embed.weight.T if self.tie_by_use else self.out(x)


def test_the_blocks_are_the_list_the_forward_runs_in_order_not_the_longest():
    trace = trace_forward(model := _MoE(), lambda: model(torch.randint(0, 16, (2, 4))))
    assert trace.blocks == "blocks"  # not blocks.0.experts (4 elements, run inside each block)


def test_parameters_used_between_blocks_are_refused():
    with pytest.raises(ValueError, match=r"out.bias, out.weight: parameters are used between two blocks"):
        _layout(_MoE(extra="between"), torch.randint(0, 16, (2, 4)))


def test_a_block_argument_computed_from_parameters_is_refused():
    class Conditioned(_MoE):
        def forward(self, ids):
            x, cond = self.embed(ids), self.time(torch.ones(ids.shape[0], 1, 1))
            for block in self.blocks:
                x = block(x, scale=cond)
            return self.out(x)

    class Block(_Experts):
        def forward(self, x, scale=None):
            return super().forward(x) * scale

    model = Conditioned()
    model.blocks = nn.ModuleList(Block() for _ in range(2))
    with pytest.raises(ValueError, match=r"blocks\[0\] scale.*computed from parameters.*from zeros"):
        _layout(model, torch.randint(0, 16, (2, 4)))


def test_a_block_returning_more_than_its_hidden_states_is_refused():
    class Pair(_Experts):
        def forward(self, x):
            return super().forward(x), x.sum()  # (hidden, aux loss)

    class Model(_MoE):
        def forward(self, ids):
            x, aux = self.embed(ids), 0
            for block in self.blocks:
                x, extra = block(x)
                aux = aux + extra
            return self.out(x) + aux

    model = Model()
    model.blocks = nn.ModuleList(Pair() for _ in range(2))
    with pytest.raises(ValueError, match=r"blocks\[0\].*return more than their hidden states"):
        _layout(model, torch.randint(0, 16, (2, 4)))


def test_a_weight_tied_by_use_is_held_by_the_first_and_last_stage():
    trace, layout = _layout(_MoE(tie_by_use=True), torch.randint(0, 16, (2, 4)))
    assert trace.phases("embed.weight") == {PRE, POST}
    assert layout.shared == ("embed.weight",) and "embed.weight" not in layout.pre + layout.post
    assert layout.held_by("embed.weight", [0]) and layout.held_by("embed.weight", [1])
    assert layout.stage_of("embed.weight") == 0  # its checkpointed value is the first stage's


def test_a_direct_weight_use_counts():
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(4, 4))
    model.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    model.loss = lambda x: F.linear(model.blocks[1](model.blocks[0](x)), model.w.T).sum()
    trace = trace_forward(model, lambda: model.loss(torch.randn(2, 4)))
    assert trace.phases("w") == {POST}


@pytest.mark.parametrize("name,weight", [
    ("gpt2", "model.transformer.wte.weight"), ("opt", "model.model.decoder.embed_tokens.weight"),
    ("llama_tied", "model.model.embed_tokens.weight"), ("nanogpt", "transformer.wte.weight"),
])
def test_models_that_tie_their_head_to_the_embedding_share_it_across_stages(name: str, weight: str):
    pytest.importorskip("transformers")
    _, layout = _layout(zoo.build(name), zoo.batches(1)[0])
    assert layout.shared == (weight,)


def test_a_weight_registered_outside_the_blocks_but_used_in_them_is_refused():
    class Borrowing(_Experts):
        def __init__(self, weight: nn.Parameter) -> None:
            super().__init__()
            self.borrowed = (weight,)  # a tuple: used in forward, registered only on the model

        def forward(self, x):
            return super().forward(x) * self.borrowed[0].sum()

    model = _MoE()
    model.blocks = nn.ModuleList(Borrowing(model.time.weight) for _ in range(2))
    with pytest.raises(ValueError, match=r"time.weight: it is registered outside the blocks but the blocks use it"):
        _layout(model, torch.randint(0, 16, (2, 4)))


def test_one_tensor_in_two_blocks_is_refused():
    model = _MoE()
    model.blocks[1].experts[0].weight = model.blocks[0].experts[0].weight
    with pytest.raises(ValueError, match=r"blocks.0.experts.0.weight: it is the same tensor in blocks \['0', '1'\]"):
        _layout(model, torch.randint(0, 16, (2, 4)))


class _Around(nn.Module):
    """The demo's blocks with the user's code around them: a mask, code between blocks, or autocast."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(_Masked() for _ in range(3))

    def forward(self, ids):
        x = self.embed(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.how == "autocast"):
            for block in self.blocks:
                x = block(x, mask=ids > 0) if self.how == "mask" else block(x)
                x = x * 2 if self.how == "between" else x
        return x.float().sum()


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, mask=None):
        return self.lin(x) if mask is None else self.lin(x) * mask[..., None]


@pytest.mark.parametrize("how, chained", [("plain", True), ("mask", False), ("between", False), ("autocast", False)])
def test_blocks_are_a_plain_chain_only_when_nothing_but_the_previous_output_reaches_them(how: str, chained: bool):
    # A middle stage runs its blocks by themselves only on a chain: a mask, code between two blocks or an autocast
    # the user's forward enters would be left out.
    model = _Around(how)
    assert trace_forward(model, lambda: model(torch.randint(0, 16, (2, 4)))).chained is chained
    demo = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, seq_len=8))
    assert trace_forward(demo, lambda: demo(torch.randint(0, 32, (2, 8)))).chained
