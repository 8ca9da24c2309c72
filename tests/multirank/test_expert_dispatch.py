"""Expert parallel's token exchange (`expert_parallel.dispatch`) on 2 gloo ranks against the experts run whole in one
process: outputs and the gradients of the inputs, the routing weights and the experts' weights, for a balanced router
and for one that sends every token to rank 0's experts; and the all-to-all bytes each rank sent, counted by
`strategies.comm`, equal to `cost.all_to_all_bytes` (and, balanced, to `balanced_all_to_all_bytes`).

Tolerance: fp32, 1e-6: the runs differ in the order of the sums of each token's experts (observed ~1e-8).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from demos.gpt import Experts, GPTConfig
from strategies.comm import Axis, CommStats, Op
from strategies.expert_parallel import cost
from strategies.expert_parallel.dispatch import Dispatch
from strategies.testing import run_ranks

WIDTH, EXPERTS, TOKENS, TOP_K = 8, 4, 12, 2


def _inputs(rank: int, skewed: bool):
    torch.manual_seed(0)
    experts = Experts(GPTConfig(n_embd=WIDTH, n_head=1, n_experts=EXPERTS, top_k=TOP_K))
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(TOKENS, WIDTH, generator=g, requires_grad=True)
    if skewed:  # every token to experts 0 and 1: all rows go to rank 0
        index = torch.tensor([[0, 1]] * TOKENS)
    else:  # each token's two experts drawn, so rows go both ways
        index = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, TOP_K, generator=g, requires_grad=True)
    return experts, x, index, weights


def _rank(rank: int, world: int, skewed: bool):
    experts, x, index, weights = _inputs(rank, skewed)
    stats = CommStats()
    axis = Axis.of_group("ep", dist.group.WORLD, stats)
    per = EXPERTS // world
    with torch.no_grad():
        experts.fc = torch.nn.Parameter(experts.fc[rank * per : (rank + 1) * per].clone())
        experts.proj = torch.nn.Parameter(experts.proj[rank * per : (rank + 1) * per].clone())
    local_forward = experts.forward
    experts.num_experts = per
    out = Dispatch(local_forward, EXPERTS, axis, [experts.fc, experts.proj])(x, index, weights)
    out.pow(2).sum().backward()
    counts = torch.bincount(index.reshape(-1), minlength=EXPERTS)
    return {"out": out.detach(), "x": x.grad, "w": weights.grad, "fc": experts.fc.grad, "counts": counts,
            "sent": stats.total(Op.ALL_TO_ALL).bytes_sent}


@pytest.mark.parametrize("skewed", [False, True], ids=["balanced", "skewed"])
def test_dispatch_equals_one_process_and_counts_its_bytes(skewed: bool):
    results = run_ranks(_rank, 2, skewed)
    choices = torch.stack([r["counts"] for r in results])
    for rank, got in enumerate(results):
        experts, x, index, weights = _inputs(rank, skewed)
        out = experts(x, index, weights)
        out.pow(2).sum().backward()
        torch.testing.assert_close(got["out"], out.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["x"], x.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["w"], weights.grad, rtol=1e-6, atol=1e-6)
        assert got["sent"] == cost.all_to_all_bytes(choices, rank, WIDTH, 4)
    # the experts' gradients: rank r's slice holds the sum over both ranks' tokens (one process sums them all); a
    # slice whose experts no token chose (rank 1's, skewed) holds zeros, as the one process's fused weight does
    whole = torch.zeros(EXPERTS, 4 * WIDTH, WIDTH)
    for rank in range(2):
        experts, x, index, weights = _inputs(rank, skewed)
        experts(x, index, weights).pow(2).sum().backward()
        whole += experts.fc.grad
    assert all(r["fc"] is not None for r in results)
    torch.testing.assert_close(torch.cat([r["fc"] for r in results]), whole, rtol=1e-6, atol=1e-6)
    if skewed:
        assert results[1]["sent"] == 8 * 2 + 2 * WIDTH * 4 * TOKENS * TOP_K  # rank 1 sends all its rows out
    else:
        assert sum(r["sent"] for r in results) == sum(cost.all_to_all_bytes(choices, r, WIDTH, 4) for r in range(2))


def test_balanced_formula():
    choices = torch.full((2, EXPERTS), TOKENS * TOP_K // EXPERTS)  # every expert the same share
    assert cost.all_to_all_bytes(choices, 0, WIDTH, 4) == cost.balanced_all_to_all_bytes(TOKENS, TOP_K, EXPERTS, 2,
                                                                                          WIDTH, 4)
