"""``stratpack``: compare strategies on the demo model, train once, or explain a plan string."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import fields
from typing import Any

DEFAULT_COMPARE = "single,naive,dp,ddp,zero1,zero2,zero3"


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


def _run_in_subprocess(args: argparse.Namespace, strategy: str, out_dir: str, index: int) -> dict[str, Any]:
    # Each run in its own interpreter: Lightning's popen launcher re-executes the command line, and one
    # process group per process is all torch.distributed allows.
    out = os.path.join(out_dir, f"run{index}.json")
    cmd = [sys.executable, "-m", "strategies.cli", "train", strategy, "--out", out]
    config = _config(args, strategy)
    for field in fields(config):
        value = getattr(config, field.name)
        if field.name != "strategy" and value is not None:
            cmd += [f"--{field.name.replace('_', '-')}", str(value)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(out):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        return {"label": strategy, "error": "\n".join(tail) or f"exit code {proc.returncode}"}
    with open(out) as f:
        return json.load(f)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def comm_bytes_per_step(result: dict[str, Any], axis: str = "dp") -> float | None:
    """Bytes this rank sent per step on one mesh axis (None for strategies the pack does not count)."""
    comm = result.get("comm_per_step")
    if not comm:
        return None
    return sum(rec["bytes_sent"] for key, rec in comm.items() if key.endswith(f"/{axis}"))


def format_table(results: list[dict[str, Any]], baseline: str | None) -> str:
    """One row per strategy (repeats averaged): loss, speed, speed ratio against ``baseline``, traffic."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        rows.setdefault(r["label"], []).append(r)
    base = rows.get(baseline, [])
    base_tps = _mean([r.get("tokens_per_s") for r in base if "error" not in r])
    header = f"{'strategy':<16}{'ranks':>6}{'final loss':>12}{'tokens/s':>12}{'vs ' + (baseline or '-'):>12}" \
             f"{'dp KiB/step/rank0':>19}{'state KiB/rank0':>17}{'act KiB/rank0':>15}"
    lines = [header, "-" * len(header)]
    for label, runs in rows.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            lines.append(f"{label:<16}  FAILED: {runs[0]['error'].splitlines()[-1]}")
            continue
        tps = _mean([r.get("tokens_per_s") for r in ok])
        loss = _mean([r["losses"][-1] for r in ok])
        sent = comm_bytes_per_step(ok[0])
        ratio = tps / base_tps if tps and base_tps else None
        memory = ok[0].get("memory_bytes") or {}
        state = memory.get("total")
        act = memory.get("activations_peak")
        lines.append(
            f"{label:<16}{ok[0]['world_size']:>6}{_fmt(loss, '.4f'):>12}{_fmt(tps, ',.0f'):>12}"
            f"{_fmt(ratio, '.3f'):>12}{_fmt(sent / 1024 if sent is not None else None, ',.1f'):>19}"
            f"{_fmt(state / 1024 if state else None, ',.1f'):>17}{_fmt(act / 1024 if act else None, ',.1f'):>15}"
        )
    return "\n".join(lines)


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def _cmd_compare(args: argparse.Namespace) -> int:
    labels = [s.strip() for s in args.strategies.split(",") if s.strip()]
    results = []
    with tempfile.TemporaryDirectory(prefix="stratpack_") as tmp:
        index = 0
        for repeat in range(args.repeat):
            # Alternate the order each repeat so slow drift on the machine does not favour one strategy.
            order = labels if repeat % 2 == 0 else labels[::-1]
            for label in order:
                print(f"[{repeat + 1}/{args.repeat}] {label} on {1 if label == 'single' else args.devices} "
                      f"rank(s)...", file=sys.stderr, flush=True)
                results.append(_run_in_subprocess(args, label, tmp, index))
                index += 1
    print(format_table(results, args.baseline if args.baseline in labels else labels[0]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any("error" in r for r in results) else 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from strategies.plan import ParallelPlan

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


def _cmd_bench(args: argparse.Namespace) -> int:
    from strategies.bench import PAIRS, BenchConfig, available, format_report, run_pair

    names = [n.strip() for n in args.pairs.split(",") if n.strip()]
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        print(f"error: unknown pair(s) {', '.join(unknown)}; choose from {', '.join(PAIRS)}", file=sys.stderr)
        return 2
    cfg = BenchConfig(world_size=args.world_size, steps=args.steps, n_layer=args.n_layer, n_embd=args.n_embd,
                      seq_len=args.seq_len, batch_per_rank=args.batch_per_rank)
    results = []
    for name in names:
        ours, peer = PAIRS[name]
        if not available(peer):
            results.append({"ours": ours, "peer": peer, "skipped": f"{peer} is not installed"})
            continue
        print(f"bench {ours} vs {peer}: {args.repeat} alternating pairs...", file=sys.stderr, flush=True)
        results.append(run_pair(ours, peer, cfg, pairs=args.repeat))
    report = format_report(results)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from strategies.checkpoint import CheckpointError, convert, read_manifest

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
    p.add_argument("--pairs", default="dp,zero1,zero2,zero3,zero3-fsdp2,tp,pp-1f1b,pp-gpipe",
                   help="comma-separated comparisons")
    p.add_argument("--repeat", type=int, default=5, help="alternating pairs per comparison")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-per-rank", type=int, default=8)
    p.add_argument("--out", default=None, help="also write the results as JSON")
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser("convert", help="a sharded checkpoint directory -> one file (torch.save)")
    p.add_argument("checkpoint", help="the sharded checkpoint directory (e.g. epoch=0-step=3.ckpt)")
    p.add_argument("out", help="the file to write")
    p.add_argument("--model-only", action="store_true",
                   help="write only the model's state_dict, which model.load_state_dict accepts")
    p.add_argument("--strip-prefix", default="", help="with --model-only: keep keys under this prefix, without it "
                   "(e.g. 'model.' for the nn.Module inside the LightningModule)")
    p.set_defaults(func=_cmd_convert)
    p = sub.add_parser("plan", help="parse a strategy string and show its layout")
    p.add_argument("plan")
    p.add_argument("--world-size", type=int, default=8)
    p.set_defaults(func=_cmd_plan)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
