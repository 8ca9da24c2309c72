"""Context parallel (#23) without processes: the load-balanced layout, and what cp refuses (with the fix named)
instead of training wrong: a model without attention it knows, a Hugging Face family whose positions it does not
find, attention that does not call SDPA, and SDPA calls ring attention does not compute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from strategies.comm import Axis
from strategies.context_parallel import layout
from strategies.context_parallel.ring import _pairs
from strategies.context_parallel.technique import ContextParallel
from tests.models import zoo


def test_each_rank_holds_a_chunk_from_each_end_and_the_same_causal_work():
    assert layout.positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert layout.positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    x = torch.arange(2 * 24).view(2, 24)
    parts = [layout.shard(x, 1, r, 4) for r in range(4)]
    assert torch.equal(layout.unshard(parts, 1), x)
    assert all(torch.equal(p[0], layout.positions(24, r, 4)) for r, p in enumerate(parts))
    # (query chunk, key chunk) pairs read over the whole ring: the same count on every rank, diagonal ones included
    work = [sum(len(_pairs(r, owner, 4)) for owner in range(4)) for r in range(4)]
    assert work == [9, 9, 9, 9]
    with pytest.raises(ValueError, match="divides by 8"):
        layout.positions(20, 0, 4)


def _cp(model: nn.Module) -> ContextParallel:
    return ContextParallel(model, Axis.solo("cp"))


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="no attention module found .*context_parallel = True"):
        _cp(nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8)))
    with pytest.raises(ValueError, match="'opt' model"):
        _cp(zoo.opt())
    original = F.scaled_dot_product_attention
    eager = zoo.llama()
    eager.model.config._attn_implementation = "eager"
    cp = _cp(eager)
    try:
        with pytest.raises(RuntimeError, match="'model.model.layers.0.self_attn' .* attn_implementation='sdpa'"):
            eager.loss(cp.shard((torch.randint(0, zoo.VOCAB, (1, 8)),))[0])
        q = torch.randn(1, 2, 4, 8)
        with pytest.raises(ValueError, match="with a mask"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=False)
        with pytest.raises(ValueError, match="is_causal=False"):
            F.scaled_dot_product_attention(q, q, q)
        with pytest.raises(ValueError, match="dropout"):
            F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
    finally:
        cp.teardown(True)
    assert F.scaled_dot_product_attention is original  # given back
