"""The implementations `stratpack bench` measures, as a table of small builders: ours and the peers'.

Each builder takes the workload, its plain model, the bench config and the optimizer's arguments, applies one
implementation to the model on the process group `strategies.testing.run_ranks` started, and returns the step:
``step(batch)`` runs forward, backward and the optimizer on one ``(inputs, targets)`` batch. Every side uses the
same model, data and AdamW, in the same plain loop (no Lightning), so only the engines differ.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from strategies.pipeline.schedules import SCHEDULES as PIPELINE_SCHEDULES

Step = Callable[[Any], None]

MICROBATCHES = 4  # per step in the pipeline pairs (at least 2 x pp: DualPipeV's least)
VIRTUAL = 2  # stages per rank in the interleaved pair
HALF = "_bf16"  # an implementation under param_dtype=bf16 (ours `ParamDtype`, FSDP2's MixedPrecisionPolicy)


def _plain(model: nn.Module, opt: torch.optim.Optimizer, workload: Any, sync: Any = None, half: bool = False) -> Step:
    """One optimizer step per batch: forward (``half``: under bf16 autocast, what Lightning's ``bf16-mixed`` runs a
    step in), backward outside it, then ``sync``'s (our gradient sync's) finish before the step and after_step after."""
    def step(batch: Any) -> None:
        x, y = batch
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
            loss = workload.loss(model(x), y)
        loss.backward()
        if sync is not None:
            sync.finish()
        opt.step()
        if sync is not None:
            sync.after_step()
        opt.zero_grad(set_to_none=True)
    return step


def _world_axis(name: str) -> Any:
    from strategies.comm import Axis, CommStats

    return Axis.of_group(name, dist.group.WORLD, CommStats())


def ours_data_parallel(stage: int) -> Callable[..., Step]:
    """Our DDP (stage 0) or ZeRO-``stage`` over every rank."""
    def build(workload: Any, model: nn.Module, cfg: Any, opt_kwargs: dict) -> Step:
        from strategies.data_parallel import BucketedDataParallel
        from strategies.zero import shard_model

        axis = _world_axis("dp")
        opt = torch.optim.AdamW(model.parameters(), **opt_kwargs)
        sync = BucketedDataParallel(model, axis) if stage == 0 else shard_model(model, opt, axis, stage)
        return _plain(model, opt, workload, sync)
    return build


def ours_zero3_bf16(workload: Any, model: nn.Module, cfg: Any, opt_kwargs: dict) -> Step:
    """Our ZeRO-3 under the strategy's ``param_dtype=bf16`` (`mixed_precision.ParamDtype`): the units gathered in bf16,
    the gradients reduce-scattered in float32."""
    from strategies.mixed_precision import ParamDtype
    from strategies.zero import shard_model

    opt = torch.optim.AdamW(model.parameters(), **opt_kwargs)
    sync = shard_model(model, opt, _world_axis("dp"), 3)
    ParamDtype(model, torch.bfloat16).gathered(sync.compute_in(torch.bfloat16), sync.half_weight)
    return _plain(model, opt, workload, sync, half=True)


def fsdp2_bf16(workload: Any, model: nn.Module, cfg: Any, opt_kwargs: dict) -> Step:
    """torch's FSDP2 as `fsdp2`, with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, under the same
    autocast as ours (which computes norms, softmax and the loss in float32 on both sides)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from strategies.pipeline.stages import find_blocks

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.get_submodule(find_blocks(model)):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return _plain(model, torch.optim.AdamW(model.parameters(), **opt_kwargs), workload, half=True)


def ours_tensor_parallel(workload: Any, model: nn.Module, cfg: Any, opt_kwargs: dict) -> Step:
    """Every rank on the tp axis: the whole world is one tensor-parallel group."""
    from strategies.tensor_parallel import apply_plan, detect_plan

    apply_plan(model, detect_plan(model), _world_axis("tp"))
    return _plain(model, torch.optim.AdamW(model.parameters(), **opt_kwargs), workload)


