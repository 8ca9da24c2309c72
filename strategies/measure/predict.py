"""A run's prediction, as the run store keeps it: the estimator's figures for a strategy string at a world size, with
a pipeline plan's schedule chosen as the run will choose it (`planner.choose_schedule`)."""

from __future__ import annotations

import dataclasses

from strategies.equivalents import equivalent_plan
from strategies.measure.estimate import ModelShape, microbatch_samples
from strategies.measure.peak import GLOO, Workspace
from strategies.measure.planner import GiB, Hardware, choose_schedule, step_time
from strategies.pipeline import messages
from strategies.plan import ParallelPlan
from strategies.runs.schema import MODEL_STATE


def predict_run(label: str, world_size: int, model: dict, global_batch: int, accumulate: int = 1,
                precision: str = "32-true", accelerator: str = "gpu", memory: float | None = None,
                optimizer: str = "adamw", deferred: bool = False) -> dict | None:
    """What the estimator predicts for a run of ``label`` (a plan, or a strategy `equivalents` names that does the
    same as a plan): per-rank memory by category (in rank order), rank 0's bytes per step, the bubble, and for a
    pipeline plan without a schedule the one chosen and why. None when the label has no plan equivalent or the model
    config is not a transformer's. On ``accelerator="cpu"`` the ranks talk over gloo, and the kernels' workspace is
    measured on this host (`calibrate.op_workspace`, with the threads Lightning gives each rank).
    ``memory``: bytes per device the schedule must fit in (default: `device_memory`); ``optimizer``: whose state the
    ranks hold (`estimate.OPTIMIZERS`); ``deferred``: the model is built in configure_model, on meta (the set-up
    peak, `estimate.setup_peaks`)."""
    text = equivalent_plan(label) or label
    try:
        plan = ParallelPlan.parse(text).resolve(world_size)
        shape = dataclasses.replace(ModelShape.from_config(model, batch=global_batch // plan.dp * accumulate),
                                    accumulate=accumulate)
        cpu = accelerator == "cpu"
        workspace = _cpu_workspace(shape, plan, world_size, precision) if cpu else Workspace()
        hw = Hardware(gpus=world_size, memory=memory if memory is not None else device_memory(accelerator, world_size))
        choice = choose_schedule(shape, plan, hw, precision, backend=GLOO if cpu else "nccl", workspace=workspace,
                                 crowded=cpu and messages.crowded(world_size),  # a CPU run's ranks: on this host
                                 optimizer=optimizer)
    except (KeyError, ValueError):
        return None
    est, plan = choice.estimate, choice.plan
    stage = [plan.coordinates(rank)["pp"] for rank in range(world_size)]
    out = {"plan": est.plan, "memory": [est.memory[s] for s in stage], "comm": est.comm, "bubble": est.bubble,
           "peak_at": est.peak_at, "model_states": [sum(est.states[s][k] for k in MODEL_STATE) for s in stage],
           "setup": [(est.setup if deferred else est.setup_whole)[s] for s in stage]}
    timed, basis = _hardware(shape, hw, cpu)
    if timed is not None:  # the chosen schedule's step time, on what is known of this hardware (and the basis)
        out.update(step_time=step_time(shape, est, plan, timed), step_basis=basis)
    return {**out, "schedule_choice": choice.why} if choice.why else out


def _hardware(shape: ModelShape, hw: Hardware, cpu: bool) -> tuple[Hardware | None, str]:
    """What a run's step time is predicted on: on CPU this host's calibration and measured costs at the run's ranks
    where they are cached (`stratpack compare` measures them first; None: not measured, no step time), else the
    planner's GPU defaults. The schedule is chosen on ``hw`` whatever is cached, so a run does the same on every
    host."""
    if not cpu:
        return hw, "the planner's GPU defaults (H100-class, not calibrated)"
    from strategies.measure import calibrate, costs

    cal = calibrate.load(hw.gpus)
    if cal is None:
        return None, ""
    measured = costs.load(hw.gpus, shape.hidden, shape.heads, shape.seq, shape.vocab)
    timed = dataclasses.replace(Hardware.calibrated(cal, hw.memory), costs=measured)
    return timed, "this host's calibration" + (" and measured costs" if measured is not None else "")


def device_memory(accelerator: str, ranks_per_host: int) -> float:
    """Bytes a rank may use: its GPU's, or on CPU this host's memory shared by its ranks."""
    import os

    import torch

    if accelerator != "cpu" and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(ranks_per_host, 1)
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def _cpu_workspace(shape: ModelShape, plan: ParallelPlan, world_size: int, precision: str) -> Workspace:
    """What a block's kernels hold while they run (`calibrate`): the MLP's linear (4h/t columns), the fused attention
    (h/t of the heads, the rank's share of the sequence) and under pp a W's products, at a microbatch's tokens, in the
    dtype ``precision`` computes in, with the threads each rank gets (Lightning: the cores over the ranks, at least
    one)."""
    import os

    import torch

    from strategies.measure.calibrate import attention_workspace, linear_workspace

    samples = max(1, round(microbatch_samples(shape, plan)))
    threads = max(1, (os.cpu_count() or 1) // world_size) if world_size > 1 else None
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else \
        torch.float32
    seq = max(1, shape.seq // plan.cp)
    tokens, wide = samples * seq, 4 * shape.hidden // plan.tp
    # a zero-bubble W's products are the weights' gradients alone: the MLP's two (MKL packs some layouts, not others)
    weights = max(linear_workspace(tokens, shape.hidden, wide, threads, dtype, (2,)),
                  linear_workspace(tokens, wide, shape.hidden, threads, dtype, (2,))) if plan.pp > 1 else 0.0
    return Workspace(linear_workspace(tokens, shape.hidden, wide, threads, dtype),
                     attention_workspace(samples, max(1, shape.heads // plan.tp), seq, shape.hidden // shape.heads,
                                         threads, dtype) if shape.flash_attention else 0.0, weights)


def model_shape(module, batch, accumulate: int = 1) -> ModelShape | None:
    """The transformer shape the estimator needs, from a model's config (a ``config`` attribute on the module or a
    child: the demo's dataclass, a Hugging Face config) and one training ``batch`` (its first tensor: samples, then
    tokens); None where there is no such config."""
    import torch

    from strategies.pipeline.trace import tensors_of

    for child in module.modules():
        config = getattr(child, "config", None)
        fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else (
            config.to_dict() if hasattr(config, "to_dict") else None)
        if not fields:
            continue
        tensors = [t for t in tensors_of(batch) if isinstance(t, torch.Tensor)]
        if tensors and tensors[0].dim() >= 2:
            fields = {**fields, "seq_len": int(tensors[0].shape[1])}
        try:
            shape = ModelShape.from_config(fields, batch=int(tensors[0].shape[0]) * accumulate if tensors else 1)
        except (KeyError, TypeError, ValueError):
            continue
        return dataclasses.replace(shape, accumulate=accumulate)
    return None
