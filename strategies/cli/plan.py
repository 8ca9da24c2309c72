"""``stratpack plan``: a plan string's layout over the ranks, or the plans that fit a model ranked (``--params``, or
the model itself: ``--workload``, ``--hf-config``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="show a strategy string's layout, or rank the plans that fit a model (--params, "
                                    "--workload, --hf-config)")
    p.add_argument("plan", nargs="?", default=None)
    p.add_argument("--world-size", type=int, default=8)
    model = p.add_mutually_exclusive_group()
    model.add_argument("--params", type=float, default=None, help="model size to plan for, e.g. 7e9 (a usual shape)")
    model.add_argument("--workload", default=None,
                       help="the model to plan for, by its workload: llama3-8b, llama3-70b, llama3-405b, qwen2-7b, "
                            "gpt2-xl, or module:object")
    model.add_argument("--hf-config", default=None, metavar="PATH",
                       help="the model to plan for: a Hugging Face config.json (the file or its folder; dense or a "
                            "mixture of experts)")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--gpu-mem", type=float, default=None, help="GiB per GPU (default 80, or the --hardware's)")
    p.add_argument("--hardware", default=None, choices=("h100-sxm", "h100-96g", "a100-80g"),
                   help="a cluster's GPUs and links (`measure.published.CLUSTERS`: peak FLOP/s, and nccl-tests' bus "
                        "bandwidth inside a node and per GPU between nodes) instead of the H100 defaults")
    p.add_argument("--published", action="store_true",
                   help="published large runs (Megatron-LM, Llama 3 405B) beside the planner's answer for the same "
                        "model, cluster and batch: a markdown table (a few minutes)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--global-batch", type=int, default=None, help="samples per step (default 8 per GPU)")
    p.add_argument("--precision", default="bf16-mixed",
                   help="Lightning's precision, for the layout it implies: 32-true, bf16-mixed and 16-mixed hold "
                        "4 + 4 + 8 bytes per parameter with Adam, bf16-true and 16-true 2 + 2 + 4")
    p.add_argument("--param-dtype", choices=["bf16", "fp16"], default=None,
                   help="plan for runs that compute with half copies of the weights (PlanStrategy(param_dtype=...), "
                        "--param-dtype of train: the residual stream in half), under the matching *-mixed precision")
    p.add_argument("--top", type=int, default=10, help="plans to show")
    p.add_argument("--rehearse", action="store_true",
                   help="rehearse the top three plans that fit (`stratpack rehearse --target cuda`: the demo GPT at "
                        "this shape, one rank of the first and of the last stage) and mark any whose rehearsed peak "
                        "does not fit --gpu-mem")
    p.add_argument("--calibrate", action="store_true",
                   help="time steps with this machine's FLOP/s and links, measured at --gpus ranks (a few seconds, "
                        "then cached; see strategies.measure.calibrate) instead of H100 defaults")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    from strategies.plan import ParallelPlan

    if args.published:
        return _published()
    if args.plan is None:
        if args.params is None and args.workload is None and args.hf_config is None:
            print("error: give a plan to explain, or a model (--params, --workload or --hf-config; and --gpus, "
                  "--gpu-mem) to rank the plans that fit", file=sys.stderr)
            return 2
        return _rank_plans(args)
    try:
        plan = ParallelPlan.parse(args.plan)
        resolved = plan.resolve(args.world_size)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"canonical: {plan}\nresolved at world size {args.world_size}: {resolved}")
    print(f"axes (outermost first): pp={resolved.pp} dp={resolved.dp} cp={resolved.cp} tp={resolved.tp}")
    for rank in range(args.world_size):
        print(f"  rank {rank}: {resolved.coordinates(rank)}")
    return 0


def _rank_plans(args: argparse.Namespace) -> int:
    from strategies.measure.estimate import layout, with_param_dtype
    from strategies.measure.planner import GiB, by_layout, rank_plans

    try:
        shape, model = _shape(args)
        layout(args.precision)
        precision = with_param_dtype(args.precision, args.param_dtype is not None)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    hw = _hardware(args)
    if args.calibrate:
        hw = calibrated_hardware(args.gpus, args.gpu_mem * GiB)
    batch = args.global_batch or 8 * args.gpus
    ranked = rank_plans(shape, hw, batch, precision=precision)
    fits = [r for r in ranked if r.fits]
    print(f"{model}: {shape.total():.3g} parameters as {shape.layers} layers x {shape.hidden} wide, {shape.heads} "
          f"heads{_extras(shape)}, sequence {shape.seq}, vocab {shape.vocab}; global batch {batch}; {args.gpus} GPUs "
          f"of {args.gpu_mem:g} GiB "
          f"(plans may fill {hw.usable:.0%}, set-up included: the model built in configure_model, each rank making its "
          f"slice); {args.precision} precision{f' with param_dtype {args.param_dtype}' if args.param_dtype else ''} "
          "with Adam")
    rows = by_layout(fits or ranked)
    print(f"{len(fits)} of {len(ranked)} plans fit, in {len(rows) if fits else 0} layouts. Predicted step time = "
          f"compute + bubble + recompute + exposed communication at {_links(hw)} (a model to rank by, not a promise). "
          "A row per layout (axes, schedule, recompute) at its fastest data mode and offload, least memory among "
          "ties; its other variants after 'also':")
    best = fits[0] if fits else None
    for row in rows[: args.top]:
        print("  " + row.shown.explain(shape, best) + row.also())
    if not fits:
        print("none fits: more GPUs, more memory per GPU, or a smaller batch", file=sys.stderr)
        return 1
    if args.rehearse:
        return _rehearse_top(args, shape, [row.shown for row in rows[:3]], batch)
    return 0


def _links(hw: Any) -> str:
    """The FLOP/s and links the step times assume: the defaults' (or ``--hardware``'s), or this machine's."""
    cal = hw.calibration
    links = (f"this machine's links as calibrated (all_reduce over {cal.world}: {hw.tp_bandwidth / 1e9:.2f} GB/s, "
             f"{cal.link('all_reduce', cal.world)[0] * 1e3:.2f} ms a call)" if cal else
             f"tp at {hw.tp_bandwidth / 1e9:.0f} GB/s, dp/pp at {hw.dp_bandwidth / 1e9:.0f} GB/s")
    return f"{hw.flops / 1e12:.3g} TFLOP/s per rank, {links}"


