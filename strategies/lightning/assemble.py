"""Which techniques a plan applies to the model, built in the order the strategy keeps them (see `technique`).

Context parallel hooks the attention and positions first (it finds the attention by the projections tensor
parallel then replaces); tensor parallel splits the full, initialised layers; activation checkpointing wraps the
blocks; the replicas of the data-parallel ranks are made equal; the pipeline then replaces the parameters other
stages own by placeholders; last, once Lightning has built the optimizer, data parallel or ZeRO (which shards that
optimizer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.distributed import ReduceOp

from strategies import comm
from strategies.activation_checkpoint import ActivationCheckpointing
from strategies.compile import compile_blocks
from strategies.context_parallel import ContextParallel
from strategies.data_parallel import BucketedDataParallel, GradSync, NaiveDataParallel, broadcast_module
from strategies.deferred import Deferred, shapes_only
from strategies.expert_parallel import ExpertParallel
from strategies.lightning.options import PlanOptions
from strategies.mesh import ParallelMesh
from strategies.pipeline import PipelineParallel
from strategies.pipeline.engine import crowded_host
from strategies.pipeline.stages import find_blocks, measure_times
from strategies.pipeline.trace import trace_forward
from strategies.plan import DataMode, ParallelPlan
from strategies.technique import Technique, outside_all
from strategies.tensor_parallel import TensorParallel, VocabHead, detect_plan
from strategies.tensor_parallel.families import vocab_plan
from strategies.zero import shard_model
from strategies.zero.flat import check_optimizer

UNSPLIT = ("1f1b", "interleaved", "gpipe")  # the schedules without W actions

def model_techniques(model: nn.Module, plan: ParallelPlan, mesh: ParallelMesh, options: PlanOptions,
                     deferred: Deferred | None = None) -> list[Technique]:
    """Context parallel, tensor parallel and activation checkpointing, applied to ``model``; then every replica of
    the data-parallel ranks (dp x cp) starts from the same weights. ``deferred``: the model was built on meta, and
    tensor parallel makes each layer it splits (the rest is made later, `gradient_sync`)."""
    techniques: list[Technique] = []
    if plan.cp > 1:  # first: it finds the attention by its projections, which tensor parallel replaces
        techniques.append(ContextParallel(model, mesh.cp))
    if plan.tp > 1:
        rules = options.tp_plan if options.tp_plan is not None else detect_plan(model)
        if plan.vp and not any(isinstance(style, VocabHead) for style in rules.values()):
            rules = {**vocab_plan(model, plan.tp), **rules}
        with outside_all(techniques):  # its set-up proof runs the modules as one process (no ring SDPA)
            techniques.append(TensorParallel(model, rules, mesh.tp, sequence_parallel=plan.sp, materialise=deferred,
                                            overlap=plan.async_tp))
    broadcast_module(model, mesh.data)  # before the pipeline: its placeholders are not weights to send
    if plan.ep > 1:  # after the broadcast (each ep rank keeps its own experts) and tensor parallel's set-up proof
        techniques.append(ExpertParallel(model, mesh.ep, sharded=plan.data.is_zero, data=mesh.data,
                                         materialise=deferred))
    if plan.recomputes:
        techniques.append(ActivationCheckpointing(model.get_submodule(find_blocks(model, options.pipeline_blocks)),
                                                  model, selective=plan.sac, every=plan.ac_every))
    compiled = compile_blocks(model, options.compile, options.pipeline_blocks)  # after ac: it compiles ac's wrapper
    if compiled is not None:
        techniques.append(compiled)
    return techniques


def check_options(plan: ParallelPlan, options: PlanOptions) -> None:
    """What a plan refuses of the strategy's options, when the strategy is made (in the main process)."""
    if plan.async_tp and options.compile:
        raise ValueError(f"plan '{plan}': async cuts tp's collectives into pieces in eager autograd functions, which "
                         "torch.compile'd blocks would break into graphs around every piece: use compile=False with "
                         "async, or drop async (torchtitan's async TP is a compiler pass on CUDA, not built here)")


def check_precision(precision_plugin: Any, plan: ParallelPlan) -> None:
    """fp16 loss scaling decides per rank whether a step overflowed; under tp or pp each rank holds only part of the
    gradients, so one rank could skip a step the others take. Refused until that decision is shared."""
    if getattr(precision_plugin, "scaler", None) is not None and (plan.tp > 1 or plan.pp > 1):
        raise ValueError(
            f"precision='16-mixed' is not supported with {'tensor' if plan.tp > 1 else 'pipeline'} parallel: each "
            "rank's loss scaler sees only its own part of the gradients, so one rank could skip a step that the "
            "others take and the copies would drift apart. Use precision='bf16-mixed' (no loss scaling) or "
            "'32-true', or a plan without tp and pp (dp and ZeRO share the overflow decision).")


