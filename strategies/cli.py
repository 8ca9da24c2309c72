"""``stratpack``: compare strategies on the demo model, train once, or explain a plan string."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields

from strategies.compare import DEFAULT as DEFAULT_COMPARE


def _add_run_options(p: argparse.ArgumentParser) -> None:
    from demos.run import RunConfig

    defaults = RunConfig()
    p.add_argument("--devices", type=int, default=defaults.devices, help="processes (CPU: gloo ranks)")
    p.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="global batch (samples)")
    p.add_argument("--accumulate", type=int, default=defaults.accumulate, help="gradient accumulation steps")
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--n-layer", type=int, default=defaults.n_layer)
    p.add_argument("--n-head", type=int, default=defaults.n_head)
    p.add_argument("--n-embd", type=int, default=defaults.n_embd)
    p.add_argument("--data", default=None, help="a text file to train on (default: Python stdlib sources)")
    p.add_argument("--max-chars", type=int, default=defaults.max_chars)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--precision", default=defaults.precision, help="Lightning precision, e.g. 32-true, bf16-mixed")
    p.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps, help="steps left out of timing")
    p.add_argument("--gradient-clip-val", type=float, default=None, help="clip by the global gradient norm")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default=defaults.optimizer)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--epoch-steps", type=int, default=None, help="optimizer steps per epoch (default: all data)")
    p.add_argument("--checkpoint-dir", default=None, help="save a checkpoint there at the end of every epoch")
    p.add_argument("--resume", default=None, help="resume from this checkpoint (sharded directory or file)")
    p.add_argument("--accelerator", default=defaults.accelerator, help="cpu (gloo), or gpu / auto (nccl)")
    p.add_argument("--runs-dir", default=None, help="the run store (default $STRATPACK_RUNS or ./runs)")
    p.add_argument("--comparison", default=None, help="an id shared by the runs of one comparison")
    p.add_argument("--wandb", choices=("auto", "offline", "online", "off"), default=defaults.wandb,
                   help="auto: offline unless logged in (off when wandb is not installed)")


def _config(args: argparse.Namespace, strategy: str):
    from demos.run import RunConfig

    names = {f.name for f in fields(RunConfig)} - {"strategy"}
    return RunConfig(strategy=strategy, **{name: getattr(args, name) for name in names})


def _cmd_train(args: argparse.Namespace) -> int:
    from demos.run import run, write_result

    result = run(_config(args, args.strategy), params_out=args.params_out)
    if args.out:
        write_result(result, args.out)
    elif result["rank"] == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=1))
    # The run is over and its results are written. Rarely (seen ~2 in 40 ZeRO-3 runs, never in a plain loop),
    # a rank then aborts in C++ teardown at interpreter exit ("terminate called without an active
    # exception"), turning a finished run into exit code 134. Skip that teardown: nothing is left to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _cmd_compare(args: argparse.Namespace) -> int:
    from strategies.compare import format_table, run_comparison

    labels = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.strategies == DEFAULT_COMPARE:
        labels += _gpu_reference_rows(args.accelerator)
    args.runs_dir = args.runs_dir or None

    def make_config(label: str, comparison: str):
        args.comparison = comparison
        return _config(args, label)

    comparison, results = run_comparison(labels, make_config, args.repeat, args.runs_dir)
    print(format_table(results, args.baseline if args.baseline in labels else labels[0]))
    print(f"comparison id: {comparison} (in the run store; `stratpack dashboard` shows it)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any("error" in r for r in results) else 0


def _cmd_dashboard(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("streamlit") is None:
        print("error: the dashboard needs streamlit and plotly: pip install -e '.[dashboard]' (scripts/setup.sh "
              "installs them)", file=sys.stderr)
        return 2
    from strategies.runstore import RUNS_ENV, runs_dir

    app = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dashboard", "app.py")
    env = {**os.environ, RUNS_ENV: str(runs_dir(args.runs_dir).resolve())}
    local = args.address in ("127.0.0.1", "localhost", "::1")
    host = f"[{args.address}]" if ":" in args.address else args.address  # an IPv6 address in a URL
    if not local:
        where = args.address or "all interfaces"
        print(f"warning: serving on {where}: anyone who can reach this machine on port {args.port} can "
              "read the run store", file=sys.stderr)
    print(f"dashboard: http://{host}:{args.port} over {env[RUNS_ENV]} (Ctrl-C stops it)", file=sys.stderr,
          flush=True)
    cmd = [sys.executable, "-m", "streamlit", "run", app, "--server.address", args.address, "--server.port",
           str(args.port), "--server.headless", "true", "--browser.gatherUsageStats", "false",
           # On the command line, so neither a STREAMLIT_* variable nor a .streamlit/config.toml turns them off.
           "--server.enableXsrfProtection", "true", "--server.enableCORS", "true"]
    if local:  # a page on another site that resolves its name to 127.0.0.1 (DNS rebinding) is not served
        cmd += [arg for name in ("localhost", "127.0.0.1", "::1") for arg in ("--server.allowedHosts", name)]
    sys.stdout.flush()
    sys.stderr.flush()
    # Become the server (exec, not a child): stopping this process stops the server, nothing is left running.
    os.execve(sys.executable, cmd, env)
    return 0  # not reached


def _gpu_reference_rows(accelerator: str) -> list[str]:
    """Lightning's fsdp and DeepSpeed as reference rows where they run: on GPUs (Lightning refuses them on
    CPU), DeepSpeed where it is installed."""
    import importlib.util

    import torch

    if accelerator == "cpu" or not torch.cuda.is_available():
        return []
    rows = ["fsdp"]
    if importlib.util.find_spec("deepspeed") is not None:
        rows += ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"]
    return rows


def _cmd_plan(args: argparse.Namespace) -> int:
    from strategies.plan import ParallelPlan

    if args.plan is None:
        if args.params is None:
            print("error: give a plan to explain, or --params (and --gpus, --gpu-mem) to rank the plans that fit",
                  file=sys.stderr)
            return 2
        return _rank_plans(args)
    try:
        plan = ParallelPlan.parse(args.plan)
        resolved = plan.resolve(args.world_size)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"canonical: {plan}\nresolved at world size {args.world_size}: {resolved}")
    print(f"axes (outermost first): pp={resolved.pp} dp={resolved.dp} tp={resolved.tp}")
    for rank in range(args.world_size):
        print(f"  rank {rank}: {resolved.coordinates(rank)}")
    return 0


def _rank_plans(args: argparse.Namespace) -> int:
    from strategies.estimate import GiB, Hardware, ModelShape, rank_plans

    try:
        shape = ModelShape.from_params(args.params, seq=args.seq, vocab=args.vocab)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    hw = Hardware(gpus=args.gpus, memory=args.gpu_mem * GiB)
    batch = args.global_batch or 8 * args.gpus
    ranked = rank_plans(shape, hw, batch, precision=args.precision)
    fits = [r for r in ranked if r.fits]
    print(f"{args.params:.3g} parameters as {shape.layers} layers x {shape.hidden} wide, {shape.heads} heads, "
          f"sequence {shape.seq}, vocab {shape.vocab}; global batch {batch}; {args.gpus} GPUs of {args.gpu_mem:g} GiB "
          f"(plans may fill {hw.usable:.0%}); {args.precision} precision with Adam")
    print(f"{len(fits)} of {len(ranked)} plans fit. Predicted step time = compute + bubble + recompute + exposed "
          f"communication at {hw.flops / 1e12:.0f} TFLOP/s per GPU, tp at {hw.tp_bandwidth / 1e9:.0f} GB/s, "
          f"dp/pp at {hw.dp_bandwidth / 1e9:.0f} GB/s (a model to rank by, not a promise):")
    best = fits[0] if fits else None
    for r in (fits or ranked)[: args.top]:
        print("  " + r.explain(shape, best))
    if not fits:
        print("none fits: more GPUs, more memory per GPU, or a smaller batch", file=sys.stderr)
        return 1
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from strategies.bench import (PAIRS, BenchConfig, available, describe, format_report, run_pair, write_report,
                                  write_runs)

    names = [n.strip() for n in args.pairs.split(",") if n.strip()] if args.pairs else list(PAIRS)
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        print(f"error: unknown pair(s) {', '.join(unknown)}; choose from {', '.join(PAIRS)}", file=sys.stderr)
        return 2
    if not 0 <= args.warmup_steps < args.steps:
        print(f"error: --warmup-steps must be at least 0 and below --steps ({args.steps})", file=sys.stderr)
        return 2
    cfg = BenchConfig(world_size=args.world_size, steps=args.steps, warmup_steps=args.warmup_steps,
                      n_layer=args.n_layer, n_embd=args.n_embd, seq_len=args.seq_len,
                      batch_per_rank=args.batch_per_rank)
    results = []
    for name in names:
        ours, peer = PAIRS[name]
        if not available(peer):
            results.append({"ours": ours, "peer": peer, "skipped": f"{peer} is not installed"})
            continue
        print(f"bench {ours} vs {peer}: {args.repeat} alternating pairs...", file=sys.stderr, flush=True)
        results.append(run_pair(ours, peer, cfg, pairs=args.repeat))
    print(describe(cfg) + "\n\n" + format_report(results))
    for path in args.report or []:
        write_report(results, cfg, path)
        print(f"report: {path}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if any("skipped" not in r for r in results) and not args.no_store:
        comparison = write_runs(results, cfg, args.runs_dir)
        print(f"comparison id: {comparison} (in the run store; `stratpack dashboard` shows it)")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from strategies.sharded_checkpoint import CheckpointError, convert, read_manifest

    try:
        manifest = read_manifest(args.checkpoint)
        obj = convert(args.checkpoint, args.out, model_only=args.model_only, strip_prefix=args.strip_prefix)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    what = f"model state_dict ({len(obj)} tensors)" if args.model_only else "Lightning checkpoint"
    print(f"{args.out}: {what} from a {manifest.get('plan', '?')} checkpoint of {manifest['world_size']} rank(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stratpack", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compare", help="train the demo GPT with several strategies and print a table")
    p.add_argument("--strategies", default=DEFAULT_COMPARE, help=f"comma-separated (default {DEFAULT_COMPARE})")
    p.add_argument("--repeat", type=int, default=1, help="runs of each strategy, order alternating")
    p.add_argument("--baseline", default="single", help="strategy the speed column is relative to")
    p.add_argument("--json", default=None, help="also write every run's result to this file")
    _add_run_options(p)
    p.set_defaults(func=_cmd_compare)
    p = sub.add_parser("train", help="train the demo GPT once")
    p.add_argument("strategy", help="'single', a plan string (dp, naive, zero3_tp2...) or a Lightning name")
    p.add_argument("--out", default=None, help="write the result as JSON here (rank 0)")
    p.add_argument("--params-out", default=None, help="save the final parameters here (rank 0, torch.save)")
    _add_run_options(p)
    p.set_defaults(func=_cmd_train)
    p = sub.add_parser("bench", help="our engines vs torch DDP, FSDP2, DeepSpeed: alternating pairs, median ratio")
    p.add_argument("--pairs", default=None, help="comma-separated comparisons (default: all of dp, zero1, zero2, "
                   "zero3, zero3-fsdp2, tp, pp-1f1b, pp-gpipe, pp-interleaved)")
    p.add_argument("--repeat", type=int, default=5, help="alternating pairs per comparison")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup-steps", type=int, default=5, help="steps of each run left out of the timing")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-per-rank", type=int, default=8)
    p.add_argument("--out", default=None, help="also write the results as JSON")
    p.add_argument("--report", action="append", help="write the table here: .md for markdown, else CSV (repeatable)")
    p.add_argument("--runs-dir", default=None, help="the run store (default $STRATPACK_RUNS or ./runs)")
    p.add_argument("--no-store", action="store_true", help="do not write the runs to the run store")
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser("dashboard", help="open the comparison dashboard over the run store")
    p.add_argument("--runs-dir", default=None, help="the run store (default $STRATPACK_RUNS or ./runs)")
    p.add_argument("--address", default="127.0.0.1", help="where to listen (default: this machine only)")
    p.add_argument("--port", type=int, default=8501)
    p.set_defaults(func=_cmd_dashboard)
    p = sub.add_parser("convert", help="a sharded checkpoint directory -> one file (torch.save)")
    p.add_argument("checkpoint", help="the sharded checkpoint directory (e.g. epoch=0-step=3.ckpt)")
    p.add_argument("out", help="the file to write")
    p.add_argument("--model-only", action="store_true",
                   help="write only the model's state_dict, which model.load_state_dict accepts")
    p.add_argument("--strip-prefix", default="", help="with --model-only: keep keys under this prefix, without it "
                   "(e.g. 'model.' for the nn.Module inside the LightningModule)")
    p.set_defaults(func=_cmd_convert)
    p = sub.add_parser("plan", help="show a strategy string's layout, or rank the plans that fit a model (--params)")
    p.add_argument("plan", nargs="?", default=None)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--params", type=float, default=None, help="model size to plan for, e.g. 7e9")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--gpu-mem", type=float, default=80, help="GiB per GPU")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--global-batch", type=int, default=None, help="samples per step (default 8 per GPU)")
    p.add_argument("--precision", choices=("mixed", "fp32"), default="mixed")
    p.add_argument("--top", type=int, default=10, help="plans to show")
    p.set_defaults(func=_cmd_plan)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