def _shape(args: argparse.Namespace) -> tuple[Any, str]:
    """The model planned for (`estimate.ModelShape` at ``--seq``) and its name: ``--params``' usual shape, a
    workload's model or a ``config.json``'s (read as the estimator reads a Hugging Face config)."""
    import dataclasses
    import json
    import os

    from strategies.measure.estimate import ModelShape

    if args.params is not None:
        return ModelShape.from_params(args.params, seq=args.seq, vocab=args.vocab), "a usual shape"
    if args.workload is not None:
        from strategies.cli.train import RunConfig

        shape = workload_shape(RunConfig(workload=args.workload, seq_len=args.seq, batch_size=1))
        return dataclasses.replace(shape, seq=args.seq), args.workload
    path = args.hf_config
    with open(os.path.join(path, "config.json") if os.path.isdir(path) else path) as f:
        config = json.load(f)
    try:
        return dataclasses.replace(ModelShape.from_config(config), seq=args.seq), path
    except KeyError as err:
        raise ValueError(f"--hf-config {path}: not a transformer's config the planner reads ({err.args[0]}); "
                         "give --params instead") from None


def _extras(shape: Any) -> str:
    """The shape's grouped keys and experts, where it has them, for the plan's first line."""
    kv = f", {shape.kv_heads} key/value heads" if shape.kv_heads and shape.kv_heads != shape.heads else ""
    return kv + (f", {shape.experts} experts (top {shape.top_k})" if shape.experts else "")


def _hardware(args: argparse.Namespace) -> Any:
    """The GPUs the plans are ranked for: H100 defaults, or a named cluster's (``--hardware``), with ``--gpu-mem``
    (which this fills in where not given)."""
    from strategies.measure.planner import GiB, Hardware

    hw = Hardware(gpus=args.gpus, memory=80 * GiB)
    if args.hardware:
        from strategies.measure.published import CLUSTERS

        hw = CLUSTERS[args.hardware].hardware(args.gpus)
    args.gpu_mem = args.gpu_mem or hw.memory / GiB
    return dataclasses.replace(hw, memory=args.gpu_mem * GiB)