def ours_sequence_parallel(overlap: bool) -> Callable[..., Step]:
    """Tensor parallel with sequence parallel over every rank; ``overlap``: its collectives by pieces beside the
    matmuls (async TP, `tensor_parallel.overlap`)."""
    def build(workload: Any, model: nn.Module, cfg: Any, opt_kwargs: dict) -> Step:
        from strategies.tensor_parallel import apply_plan, detect_plan
        from strategies.tensor_parallel.plans import split_params
        from strategies.tensor_parallel.sequence_parallel import SequenceParallel

        axis = _world_axis("tp")
        found = apply_plan(model, detect_plan(model), axis)
        seq = SequenceParallel(model, found, set(split_params(model, found)), axis, overlap=overlap)
        return _plain(model, torch.optim.AdamW(model.parameters(), **opt_kwargs), workload, _PartialSums(seq))
    return build


class _PartialSums:
    """The norms' partial gradients summed over tp before the step (what the technique's `finish_backward` does)."""

    def __init__(self, seq: Any) -> None:
        self.seq = seq

    def finish(self) -> None:
        self.seq.reduce_partial_grads()

    def after_step(self) -> None:
        pass


def ours_pipeline(schedule: str) -> Callable[..., Step]:
    """Our pipeline engine in a plain loop: the step function is the loss. Cut after one traced forward of the
    first microbatch, as the Lightning strategy cuts it (`lightning.assemble.traced_pipeline`)."""
    def build(workload: Any, model: nn.Module, cfg: Any, opt_kwargs: dict) -> Step:
        from strategies.mesh import ParallelMesh
        from strategies.pipeline import PipelineParallel
        from strategies.pipeline.stages import split_microbatches
        from strategies.pipeline.trace import trace_forward
        from strategies.plan import ParallelPlan

        plan = ParallelPlan.parse(pipeline_plan(schedule, dist.get_world_size()))
        x, y = split_microbatches(workload.bench_batches(cfg, 0)[0], plan.microbatches)[0]
        trace = trace_forward(model, lambda: workload.loss(model(x), y))
        engine = PipelineParallel(model, plan.resolve(dist.get_world_size()), ParallelMesh(plan, "cpu"), trace.blocks,
                                  trace=trace)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **opt_kwargs)

        def step(batch: Any) -> None:
            engine.train_step(batch, 0, lambda mb, i: workload.loss(model(mb[0]), mb[1]), torch.device("cpu"))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    return build


def microbatches(world_size: int) -> int:
    return max(MICROBATCHES, 2 * world_size)


def pipeline_plan(schedule: str, world_size: int) -> str:
    """The plan of our pipeline side (and the peer's twin): every rank a stage (two for interleaved and the V
    schedules), `microbatches` of them per step."""
    virtual = f"_v{VIRTUAL}" if schedule == "interleaved" else ""
    return f"pp{world_size}_{schedule}{virtual}_mb{microbatches(world_size)}"


def plan_of(impl: str, world_size: int) -> str:
    """The plan whose estimator figures stand beside ``impl``'s measurements (ours, or the peer's twin)."""
    from strategies.equivalents import PEERS

    impl = impl.removesuffix(HALF)  # (its precision: `bench.predict`)
    base = impl.removeprefix("torch_")
    if base.startswith("pp_"):
        return pipeline_plan(base[3:], world_size)
    if base in ("tp_sp", "tp_sp_async"):
        return f"tp{world_size}_sp" + ("_async" if base.endswith("async") else "")
    twin = PEERS.get(impl, impl)
    return f"{twin}{world_size}" if twin in ("tp", "ep") else twin


def ours_expert_parallel(workload: Any, model: nn.Module, cfg: Any, opt_kwargs: dict) -> Step:
    """Every rank on the ep axis: each MoE layer's experts split over all of them, the rest our DDP over all."""
    from strategies.data_parallel import BucketedDataParallel
    from strategies.expert_parallel import ExpertParallel

    experts = ExpertParallel(model, _world_axis("ep")).expert_names()
    sync = BucketedDataParallel(model, _world_axis("dp"), include=lambda name: name not in experts)
    return _plain(model, torch.optim.AdamW(model.parameters(), **opt_kwargs), workload, sync)


