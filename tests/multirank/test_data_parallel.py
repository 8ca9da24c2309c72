"""Naive DP and our DDP on several gloo ranks against one process, and the bytes they move.

Tolerance: fp32, per-step losses and final parameters within relative 1e-6 (absolute 1e-7). The runs
differ only in the order of floating-point sums: each rank's gradient is a mean over its rows, then the
ranks' gradients are averaged, where one process takes one mean over all rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from strategies import comm
from strategies.comm import Axis, CommStats, Op
from strategies.data_parallel import BucketedDataParallel, NaiveDataParallel
from strategies.testing import run_ranks
from tests.helpers import TinyNet, global_batches, train

RTOL, ATOL = 1e-6, 1e-7
STEPS, BATCH = 4, 16
PSI = 171  # TinyNet's parameter count
TINY_BUCKET_MB = 200 / 2**20  # ~200 bytes: TinyNet's 684 bytes of gradients fill several buckets


def _model_and_optimizer():
    torch.manual_seed(0)
    model = TinyNet()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _single(accum: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, opt = _model_and_optimizer()
    losses = train(model, opt, global_batches(STEPS, BATCH), accum=accum)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _dp_rank(rank: int, world: int, mode: str, accum: int):
    model, opt = _model_and_optimizer()
    stats = CommStats()
    axis = Axis.of_group("dp", dist.group.WORLD, stats)
    if mode == "naive":
        sync = NaiveDataParallel(model, axis)
    else:
        sync = BucketedDataParallel(model, axis, bucket_cap_mb=TINY_BUCKET_MB, ring=mode == "ring")
    losses = train(model, opt, global_batches(STEPS, BATCH), accum=accum, shard=(rank, world), sync=sync)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params, stats.snapshot(), len(getattr(sync, "buckets", []))


def _assert_matches_single(results, accum: int) -> None:
    ref_losses, ref_params = _single(accum)
    mean_losses = torch.tensor([r[0] for r in results]).mean(0)  # each rank's loss is the mean over its rows
    torch.testing.assert_close(mean_losses, torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    for _, params, *_ in results:
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("mode", ["naive", "dp"])
def test_matches_single_process(mode: str, world: int, accum: int):
    results = run_ranks(_dp_rank, world, mode, accum)
    _assert_matches_single(results, accum)
    if mode == "dp":
        assert results[0][3] >= 3  # several buckets really were in play


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_moves_two_n_minus_one_over_n_psi_per_step(world: int):
    # Accumulation must not add traffic: one all-reduce of every gradient per optimizer step.
    results = run_ranks(_dp_rank, world, "dp", 2)
    for _, _, snapshot, _ in results:
        assert set(snapshot) == {"all_reduce/dp"}
        moved = snapshot["all_reduce/dp"]["bytes_sent"] / STEPS
        assert moved == pytest.approx(2 * (world - 1) / world * PSI * 4)


@pytest.mark.parametrize("world", [2, 4])
def test_naive_server_moves_two_n_minus_one_psi_per_step(world: int):
    results = run_ranks(_dp_rank, world, "naive", 1)
    server = results[0][2]
    assert server["send/dp"]["bytes_sent"] / STEPS == pytest.approx((world - 1) * PSI * 4)
    assert server["recv/dp"]["bytes_recv"] / STEPS == pytest.approx((world - 1) * PSI * 4)
    for _, _, worker, _ in results[1:]:  # a worker sends its gradient once and gets the average back
        assert worker["send/dp"]["bytes_sent"] / STEPS == pytest.approx(PSI * 4)
        assert worker["recv/dp"]["bytes_recv"] / STEPS == pytest.approx(PSI * 4)


def test_ring_all_reduce_ddp_matches_single_process():
    _assert_matches_single(run_ranks(_dp_rank, 4, "ring", 1), 1)


def _ring_rank(rank: int, world: int, numel: int):
    stats = CommStats()
    axis = Axis.of_group("dp", dist.group.WORLD, stats)
    g = torch.Generator().manual_seed(rank)
    mine = torch.randn(numel, generator=g, dtype=torch.float64)
    expected = mine.clone()
    dist.all_reduce(expected)
    comm.ring_all_reduce(mine, axis)
    sent = stats.total(Op.SEND).bytes_sent
    return mine, expected, sent


@pytest.mark.parametrize("world,numel", [(2, 10), (3, 7), (4, 1000), (4, 2)])
def test_ring_all_reduce_equals_all_reduce(world: int, numel: int):
    for got, expected, sent in run_ranks(_ring_rank, world, numel):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        if numel % world == 0:  # equal chunks: exactly the ring model 2(N-1)/N * bytes
            assert sent == 2 * (world - 1) / world * numel * 8


def _overlap_rank(rank: int, world: int):
    model, _ = _model_and_optimizer()
    axis = Axis.of_group("dp", dist.group.WORLD, CommStats())
    sync = BucketedDataParallel(model, axis, bucket_cap_mb=TINY_BUCKET_MB)
    x, y = global_batches(1, 8)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    launched = [b.grads_ready_at_launch for b in sync.buckets]
    sync.finish()
    return launched, len(sync.params)


def test_ddp_launches_buckets_during_backward():
    # Overlap: the first bucket went out while other parameters still had no gradient.
    for launched, n_params in run_ranks(_overlap_rank, 2):
        assert launched[0] < n_params
        assert launched == sorted(launched)  # strictly in bucket order


class _WithUnused(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(3, 2)


def _unused_rank(rank: int, world: int, mode: str, find_unused: bool):
    torch.manual_seed(0)
    model = _WithUnused()
    axis = Axis.of_group("dp", dist.group.WORLD, CommStats())
    cls = NaiveDataParallel if mode == "naive" else BucketedDataParallel
    sync = cls(model, axis, find_unused_parameters=find_unused)
    x, y = global_batches(1, 8)[0]
    torch.nn.functional.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    try:
        sync.finish()
    except RuntimeError as err:
        return str(err)
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["naive", "dp"])
def test_unused_parameters_are_reported_or_handled(mode: str):
    for message in run_ranks(_unused_rank, 2, mode, False):
        assert "unused.weight" in message and "find_unused_parameters=True" in message
    torch.manual_seed(0)
    ref = _WithUnused()
    x, y = global_batches(1, 8)[0]
    torch.nn.functional.mse_loss(ref(x), y).backward()
    for grads in run_ranks(_unused_rank, 2, mode, True):
        assert grads["unused.weight"] is None and grads["unused.bias"] is None  # as in one process
        for name, p in ref.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(grads[name], p.grad, rtol=RTOL, atol=ATOL)