def _published() -> int:
    """`measure.published.RUNS` beside the planner: a markdown table, a row per run as it is computed."""
    from strategies.measure.published import EFFICIENCY, RUNS, compare, implied_efficiency

    print(f"compute at {EFFICIENCY:.3f} of peak FLOP/s (`published.EFFICIENCY`); seconds per step\n")
    print("| run | GPUs | plan (ours) | rank among the planner's | planner's pick | predicted s | published s | "
          "predicted / published | efficiency it implies | GiB per GPU (estimator) |")
    print("|---|---:|---|---:|---|---:|---:|---:|---:|---:|")
    for run in RUNS:
        r = compare(run)
        pick = f"`{r['pick']}` {r['pick_s']:.2f}" if r["pick"] else "none fits"
        rank = f"{r['rank']} of {r['candidates']}" if r["candidates"] else "none fits"
        print(f"| {r['run']} | {r['gpus']:,} | `{r['plan']}` | {rank} | {pick} | "
              f"{r['predicted_s']:.2f} | {r['published_s']:.2f} | {r['ratio']:.2f} | {implied_efficiency(run):.3f} | "
              f"{r['memory_gib']:.1f}{'' if r['fits'] else ' (does not fit)'} |", flush=True)
    return 0


def _rehearse_top(args: argparse.Namespace, shape: Any, picks: list, batch: int) -> int:
    """Rehearse ``picks`` (`rehearse.rehearse_ends`): the model of ``--workload`` or ``--hf-config``, or for
    ``--params`` the demo GPT at ``shape``; 1 if any does not fit."""
    from dataclasses import replace

    from strategies.cli.rehearse import rehearse_ends
    from strategies.cli.train import RunConfig
    from strategies.measure.planner import GiB

    base = RunConfig(workload="gpt-shape", n_layer=shape.layers, n_head=shape.heads, n_embd=shape.hidden,
                     seq_len=shape.seq, vocab=shape.vocab, batch_size=batch, precision=args.precision, steps=2,
                     wandb="off", param_dtype=args.param_dtype)
    what = "the demo GPT at this shape"
    if args.params is None:  # the model itself, at its own depth
        base = replace(base, workload=args.workload or "hf-config", hf_config=args.hf_config, n_layer=RunConfig.n_layer)
        what = "the model itself"
    print(f"rehearsed ({what}, {args.precision}, AdamW; one rank of the first and the last stage, the worse shown), "
          "GiB per rank:")
    failed = 0
    for pick in picks:
        row = rehearse_ends(replace(base, strategy=pick.estimate.plan), args.gpus)
        fits = row["rehearsed"] <= args.gpu_mem * GiB
        failed += not fits
        print(f"  {row['plan']:<40} rehearsed {row['rehearsed'] / GiB:7.1f} (rank {row['rank']}), estimator "
              f"{row['predicted'] / GiB:7.1f}: {'fits' if fits else 'does NOT fit'} {args.gpu_mem:g} GiB "
              f"({row['seconds']:.0f} s)")
    return 1 if failed else 0


def calibrated_hardware(ranks: int, memory: float):
    """This machine at ``ranks`` ranks, measured once and cached (`strategies.measure.calibrate`)."""
    from strategies.measure import calibrate
    from strategies.measure.planner import Hardware

    cal = calibrate.load(ranks)
    if cal is None:
        print(f"calibrating this machine at {ranks} ranks (once; cached in {calibrate.cache_path()})...",
              file=sys.stderr, flush=True)
        cal = calibrate.measure(ranks)
    return Hardware.calibrated(cal, memory)


def workload_costs(shape: Any, devices: int) -> Any:
    """The step's pieces measured at the workload's shape (`measure.costs`), once per machine and shape."""
    from strategies.measure import costs

    found = costs.load(devices, shape.hidden, shape.heads, shape.seq, shape.vocab)
    if found is None:
        print(f"measuring a step's pieces at {devices} ranks (once; cached)...", file=sys.stderr, flush=True)
        found = costs.measure(devices, shape.hidden, shape.heads, shape.seq, shape.vocab)
    return found


def workload_shape(config: Any) -> Any:
    """The workload's transformer shape (`estimate.ModelShape`) at the run's global batch."""
    from strategies.cli.train import _model_config
    from strategies.cli.workload import find_workload
    from strategies.measure.estimate import ModelShape

    module, _ = find_workload(config.workload).lightning(config)
    return ModelShape.from_config(_model_config(module, config.seq_len), batch=config.batch_size)


def calibrate_host(config: Any) -> None:
    """This host's calibration and the costs of a step's pieces at the workload's shape, at one rank and at the
    comparison's ranks: measured once (about a minute) and cached, so that each run's prediction has a step time
    to put beside the measured one (`measure.predict`)."""
    shape = workload_shape(config)
    for world in sorted({1, config.devices}):
        calibrated_hardware(world, 0.0)
        workload_costs(shape, world)