def check_optimization(module: Any, plan: ParallelPlan) -> None:
    """Pipeline parallel runs forward and backward inside its schedule, so a training_step that calls
    manual_backward / optimizer.step itself cannot run under it."""
    if plan.pp > 1 and not getattr(module, "automatic_optimization", True):
        raise ValueError(
            "pipeline parallel runs each microbatch's forward and backward inside its schedule, so manual "
            "optimization (automatic_optimization = False) cannot run under it: use automatic optimization, or a "
            "plan without pp")


def check_router_loss(module: Any, plan: ParallelPlan) -> None:
    """A Hugging Face MoE model with ``output_router_logits`` adds a load-balancing loss from every layer's router
    logits at its head, which under pipeline parallel holds only its own stage's layers."""
    configs = [getattr(m, "config", None) for m in module.modules()]
    if plan.pp > 1 and any(getattr(c, "output_router_logits", False) for c in configs):
        raise ValueError(
            "pipeline parallel with a router load-balancing loss (output_router_logits=True): the last stage would "
            "compute it from its own layers' routers only. Set output_router_logits=False under pp, or a plan "
            "without pp")


def traced_pipeline(model: nn.Module, plan: ParallelPlan, mesh: ParallelMesh, options: PlanOptions,
                    run_forward: Callable[[], None], deferred: Deferred | None = None) -> PipelineParallel:
    """The pipeline cut after watching one forward: the whole model is still on every rank, so ``run_forward()``
    (the user's step on the first microbatch) shows which list of blocks runs and which parameters each side of it
    uses (`trace.trace_forward`); rank 0's trace decides for every rank. Balanced by time: the blocks are timed in
    two more runs, and the slowest rank's figures taken, so that every rank cuts the same way. ``deferred``: the
    model is on meta, and ``run_forward`` runs on meta tensors: the cut is made without a value, and balanced by
    parameters."""
    # Set-up work inside the first step: not a training step's traffic, and the extra forwards leave no trace in the
    # random state or the buffers (a BatchNorm's statistics), so that the steps run as without pp.
    # Eager while tracing: the trace's torch-function mode and hooks are not for dynamo to compile (`compile`).
    with mesh.stats.uncounted(), _unchanged(model), torch.compiler.set_stance("force_eager"):
        with shapes_only(model) if deferred is not None else contextlib.nullcontext():
            traced = trace_forward(model, run_forward, options.pipeline_blocks)
        trace = comm.broadcast_object(traced, mesh.world, src=0)
        weights = None
        if deferred is not None:  # traced on meta (no values, no times): balanced by parameters; tied weights made
            deferred.tied()       # now, as the first stage sends its copy to the last
        elif options.pipeline_balance == "time":
            run_forward()
            times, first, last = measure_times(model, trace.blocks, run_forward)
            agreed = torch.tensor([*times, first, last], dtype=torch.float64, device=next(model.parameters()).device)
            comm.all_reduce(agreed, mesh.world, op=ReduceOp.MAX)
            weights = (agreed[:-2].tolist(), float(agreed[-2]), float(agreed[-1]))
        return PipelineParallel(model, plan, mesh, trace.blocks, weights, trace)


def choose_schedule(module: Any, batch: Any, plan: ParallelPlan, mesh: ParallelMesh, device: torch.device,
                    trainer: Any, techniques: list[Technique]) -> tuple[ParallelPlan, str]:
    """``plan`` (``pp<N>`` without a schedule) with the schedule the estimator predicts fastest among those whose
    memory fits this device (`planner.choose_schedule`), and why; chosen on rank 0 and sent to every rank, so all
    cut the same way. Without a model config to estimate from: 1F1B, saying so."""
    import dataclasses

    from strategies.measure.planner import SCHEDULE_CANDIDATES, Hardware
    from strategies.measure.planner import choose_schedule as choose
    from strategies.measure.predict import device_memory, model_shape
    from strategies.plan import PipelineSchedule

    chosen: tuple[str, str] | None = None
    if mesh.world.index == 0 or comm.rehearsing():  # (a rehearsal's one rank chooses as rank 0 would)
        shape = model_shape(module, batch, trainer.accumulate_grad_batches)
        if shape is None:
            chosen = ("1f1b", "1f1b: no model config to estimate from (a `config` with the model's layers, width, "
                              "heads and vocabulary), so the default; name a schedule in the plan to pick another")
        else:
            cpu = device.type == "cpu"
            hw = Hardware(gpus=mesh.world.size, memory=device_memory("cpu" if cpu else "gpu", mesh.world.size))
            split = not any(t.compiles_blocks for t in techniques)  # compiled blocks keep W in B (`check_split`)
            try:
                picked = choose(shape, plan, hw, str(trainer.precision), backend="gloo" if cpu else "nccl",
                                names=SCHEDULE_CANDIDATES if split else UNSPLIT,
                                crowded=crowded_host(mesh))
                chosen = (picked.plan.schedule.value, picked.why)
            except ValueError as err:  # sent on, so that every rank stops with it (not waits for rank 0)
                chosen = ("", str(err))
    name, why = comm.broadcast_object(chosen, mesh.world, src=0)
    if not name:
        raise ValueError(why)
    rank_zero_info(f"pipeline schedule for '{plan}': {why}")
    return dataclasses.replace(plan, schedule=PipelineSchedule(name), virtual=2 if name == "interleaved" else 1), why


