"""Gloo's program (`pipeline.messages.early_receives`: a step's receives posted together, strict p2p mode off) gives
the numbers NCCL's program gives (strict mode on), bit for bit, for every schedule: the same tensors reach the same
buffers, only when they arrive differs. From the second step on, the step's shapes known (the first runs with
headers, in NCCL's order either way)."""

from __future__ import annotations

import os

import pytest
import torch

from strategies import comm
from strategies.pipeline.schedules import SCHEDULES
from strategies.testing import run_ranks

STEPS = 3


def _train(plan_text: str, strict: str) -> tuple[list[float], dict[str, torch.Tensor], bool]:
    import torch.distributed as dist

    from demos.workload import GPT_WORKLOAD as workload
    from strategies.cli.bench import BenchConfig
    from strategies.mesh import ParallelMesh
    from strategies.pipeline import PipelineParallel
    from strategies.pipeline.stages import split_microbatches
    from strategies.pipeline.trace import trace_forward
    from strategies.plan import ParallelPlan

    os.environ[comm.STRICT_ENV] = strict
    world = dist.get_world_size()
    cfg = BenchConfig(world_size=world, steps=STEPS, n_layer=2 * world, n_embd=32, n_head=2, seq_len=16,
                      batch_per_rank=8)
    model, batches = workload.bench_model(cfg), workload.bench_batches(cfg, 0)
    plan = ParallelPlan.parse(plan_text).resolve(world)
    x, y = split_microbatches(batches[0], plan.microbatches)[0]
    trace = trace_forward(model, lambda: workload.loss(model(x), y))
    pipe = PipelineParallel(model, plan, ParallelMesh(plan, "cpu"), trace.blocks, trace=trace)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses, ran, run = [], [], pipe.runner.run
    pipe.runner.run = lambda program, *args: ran.append(program) or run(program, *args)  # the program each step ran
    for batch in batches:
        loss = pipe.train_step(batch, 0, lambda mb, i: workload.loss(model(mb[0]), mb[1]), torch.device("cpu"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    # the steps of the program it ran that post a receive: one after the other with no compute between them, or
    # spread over the step
    posting = [i for i, s in enumerate(ran[-1]) if any(not t.send for t in s.group)]
    together = all(ran[-1][i].action is None for i in posting)
    state = pipe.full_state_dict()
    pipe.teardown(healthy=True)
    return losses, state, together and posting == list(range(posting[0], posting[0] + len(posting)))


def _both(rank: int, world: int, plan: str) -> tuple:
    return _train(plan, "60"), _train(plan, "0")


@pytest.mark.parametrize("world, schedule", [(2, s) for s in SCHEDULES] + [(4, "1f1b")],
                         ids=[f"pp2_{s}" for s in SCHEDULES] + ["pp4_1f1b"])
def test_gloo_s_program_gives_nccl_s_numbers_bit_for_bit(world: int, schedule: str):
    virtual = "_v2" if schedule == "interleaved" else ""
    plan = f"pp{world}_{schedule}{virtual}_mb{2 * world}"
    (strict, strict_state, strict_early), (loose, loose_state, loose_early) = run_ranks(_both, world, plan)[0]
    assert not strict_early and loose_early  # NCCL's program in strict mode, the receives together without it
    assert strict == loose and len(set(strict)) == STEPS, (strict, loose)  # the loss moved: it trained
    assert strict_state.keys() == loose_state.keys()
    for name, value in strict_state.items():
        assert torch.equal(value, loose_state[name]), name
