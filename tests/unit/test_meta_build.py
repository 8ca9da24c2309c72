"""Models built on the meta device and made by slice (`strategies.deferred`), in one process: what goes to meta and
what stays, the same weights whatever order the parts are made in, tied weights and the optimizer's references
kept, and the refusals (a parameter no init gives values, buffers on meta)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from demos.gpt import GPT, GPTConfig
from strategies.deferred import Deferred, meta_parameters

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, seq_len=8, vocab_size=32, dropout=0.0)


class Rotary(nn.Module):
    """A buffer computed in __init__ (as rotary frequencies are) beside a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("freq", torch.arange(4.0), persistent=False)


class Scale(nn.Module):
    """A parameter made in __init__ that neither a reset_parameters nor an _init_weights gives values."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))


def test_parameters_go_to_meta_buffers_stay_and_loaded_weights_stay():
    with meta_parameters():
        m = Rotary()
        loaded = nn.Linear(2, 2)
        loaded.weight = nn.Parameter(torch.ones(2, 2))  # set after construction, as from_pretrained loads
    assert m.proj.weight.is_meta and m.proj.bias.is_meta
    assert torch.equal(m.freq, torch.arange(4.0))
    assert not loaded.weight.is_meta and torch.equal(loaded.weight, torch.ones(2, 2))
    assert loaded.bias.is_meta
    assert not nn.Linear(2, 2).weight.is_meta  # the patch is gone after the block


def _made(order) -> GPT:
    with meta_parameters():
        model = GPT(CONFIG)
    deferred = Deferred(model, torch.device("cpu"), seed=5)
    for name in order:
        deferred(model.get_submodule(name))
    deferred.rest()
    return model


def test_the_same_weights_whatever_order_the_parts_are_made_in():
    a, b = _made([]), _made(["head", "blocks.1.attn.qkv", "blocks.0"])
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name
    assert torch.equal(a.blocks[0].ln1.weight, torch.ones(16)) and torch.equal(a.head.bias, torch.zeros(32))
    assert abs(float(a.head.weight.std()) - 0.02) < 0.005  # the model's own _init_weights ran
    c = _made([])  # another seed gives other weights: the seed decides
    with meta_parameters():
        d = GPT(CONFIG)
    Deferred(d, torch.device("cpu"), seed=6).rest()
    assert torch.equal(c.head.weight, a.head.weight) and not torch.equal(d.head.weight, a.head.weight)


def test_tied_weight_and_optimizer_references_survive():
    with meta_parameters():
        model = GPT(CONFIG)
        model.head.weight = model.tok_emb.weight  # tied, as Hugging Face's tie_weights does
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    Deferred(model, torch.device("cpu"), seed=0)(model.head)  # the head first: its first owner (tok_emb) makes it
    assert model.head.weight is model.tok_emb.weight and not model.head.weight.is_meta
    Deferred(model, torch.device("cpu"), seed=0).rest()
    assert optimizer.param_groups[0]["params"][0] is model.tok_emb.weight


def test_a_parameter_no_init_gives_values_is_refused_by_name():
    with meta_parameters():
        holder = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(ValueError, match=r"1 \(Scale\): parameter\(s\) gain .*reset_parameters"):
        Deferred(holder, torch.device("cpu")).rest()


def test_buffers_on_meta_are_refused_with_what_to_do():
    with torch.device("meta"):
        model = Rotary()
    with pytest.raises(ValueError, match="buffers on the meta device .*configure_model"):
        Deferred(model, torch.device("cpu"))
