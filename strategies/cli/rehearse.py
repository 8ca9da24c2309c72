"""``stratpack rehearse PLAN --world-size N``: one rank of an N-rank job, run alone on this machine with no data.

The rank's set-up and training steps run through the same strategy, techniques and pipeline programs as a real
run, on meta tensors (`strategies.lightning.rehearsal`): every collective and message is counted as it would be
sent, and every byte its tensors would take is counted as torch makes and frees them (`measure.meta_heap`). The
report gives, per rank, memory by category (parameters, gradients, optimizer, host, saved activations, the rest of
the step's peak) and the set-up and steady peaks, bytes per collective and axis, each beside the estimator's; and
for a pipeline, its programs at this size checked under NCCL's rules (`pipeline.messages.check`). The rehearsed
ranks are also written to the run store (``--runs-dir``) as one run of kind "rehearsal" (`store_rehearsal`), which
the dashboard's Memory and Communication pages show beside real runs, marked as rehearsed.

``--target cpu`` (the default up to 8 ranks) rehearses this host's gloo ranks: gloo's buffers and the matrix
library's workspace measured here; ``--target cuda`` (the default above) a GPU job's NCCL ranks (no backend buffers,
no CPU workspace).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, replace
from typing import Any

from strategies.cli.anchors import run_anchors

MiB = 2**20
CPU_HOST_RANKS = 8  # the most gloo ranks the pack runs on one CPU host (its tests' and commands' largest jobs)
CATEGORIES = ("params", "grads", "optimizer", "host", "activations")  # the estimator's names (`runs.MEMORY_CATEGORIES`)


def rehearse_rank(config: Any, rank: int, world_size: int, target: str = "cpu", real: bool = False,
                  save: bool = False) -> dict[str, Any]:
    """Rehearse rank ``rank`` of a ``world_size``-rank run of ``config`` (a `train.RunConfig`; the model is built in
    configure_model, on meta): this rank's memory figures as the monitor reads them, its communication per step, and
    the estimator's figures for the same run. ``real``: the rank's compute on real tensors of ``target``'s device
    (its allocator's peak, its step time), not on meta. ``save``: a checkpoint saved by slice at the end, and a
    second fit resumed from one (`RehearsalStrategy.rehearse_save`, ``resume``): their peaks in ``checkpoint``."""
    import lightning as L

    from strategies.cli.train import _loader, _model_config, estimator_precision
    from strategies.cli.workload import find_workload
    from strategies.measure.predict import predict_run

    config = replace(config, configure_model=True, devices=world_size, num_nodes=1)
    L.seed_everything(config.seed, workers=True, verbose=False)
    module, dataset = find_workload(config.workload).lightning(config)
    model = _model_config(module, config.seq_len)
    predicted = predict_run(config.strategy, world_size, model, config.batch_size, config.accumulate,
                            estimator_precision(config), "cpu" if target == "cpu" else "gpu",
                            optimizer=config.optimizer, deferred=True)
    trainer, monitor, heap = _trainer(config, rank, world_size, target, real, save=save and not real)
    start = time.perf_counter()
    _fit(trainer, heap, target, real, module, _loader(config, dataset))
    summary = monitor.summary
    checkpoint = dict(trainer.strategy.checkpoint_peaks) if save and not real else None
    if checkpoint is not None:  # the same rank in a fit resumed from a checkpoint by slice, from its set-up on
        checkpoint.update(_rehearse_resume(config, rank, world_size, target))
    return {"rank": rank, "world_size": world_size, "label": config.strategy,
            "plan": str(trainer.strategy.resolved_plan), "target": target, "real": real, "config": asdict(config),
            "model": model, "predicted": predicted, "seconds": time.perf_counter() - start,
            "num_params": getattr(trainer.strategy, "built_num_params", None),
            "memory_bytes": summary["memory_bytes"], "comm_per_step": summary["comm_per_step"],
            "device_peak": summary["memory_bytes"].get("heap_peak", 0),  # (a GPU's heap holds the device's alone)
            "checkpoint": checkpoint,
            **({k: summary.get(k) for k in ("step_time_s", "tokens_per_s", "mfu")} if real else {})}


def _rehearse_resume(config: Any, rank: int, world_size: int, target: str) -> dict[str, int]:
    """Rank ``rank`` in a fit resumed from a checkpoint by slice (`RehearsalStrategy.resume`), to its first step:
    the peak of the resume's reads (``resume``) and of its set-up (``resumed_setup``)."""
    from strategies.cli.train import _loader
    from strategies.cli.workload import find_workload

    module, dataset = find_workload(config.workload).lightning(config)
    trainer, monitor, heap = _trainer(config, rank, world_size, target, resume=True)
    _fit(trainer, heap, target, False, module, _loader(replace(config, steps=1), dataset))
    return {**trainer.strategy.checkpoint_peaks,
            "resumed_setup": monitor.summary["memory_bytes"].get("setup_peak", 0)}


def _fit(trainer: Any, heap: Any, target: str, real: bool, module: Any, loader: Any) -> None:
    """The rehearsal's fit (on meta, or on real tensors), leaving torch's fake process group after it."""
    import warnings

    from strategies.lightning.rehearsal import leave_fake_world

    try:
        with warnings.catch_warnings(), _running(heap, target, real):
            warnings.filterwarnings("ignore", ".*does not have many workers.*|.*val_dataloader.*|.*LeafSpec.*")
            trainer.fit(module, loader)
    finally:
        leave_fake_world()


def _predicted_peak(mine: dict[str, float], target: str) -> float:
    """The estimator's steady peak on the device for one rank's figures: on a GPU without offload's host memory."""
    return sum(mine.get(k, 0) for k in (*CATEGORIES, "temporaries") if k != "host" or target == "cpu")


def _running(heap: Any, target: str, real: bool) -> contextlib.AbstractContextManager:
    """Around the rehearsal's fit on meta: attention and the optimizers as ``target``'s kernels would run them,
    every storage counted (`meta_heap`), autocast on meta. (On real tensors: nothing.)"""
    from strategies.lightning.rehearsal import target_kernels
    from strategies.tensors import MetaAutocast

    stack = contextlib.ExitStack()
    if not real:
        for context in (target_kernels(target), heap.tracking(), MetaAutocast(target=target)):
            stack.enter_context(context)
    return stack


def _trainer(config: Any, rank: int, world_size: int, target: str, real: bool = False, save: bool = False,
             resume: bool = False) -> tuple[Any, Any, Any]:
    """A Trainer for the rehearsal of ``rank``, its monitor, and the monitor's heap: on meta `meta_heap.MetaHeap`;
    on real tensors the CUDA allocator's counters (`memory.CudaHeap`) or this CPU's heap, sampled (`HeapSampler`),
    with the first step left out of the step time (it cuts a pipeline). ``save``: a checkpoint by slice rehearsed at
    the end of the fit; ``resume``: the fit resumes from one."""
    import lightning as L

    from strategies.lightning.rehearsal import RehearsalStrategy
    from strategies.measure.memory import CudaHeap, HeapSampler
    from strategies.measure.meta_heap import MetaHeap
    from strategies.measure.monitor import StrategyMonitor

    if not real:
        # a GPU's heap holds the device's memory alone (offload's host copies counted apart), a CPU's all of it
        heap: Any = MetaHeap(workspace=_cpu_workspace(world_size) if target == "cpu" else None,
                             device_only=target == "cuda")
    else:
        heap = CudaHeap() if target == "cuda" else HeapSampler()
    monitor = StrategyMonitor(warmup_steps=int(real), store=False, label=config.strategy, heap=heap)
    from strategies.cli.train import param_dtype

    strategy = RehearsalStrategy(config.strategy, rank=rank, world_size=world_size, param_dtype=param_dtype(config),
                                 backend="gloo" if target == "cpu" else "nccl",
                                 device=({"cuda": "cuda:0"}.get(target, target) if real else None), resume=resume,
                                 save_at_end=save)
    strategy.heap = heap
    trainer = L.Trainer(accelerator="cuda" if real and target == "cuda" else "cpu", devices=1, strategy=strategy,
                        max_steps=config.steps, accumulate_grad_batches=config.accumulate,
                        precision=config.precision, gradient_clip_val=config.gradient_clip_val, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[monitor], limit_val_batches=0)
    return trainer, monitor, heap



def _cpu_workspace(world_size: int):
    """The kernels' working memory (`calibrate.host_workspace`) with the threads a real run's rank gets (Lightning:
    the cores over the ranks, at least one)."""
    from strategies.measure.calibrate import host_workspace

    return host_workspace(max(1, (os.cpu_count() or 1) // world_size) if world_size > 1 else None)


def roles(plan: str, world_size: int) -> list[int]:
    """One rank of each distinct role: per pipeline stage, its first rank and its last (the last data-parallel
    shard, which holds the padding; the last tensor-parallel slice), in rank order."""
    from strategies.plan import ParallelPlan

    resolved = ParallelPlan.parse(plan).resolve(world_size)
    stages: dict[int, list[int]] = {}
    for rank in range(world_size):
        stages.setdefault(resolved.coordinates(rank)["pp"], []).append(rank)
    return sorted({r for ranks in stages.values() for r in (ranks[0], ranks[-1])})


def checked_programs(plan: str) -> int | None:
    """The pipeline's programs for ``plan`` (resolved, its schedule known) checked under NCCL's rules, with and
    without headers: the rounds they take (None without pp). Raises where a rank would wait forever."""
    from strategies.pipeline import messages, schedules
    from strategies.plan import ParallelPlan

    resolved = ParallelPlan.parse(plan)
    if resolved.pp == 1:
        return None
    tables = schedules.build(resolved.schedule.value, resolved.pp, resolved.microbatches, resolved.virtual,
                             resolved.group)
    progs, known, _ = messages.as_run(tables, resolved.pp)
    return messages.check(progs) + messages.check(known)


def report(results: list[dict[str, Any]]) -> str:
    """Each rehearsed rank's memory and communication beside the estimator's, then the worst rank."""
    lines = [line for r in results for line in _rank_lines(r)]
    worst = max(results, key=lambda r: r["device_peak"])
    lines.append(f"worst: rank {worst['rank']}, steady peak on the device {worst['device_peak'] / MiB:.2f} MiB")
    return "\n".join(lines)


def _rank_lines(r: dict[str, Any]) -> list[str]:
    memory, predicted = r["memory_bytes"], r["predicted"] or {}
    mine = (predicted.get("memory") or [{}] * r["world_size"])[r["rank"]]
    setup = (predicted.get("setup") or [0.0] * r["world_size"])[r["rank"]]
    peak = _predicted_peak(mine, r["target"])
    rows = [(key, memory.get(key if key != "activations" else "activations_peak", 0), mine.get(key, 0))
            for key in (*CATEGORIES, "temporaries")]
    rows += [("steady peak", memory.get("heap_peak", 0), peak), ("set-up peak", memory.get("setup_peak", 0), setup)]
    if r.get("checkpoint"):  # the estimator's: a save holds the states (a GPU's copies are the host's); a resume
        states = sum(mine.get(k, 0) for k in ("params", "grads", "optimizer", "host") if k != "host" or r["target"]
                     == "cpu")  # reads in place, after set-up
        saved = r["checkpoint"]
        rows += [("save peak", saved.get("save", 0), states), ("resume's reads", saved.get("resume", 0), states),
                 ("resumed set-up", saved.get("resumed_setup", 0), setup)]
    how = f"{r['target']}, real tensors" if r.get("real") else r["target"]
    lines = [f"rank {r['rank']} of {r['world_size']}, {r['plan']} ({how}): rehearsed in {r['seconds']:.1f} s",
             "  MiB            rehearsed  estimator"]
    lines += [f"  {name:<14} {got / MiB:>10.2f} {expected / MiB:>10.2f}" for name, got, expected in rows]
    for key, rec in sorted(r["comm_per_step"].items()):
        moved = rec["bytes_sent"] or rec["bytes_recv"]
        lines.append(f"  {key:<20} {moved / MiB:>10.3f} MiB per step in {rec['calls']:g} calls")
    if r.get("real"):
        mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") else ""
        lines.append(f"  step time {r['step_time_s']:.3f} s: this rank's compute, nothing sent{mfu}")
    if r.get("rounds") is not None:
        lines.append(f"  pipeline programs: checked under NCCL's rules ({r['rounds']} rounds)")
    return lines


def store_rehearsal(results: list[dict[str, Any]], root: str | None, comparison: str | None) -> str:
    """Write the rehearsed ranks into the run store as one run of the job, as the monitor writes a real run: meta
    (``kind`` "rehearsal", the ranks rehearsed, the target, the worst; the estimator's figures as ``predicted``), one
    record per rehearsed rank (its memory and bytes per step), and a summary whose ``comm_per_step`` and
    ``memory_bytes`` are the lowest rehearsed rank's (a real run's are rank 0's) and whose ``memory_bytes_per_rank``
    is null for the ranks not rehearsed. Returns the run's folder."""
    from strategies import runs
    from strategies.plan import ParallelPlan

    results = sorted(results, key=lambda r: r["rank"])
    first, world = results[0], results[0]["world_size"]
    run_id = runs.new_run_id(f"{first['label']}-rehearsal")
    rehearsal = {"ranks": [r["rank"] for r in results], "target": first["target"],
                 "worst_rank": max(results, key=lambda r: r["device_peak"])["rank"], "real": bool(first.get("real"))}
    meta = runs.run_meta(run_id=run_id, label=first["label"], comparison=comparison, world_size=world,
                         devices=[f"{first['target']} (rehearsed)"], plan=ParallelPlan.parse(first["plan"]),
                         model=first["model"], num_params=first["num_params"], kind="rehearsal", rehearsal=rehearsal,
                         predicted=first["predicted"], run_config=first["config"], seed=first["config"]["seed"])
    # The process's resident memory is this rehearsal's, not the rank's: left out.
    memory = {r["rank"]: {k: v for k, v in r["memory_bytes"].items() if k != "peak_rss"} for r in results}
    summary = {"steps": first["config"]["steps"], "world_size": world, "comm_per_step": first["comm_per_step"],
               "memory_bytes": memory[first["rank"]], "memory_bytes_per_rank": [memory.get(k) for k in range(world)]}
    for r in results:
        writer = runs.RunWriter(root, run_id, r["rank"])
        if r is first:
            writer.write_meta(meta)
        writer.append({"step": summary["steps"], "time": time.time(), "memory": memory[r["rank"]],
                       "comm": r["comm_per_step"], "steps": summary["steps"]})
        writer.finish(summary if r is results[-1] else None)  # the summary last: it marks the run complete
    return str(writer.path)


# -- the matrix: real sizes ---------------------------------------------------------------------------------

# (workload, ranks, plan, global batch in sequences): Llama 3 at the sizes and scales people train it, bf16-mixed,
# AdamW, sequences of 8,192 tokens, one sequence per microbatch.
MATRIX = [
    ("llama3-8b", 8, "zero3", 8), ("llama3-8b", 8, "zero3_ac", 8), ("llama3-8b", 8, "zero3_ac_offload", 8),
    ("llama3-8b", 64, "zero1_tp8", 8),
    ("llama3-8b", 64, "zero2_cp2_ac", 32), ("llama3-70b", 64, "tp8_pp8_1f1b_mb8", 8),
    ("llama3-70b", 64, "zero3_tp8_ac", 8), ("llama3-70b", 256, "zero1_tp8_pp4_interleaved_v2_mb8", 64),
    ("llama3-70b", 256, "zero3_tp8_sp_ac", 32), ("llama3-70b", 1024, "zero1_tp8_pp8_zbv_mb8", 128),
    ("llama3-405b", 1024, "zero1_tp8_pp16_1f1b_mb16", 128), ("llama3-405b", 1024, "zero1_tp8_pp16_1f1b_mb16_ac", 128),
    # the estimator's own block (the demo GPT) at Llama 3 70B's shape
    ("gpt-shape", 64, "tp8_pp8_1f1b_mb8", 8), ("gpt-shape", 64, "zero3_tp8_ac", 8),
    ("gpt-shape", 256, "zero1_tp8_pp4_interleaved_v2_mb8", 64),
]
GPT_70B = {"n_layer": 80, "n_embd": 8192, "n_head": 64, "vocab": 128256}  # gpt-shape's rows


def rehearse_ends(config: Any, world: int, target: str = "cuda") -> dict[str, Any]:
    """``config``'s plan at ``world`` ranks: the first and the last stage's first rank rehearsed (under 1F1B and its
    kin the first stage holds the most activations in flight, the last the logits), the worse beside the estimator."""
    start = time.perf_counter()
    ends = roles(config.strategy, world)
    results = [rehearse_rank(config, rank, world, target) for rank in sorted({ends[0], ends[-1]})]
    worst = max(results, key=lambda r: r["device_peak"])
    mine = worst["predicted"]["memory"][worst["rank"]]
    return {"model": config.workload, "ranks": world, "plan": worst["plan"], "batch": config.batch_size,
            "rank": worst["rank"], "rehearsed": worst["device_peak"],
            "setup": worst["memory_bytes"].get("setup_peak", 0),
            "states": worst["memory_bytes"]["total"], "activations": worst["memory_bytes"]["activations_peak"],
            "predicted": _predicted_peak(mine, target),
            "predicted_states": sum(mine.get(k, 0) for k in CATEGORIES[:4]),
            "predicted_activations": mine.get("activations", 0), "seconds": time.perf_counter() - start}


def matrix_row(workload: str, world: int, plan: str, batch: int, base: Any) -> dict[str, Any]:
    """One row of `MATRIX` (`rehearse_ends`)."""
    shape = GPT_70B if workload == "gpt-shape" else {}
    return rehearse_ends(replace(base, strategy=plan, workload=workload, batch_size=batch, **shape), world)


def matrix_report(rows: list[dict[str, Any]], command: str) -> str:
    GiB = 2**30
    lines = [f"# Rehearsed at real sizes ({time.strftime('%Y-%m-%d')})", "", f"`{command}`", "",
             "One rank of each job rehearsed on this machine (`--target cuda`: NCCL's ranks, "
             "bf16-mixed, AdamW, sequences of 8,192 tokens): the first and the last pipeline stage's first rank, the "
             "worse shown. `gpt-shape`: the demo GPT at Llama 3 70B's shape (80 x 8,192, 64 heads, vocabulary "
             "128,256); the Llama rows are the estimator's Llama family, the `gpt-shape` rows its demo block. "
             "GiB per rank: the steady peak (states + saved activations + the rest), beside the estimator's "
             "(`stratpack plan`'s). Seconds: the row's two rehearsals on this machine.", "",
             "| model | ranks | plan | batch | rank | rehearsed peak | estimator | off | states (est.) | activations "
             "(est.) | s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['ranks']} | {r['plan']} | {r['batch']} | failed: {r['error']} |")
            continue
        off = (r["predicted"] - r["rehearsed"]) / r["rehearsed"]
        lines.append(f"| {r['model']} | {r['ranks']:,} | `{r['plan']}` | {r['batch']} | {r['rank']} | "
                     f"{r['rehearsed'] / GiB:,.1f} | {r['predicted'] / GiB:,.1f} | {off:+.0%} | "
                     f"{r['states'] / GiB:,.1f} ({r['predicted_states'] / GiB:,.1f}) | "
                     f"{r['activations'] / GiB:,.1f} ({r['predicted_activations'] / GiB:,.1f}) | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def run_matrix(args: argparse.Namespace, base: Any) -> int:
    from strategies.cli.reports import write_report

    rows = []
    for workload, world, plan, batch in MATRIX:
        try:
            rows.append(matrix_row(workload, world, plan, batch, base))
        except Exception as err:  # noqa: BLE001 - a row that fails is reported, the others still run
            rows.append({"model": workload, "ranks": world, "plan": plan, "batch": batch,
                         "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"})
        print(rows[-1], flush=True)
    text = matrix_report(rows, "stratpack rehearse --matrix")
    if args.report:  # printed first, then written (its folder made), as the benchmarks' reports
        write_report(text, args.report, "rehearsals")
    else:
        print(text)
    return 0


# -- the command line ---------------------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    from strategies.cli.train import add_run_options

    p = sub.add_parser("rehearse", help="one rank of an N-rank job, run alone on meta tensors: its memory and "
                                        "communication beside the estimator's",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", nargs="?", default="dp", help="the plan, e.g. zero3_tp2_pp2")
    p.add_argument("--world-size", type=int, default=None, help="the job's ranks")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--rank", default="0", help="the rank to rehearse, or several: 0,5,7 (default 0)")
    who.add_argument("--all-roles", action="store_true",
                     help="one rank of each role (each stage's first and last rank); the worst is named")
    p.add_argument("--target", choices=("cpu", "cuda"), default=None,
                   help="the ranks rehearsed: this host's gloo ranks (cpu), or a GPU job's NCCL ranks (cuda); "
                        f"default cpu up to {CPU_HOST_RANKS} ranks, cuda above (a job no CPU host would run)")
    p.add_argument("--real", action="store_true",
                   help="the rank's compute on real tensors of --target's device (cuda: a GPU), not on meta: its "
                        "allocator's peak and step time are real; the rank's share must fit the device")
    p.add_argument("--save", action="store_true",
                   help="also a checkpoint saved by slice after the last step, and a fit resumed from one (torch's "
                        "DCP, as Lightning's ModelCheckpoint writes under the plan): each one's peak")
    p.add_argument("--out", default=None, help="write every rank's figures as JSON here")
    p.add_argument("--matrix", action="store_true",
                   help="rehearse the real-size matrix instead (Llama 3 8B to 405B, 8 to 1,024 ranks; PLAN and "
                        "--world-size are ignored): a markdown table beside the estimator's")
    p.add_argument("--anchors", action="store_true",
                   help="rehearse the runs torchtitan and Meta published instead (Llama 3 8B-405B, 8-8,192 ranks), "
                        "each beside the anchor's memory per GPU")
    p.add_argument("--report", default=None,
                   help="with --matrix or --anchors: write the table here (docs/rehearsals-*.md)")
    add_run_options(p)
    p.set_defaults(func=command, steps=2, batch_size=None)  # (None: `_batch`)


def default_target(world_size: int | None) -> str:
    """The rehearsal's target where none is given: this host's gloo ranks for a job a CPU host runs, else a GPU job's
    (a CPU rehearsal of hundreds of ranks measures this host's matrix library at the rank's shapes: 4.5 GiB for Llama
    3 70B `zero1_tp8_pp8`, against 0.39 on the GPU target)."""
    return "cpu" if world_size is None or world_size <= CPU_HOST_RANKS else "cuda"


def _choose_target(args: argparse.Namespace) -> None:
    if args.target is None:
        args.target = default_target(args.world_size)
        if args.target == "cuda" and not (args.matrix or args.anchors):
            print(f"--target cuda: a job of {args.world_size} ranks is a GPU job (--target cpu rehearses this host's "
                  "gloo ranks)", file=sys.stderr)


def _lacks_gpu(args: argparse.Namespace) -> bool:
    if not (args.real and args.target == "cuda"):
        return False
    import torch

    return not torch.cuda.is_available()


def _batch(args: argparse.Namespace) -> int:
    """The global batch: the one given, else train's (16) made a multiple of the job's data-parallel ranks (one
    sample each at least: a rehearsal of 64 ranks of `zero3` has 64), saying so where it differs."""
    from strategies.cli.train import RunConfig, data_parallel_degree

    if args.batch_size is not None:
        return args.batch_size
    batch = RunConfig.batch_size
    if args.world_size and not (args.matrix or args.anchors):
        replicas = data_parallel_degree(args.plan, args.world_size)
        if batch % replicas:
            batch = -(-batch // replicas) * replicas
            print(f"--batch-size {batch}: one that splits over the job's {replicas} data-parallel ranks (give "
                  "--batch-size for another)", file=sys.stderr)
    return batch


def _check_split(config: Any, world_size: int) -> None:
    """A batch that does not split over the plan's data ranks: one line that says what to give (not DataLoader's
    "batch_size=0" from inside the rehearsal)."""
    from strategies.cli.train import data_parallel_degree

    replicas = data_parallel_degree(config.strategy, world_size)
    if config.batch_size % replicas:
        raise SystemExit(f"stratpack rehearse: --batch-size {config.batch_size} does not split over the {replicas} "
                         f"data-parallel ranks of '{config.strategy}' at {world_size} ranks: give a multiple of "
                         f"{replicas}")


def command(args: argparse.Namespace) -> int:
    from strategies.cli.train import HEAP_ENV, config_from

    _choose_target(args)
    env = dict(HEAP_ENV) if args.target == "cpu" else {}
    if args.real and args.target == "cpu" and args.world_size and "OMP_NUM_THREADS" not in os.environ:
        # the threads a real run's rank gets (Lightning: the cores over the ranks), before torch starts its pool:
        # MKL's workspace per thread is in the heap (set later, 2 threads' stayed: +4.3 MiB at 4 x 128)
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.world_size))
    if any(os.environ.get(k) != v for k, v in env.items()):
        # as `stratpack train --heap`: MKL's workspace is measured, and read as the real run's heap reads it
        os.environ.update(env)
        os.execv(sys.executable, sys.orig_argv)
    args.batch_size = _batch(args)
    config = config_from(args, args.plan)
    if args.matrix or args.anchors:  # (the anchors' table rehearses through `rehearse_ends`)
        base = replace(config, seq_len=8192, precision="bf16-mixed", optimizer="adamw")
        return run_anchors(args, base, rehearse_ends) if args.anchors else run_matrix(args, base)
    if _lacks_gpu(args):  # what this machine lacks: one line, exit 2 (as bench --accelerator gpu)
        print("stratpack rehearse --real --target cuda: this machine has no GPU. --real --target cpu runs the "
              "rank's compute on this CPU; without --real it is rehearsed on meta", file=sys.stderr)
        return 2
    if args.world_size is None:
        raise SystemExit("stratpack rehearse: give the job's ranks, --world-size N (or --matrix)")
    ranks = roles(args.plan, args.world_size) if args.all_roles else [int(r) for r in args.rank.split(",")]
    if any(not 0 <= r < args.world_size for r in ranks):
        raise SystemExit(f"--rank: a rank of the job is 0..{args.world_size - 1}, got {args.rank}")
    _check_split(config, args.world_size)
    results = []
    for rank in ranks:
        result = rehearse_rank(config, rank, args.world_size, args.target, args.real, save=args.save)
        result["rounds"] = checked_programs(result["plan"])
        results.append(result)
    print(report(results))
    print(f"written to the run store: {store_rehearsal(results, args.runs_dir, args.comparison)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    sys.stdout.flush()
    return 0