def deepspeed_moe(workload: Any, model: nn.Module, cfg: Any, opt_kwargs: dict) -> Step:
    """DeepSpeed-MoE in place of the demo GPT's MoE layers: the same router and experts' weights (each rank its E/n,
    as ours), dropless (``drop_tokens=False``), in DeepSpeed's engine (ZeRO off). Not the same arithmetic: DeepSpeed's
    top-2 gate draws the second expert from Gumbel-noised logits in training; the speed pair compares the layer's
    work, not its numbers."""
    from deepspeed.moe.layer import MoE

    _deepspeed_ranks()
    rank, world = dist.get_rank(), dist.get_world_size()
    for block in model.blocks:
        block.mlp = _DeepSpeedMoE(block.mlp, MoE, world, rank)
    return _deepspeed_step(workload, model, cfg, opt_kwargs, {})


class _DeepSpeedMoE(nn.Module):
    """DeepSpeed's MoE layer holding ``ours``' (`demos.gpt.MoE`) gate and this rank's experts, returning its output
    only (its load-balancing loss is left out, as ours trains without one)."""

    def __init__(self, ours: nn.Module, moe_class: type, world: int, rank: int) -> None:
        super().__init__()
        width, experts = ours.gate.in_features, ours.experts.num_experts
        expert = nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.GELU(), nn.Linear(4 * width, width,
                                                                                             bias=False))
        self.moe = moe_class(hidden_size=width, expert=expert, num_experts=experts, ep_size=world, k=ours.top_k,
                             drop_tokens=False, use_rts=False)
        per = experts // world
        with torch.no_grad():
            self.moe.deepspeed_moe.gate.wg.weight.copy_(ours.gate.weight)
            for k, local in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                local[0].weight.copy_(ours.experts.fc[rank * per + k])
                local[2].weight.copy_(ours.experts.proj[rank * per + k])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0]


def _deepspeed_ranks() -> None:
    """DeepSpeed reads its ranks from the launcher's environment; run_ranks started the group itself."""
    import deepspeed

    os.environ.update(LOCAL_RANK=str(dist.get_rank()), RANK=str(dist.get_rank()),
                      WORLD_SIZE=str(dist.get_world_size()))
    deepspeed.init_distributed(dist_backend="gloo")


def torch_ddp(workload: Any, model: nn.Module, cfg: Any, opt_kwargs: dict) -> Step:
    ddp = nn.parallel.DistributedDataParallel(model)
    return _plain(ddp, torch.optim.AdamW(ddp.parameters(), **opt_kwargs), workload)


def fsdp2(workload: Any, model: nn.Module, cfg: Any, opt_kwargs: dict) -> Step:
    """torch's FSDP2: ``fully_shard`` on every block, then on the model."""
    from torch.distributed.fsdp import fully_shard

    from strategies.pipeline.stages import find_blocks

    for block in model.get_submodule(find_blocks(model)):
        fully_shard(block)
    fully_shard(model)
    return _plain(model, torch.optim.AdamW(model.parameters(), **opt_kwargs), workload)


def dtensor_tp(workload: Any, model: nn.Module, cfg: Any, opt_kwargs: dict) -> Step:
    """torch's DTensor ``parallelize_module`` on every block, splitting the layers our detected plan splits (a
    fused qkv is split as one block here, which costs the same compute and traffic; the per-rank head layout
    differs, which only matters for the numbers)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from strategies.pipeline.stages import find_blocks
    from strategies.tensor_parallel import Colwise, detect_plan

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    style = {pattern.removeprefix("*."): ColwiseParallel() if isinstance(rule, Colwise) else RowwiseParallel()
             for pattern, rule in detect_plan(model).items()}
    for block in model.get_submodule(find_blocks(model)):
        parallelize_module(block, mesh, style)
    return _plain(model, torch.optim.AdamW(model.parameters(), **opt_kwargs), workload)


def deepspeed_zero(stage: int) -> Callable[..., Step]:
    def build(workload: Any, model: nn.Module, cfg: Any, opt_kwargs: dict) -> Step:
        _deepspeed_ranks()
        return _deepspeed_step(workload, model, cfg, opt_kwargs, {"zero_optimization": {"stage": stage}})
    return build


def _deepspeed_step(workload: Any, model: nn.Module, cfg: Any, opt_kwargs: dict, extra: dict) -> Step:
    """``model`` in DeepSpeed's engine (its config plus ``extra``), AdamW, one step per batch."""
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": cfg.batch_per_rank, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, **extra}
    opt = torch.optim.AdamW(model.parameters(), **opt_kwargs)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(batch: Any) -> None:
        x, y = batch
        engine.backward(workload.loss(engine(x), y))
        engine.step()
    return step