def check_split(plan: ParallelPlan, techniques: list[Technique]) -> None:
    """Zero-bubble schedules split each backward at the blocks' ``F.linear`` calls, which compiled blocks hide."""
    if plan.schedule.splits_backward and any(t.compiles_blocks for t in techniques):
        raise ValueError(
            f"plan '{plan}': {plan.schedule.value} splits each backward into B and W at the blocks' F.linear calls, "
            "which torch.compile'd blocks run inside their graphs; use compile=False (and an uncompiled model), or a "
            f"schedule without W: {', '.join(UNSPLIT)}")


@contextlib.contextmanager
def _unchanged(model: nn.Module) -> Iterator[None]:
    """Restore torch's random state and the module's buffers on exit."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        yield
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])


def gradient_sync(model: nn.Module, optimizers: list, plan: ParallelPlan, mesh: ParallelMesh, options: PlanOptions,
                  fp16_scaler: bool, deferred: Deferred | None = None, experts: set[str] = frozenset()) -> GradSync:
    """The data-parallel technique of ``plan``'s data mode over the mesh's dp x cp ranks (`ParallelMesh.data`), for
    the optimizers built. ``deferred``: what is still on meta is made here, by ZeRO-3 one unit at a time (its
    shard kept), else whole. ``experts``: the parameters expert parallel split, which ZeRO shards over the ranks
    holding the same experts (`ParallelMesh.edp`) and `dp` leaves to `expert_sync`."""
    axis, find_unused = mesh.data, options.find_unused_parameters
    dense = (lambda name: name not in experts) if experts else None
    if plan.data.is_zero:
        if len(optimizers) != 1:
            raise ValueError(
                f"ZeRO shards one optimizer, but configure_optimizers returned {len(optimizers)}; "
                "use one optimizer (with several param groups if needed), or the 'dp' plan"
            )
        check_optimizer(optimizers[0])  # refused at one rank too, so that the plan scales as it is written
        if axis.size == 1 and not plan.offload:
            if deferred is not None:
                deferred.rest()
            # One replica: nothing to shard or reduce, so the flat copies and their hooks would be pure cost (the
            # same single-process layout in checkpoints; offload still needs its host-side optimizer).
            rank_zero_info(f"{plan}: the data-parallel axis has one rank, so ZeRO has nothing to shard; the "
                           "gradients stay where backward put them, as under 'dp'")
            return BucketedDataParallel(model, axis, find_unused_parameters=find_unused)
        sync = shard_model(model, optimizers[0], axis, stage=plan.data.stage, offload=plan.offload,
                           bucket_cap_mb=options.bucket_cap_mb, find_unused_parameters=find_unused,
                           units=options.zero3_units, materialise=deferred,
                           axis_of=dict.fromkeys(experts, mesh.edp))
        sync.sync_nonfinite = fp16_scaler  # fp16: one rank's overflow skips the step everywhere
        return sync
    if deferred is not None:
        deferred.rest()
    if plan.data is DataMode.NAIVE:
        return NaiveDataParallel(model, axis, server=options.server_rank, find_unused_parameters=find_unused)
    return BucketedDataParallel(model, axis, bucket_cap_mb=options.bucket_cap_mb, find_unused_parameters=find_unused,
                                ring=options.ring_all_reduce, include=dense)


def gradient_syncs(model: nn.Module, optimizers: list, plan: ParallelPlan, mesh: ParallelMesh,
                   options: PlanOptions, techniques: list[Technique], fp16_scaler: bool,
                   deferred: Deferred | None = None) -> list[GradSync]:
    """`gradient_sync` for the parameters the ``techniques`` applied leave to the data-parallel ranks, and under `dp`
    `expert_sync` for those expert parallel split (ZeRO shards them over their own axis itself)."""
    experts = {name for t in techniques if isinstance(t, ExpertParallel) for name in t.expert_names()}
    syncs = [gradient_sync(model, optimizers, plan, mesh, options, fp16_scaler, deferred, experts)]
    if experts and not plan.data.is_zero:
        syncs.append(expert_sync(model, mesh, options, experts))
    return syncs


def expert_sync(model: nn.Module, mesh: ParallelMesh, options: PlanOptions, experts: set[str]) -> GradSync:
    """Under `dp`, the experts' gradients averaged over the ranks that hold the same experts (`ParallelMesh.edp`).
    Every local expert weight gets a gradient each backward, zeros where no row came (`dispatch.Dispatch._link`)."""
    return BucketedDataParallel(model, mesh.edp, bucket_cap_mb=options.bucket_cap_mb,
                                find_unused_parameters=options.find_unused_parameters, include=experts.__contains__)