def torch_pipeline(schedule: str) -> Callable[..., Step]:
    """``torch.distributed.pipelining`` on the same cut as ours: the blocks split as our planner splits them, the
    workload's stage modules around them, each stage on the rank our schedule's table puts it (looped, or a V)."""
    def build(workload: Any, model: nn.Module, cfg: Any, opt_kwargs: dict) -> Step:
        from torch.distributed import pipelining as tp

        from strategies.pipeline.schedules import build as table_of
        from strategies.pipeline.schedules import owners
        from strategies.pipeline.stages import plan_stages

        rank, world = dist.get_rank(), dist.get_world_size()
        where = owners(table_of(schedule, world, microbatches(world), VIRTUAL if schedule == "interleaved" else 1))
        stages = len(where)
        layout = plan_stages(model, stages)
        indices = sorted(s for s, r in where.items() if r == rank)
        if schedule == "zbv":
            indices = [rank, 2 * world - 1 - rank]  # torch's ZB-V takes the V's two stages in this order
        mine = [workload.pipeline_stage(model, layout.ranges[s], s == 0, s == stages - 1) for s in indices]
        pipe = [tp.PipelineStage(m, s, stages, torch.device("cpu")) for m, s in zip(mine, indices)]
        kind = {"1f1b": tp.Schedule1F1B, "gpipe": tp.ScheduleGPipe, "interleaved": tp.ScheduleInterleaved1F1B,
                "zb1p": tp.ScheduleInterleavedZeroBubble, "zbv": tp.ScheduleZBVZeroBubble,
                "dualpipev": getattr(tp, "ScheduleDualPipeV", None)}[schedule]
        single = schedule in ("1f1b", "gpipe")
        runner = kind(pipe[0] if single else pipe, n_microbatches=microbatches(world), loss_fn=workload.loss)
        opt = torch.optim.AdamW([p for m in mine for p in m.parameters()], **opt_kwargs)
        holds_first, holds_last = 0 in indices, stages - 1 in indices

        def step(batch: Any) -> None:
            x, y = batch
            runner.step(*([x] if holds_first else []), **({"target": y} if holds_last else {}))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    return build


ENGINES: dict[str, Callable[..., Step]] = {
    "dp": ours_data_parallel(0), "zero1": ours_data_parallel(1), "zero2": ours_data_parallel(2),
    "zero3": ours_data_parallel(3), "tp": ours_tensor_parallel,
    "tp_sp": ours_sequence_parallel(False), "tp_sp_async": ours_sequence_parallel(True),
    "zero3_bf16": ours_zero3_bf16, "fsdp2_bf16": fsdp2_bf16,
    "torch_ddp": torch_ddp, "fsdp2": fsdp2, "dtensor_tp": dtensor_tp, "deepspeed1": deepspeed_zero(1),
    "deepspeed2": deepspeed_zero(2), "deepspeed3": deepspeed_zero(3), "ep": ours_expert_parallel,
    "deepspeed_moe": deepspeed_moe,
    **{f"pp_{s}": ours_pipeline(s) for s in PIPELINE_SCHEDULES},
    **{f"torch_pp_{s}": torch_pipeline(s) for s in PIPELINE_SCHEDULES},
}


def build_engine(impl: str, workload: Any, model: nn.Module, cfg: Any) -> Step:
    """The step function of implementation ``impl`` (a key of `ENGINES`)."""
    if impl not in ENGINES:
        raise ValueError(f"unknown implementation {impl!r}; known: {', '.join(ENGINES)}")
    return ENGINES[impl](workload, model, cfg, dict(lr=cfg.lr, betas=(0.9, 0.95)))
