"""``stratpack compare``: several strategies on the same model, data, seed and global batch, one after the
other, each a run in the run store under one comparison id, then a table of measured against predicted.

Every run is its own `stratpack train` process (Lightning's popen launcher re-executes the command line,
and torch.distributed allows one process group per process). Lightning's own strategies (``ddp``,
``deepspeed_stage_N``...) run beside the plans as reference rows; the estimator predicts them as the plan
that does the same (``ddp`` as ``dp``, ``fsdp`` as ``zero3``, ``deepspeed_stage_N`` as ``zeroN``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from typing import Any

DEFAULT = "single,naive,dp,ddp,zero1,zero2,zero3,tp2,pp2"


def run_in_subprocess(config: Any, out_dir: str, index: int) -> dict[str, Any]:
    """One `stratpack train` with ``config`` (a RunConfig); its result, or ``{"label", "error"}``."""
    out = os.path.join(out_dir, f"run{index}.json")
    cmd = [sys.executable, "-m", "strategies.cli", "train", config.strategy, "--out", out]
    for field in fields(config):
        value = getattr(config, field.name)
        flag = f"--{field.name.replace('_', '-')}"
        if isinstance(value, bool):  # a switch: given or not (one on by default is turned off by --no-<name>)
            if value != field.default:
                cmd += [flag if value else f"--no-{flag[2:]}"]
        elif field.name != "strategy" and value is not None:
            cmd += [flag, str(value)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(out):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        return {"label": config.strategy, "error": "\n".join(tail) or f"exit code {proc.returncode}"}
    with open(out) as f:
        return json.load(f)


def parse_plans(text: str) -> list[tuple[str, int]]:
    """``plan:devices`` items, comma-separated (devices default 2), as the benchmark commands take ``--plans``."""
    plans = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        plan, _, devices = item.partition(":")
        plans.append((plan, int(devices or 2)))
    return plans


def predicted(result: dict[str, Any]) -> dict[str, float] | None:
    """The estimator's rank-0 model-state bytes, bytes sent per step and activations, as the run recorded
    them (None when the strategy has no plan equivalent)."""
    guess = result.get("predicted")
    if not guess:
        return None
    return {"state": guess["model_states"][0], "comm": sum(guess["comm"].values()),
            "activations": guess["memory"][0]["activations"], "setup": (guess.get("setup") or [None])[0]}


def loss_match(result: dict[str, Any], reference: dict[str, Any] | None) -> float | None:
    """Largest relative difference of the per-step losses from the reference run's."""
    if reference is None or "losses" not in result or len(result["losses"]) != len(reference["losses"]):
        return None
    return max(abs(a - b) / abs(b) for a, b in zip(result["losses"], reference["losses"]))


def _pair(measured: float | None, guess: float | None, spec: str) -> str:
    """Measured / predicted bytes, in KiB ('-' for none)."""
    return f"{_fmt(measured / 1024 if measured else None, spec)} / {_fmt(guess / 1024 if guess else None, spec)}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def comm_bytes_per_step(result: dict[str, Any], axis: str | None = None) -> float | None:
    """Bytes rank 0 sent per step (on one mesh axis, or all); None for strategies the pack does not count."""
    comm = result.get("comm_per_step")
    if not comm:
        return None
    return sum(rec["bytes_sent"] for key, rec in comm.items() if axis is None or key.endswith(f"/{axis}"))


def format_table(results: list[dict[str, Any]], baseline: str | None) -> str:
    """One row per strategy (repeats averaged): loss and its match with ``single``, speed and its ratio
    to ``baseline``, and rank 0's memory and traffic, measured / predicted."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        rows.setdefault(r["label"], []).append(r)
    ok_of = {label: [r for r in runs if "error" not in r] for label, runs in rows.items()}
    base_tps = _mean([r.get("tokens_per_s") for r in ok_of.get(baseline, [])])
    reference = (ok_of.get("single") or [None])[0]
    # Set-up memory beside the estimator's only where it was measured as the estimator counts it (the heap, with
    # --heap): without it the measured figure is resident memory's growth (the allocator's pages, gloo's buffers,
    # the first-batch check's copy), 2-3x the model's build on the demo: not a like-for-like pair.
    heap = all((r.get("config") or {}).get("heap") for runs in ok_of.values() for r in runs)
    header = (f"{'strategy':<18}{'ranks':>6}{'final loss':>11}{'loss match':>11}{'tokens/s':>10}"
              f"{'vs ' + (baseline or '-'):>10}{'state KiB meas/pred':>22}{'comm KiB/step meas/pred':>26}"
              f"{'act KiB':>9}" + (f"{'setup KiB meas/pred':>22}" if heap else "") + "  precision")
    lines = [header, "-" * len(header)]
    for label, runs in rows.items():
        ok = ok_of[label]
        if not ok:
            lines.append(f"{label:<18}  FAILED: {runs[0]['error'].splitlines()[-1]}")
            continue
        first = ok[0]
        tps = _mean([r.get("tokens_per_s") for r in ok])
        ratio = tps / base_tps if tps and base_tps else None
        match = loss_match(first, reference)
        memory = first.get("memory_bytes") or {}
        guess = predicted(first) or {}
        sent = comm_bytes_per_step(first)
        state = _pair(memory.get("total"), guess.get("state"), ",.0f")
        comm = _pair(sent, guess.get("comm"), ",.1f")
        act, setup = memory.get("activations_peak"), _pair(memory.get("setup_peak"), guess.get("setup"), ",.0f")
        lines.append(
            f"{label:<18}{first['world_size']:>6}{_fmt(_mean([r['losses'][-1] for r in ok]), '.4f'):>11}"
            f"{_fmt(match, '.1e'):>11}{_fmt(tps, ',.0f'):>10}{_fmt(ratio, '.3f'):>10}{state:>22}{comm:>26}"
            f"{_fmt(act / 1024 if act else None, ',.0f'):>9}" + (f"{setup:>22}" if heap else "")
            + f"  {run_precision(first)}"
        )
    lines.append(_legend(heap))
    return "\n".join(lines)


def run_precision(result: dict[str, Any]) -> str:
    """The run's precision and, under a plan, the strategy's ``param_dtype`` (`runs.precision_label`)."""
    from strategies.cli.train import _is_plan
    from strategies.runs import precision_label

    config = result.get("config") or {}
    half = config.get("param_dtype") if _is_plan(str(result.get("label", ""))) else None
    return precision_label(config.get("precision"), half) or "-"


def _legend(heap: bool) -> str:
    return ("loss match: largest relative difference of a step's loss from single's; meas/pred: rank 0 measured / the "
            "estimator (strategies.measure.estimate); '-': not counted (the communication of Lightning's own "
            "strategies) or no plan; act: what autograd saved for backward, every strategy alike; "
            + ("setup: rank 0's heap peak from before the model was built to the end of the first step, and the "
               "estimator's (a meta build with --configure-model, else the model built whole)" if heap else
               "set-up memory beside the estimator's: with --heap (measured as the estimator counts it)"))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def expert_lines(results: list[dict[str, Any]]) -> str:
    """Under expert parallel, rank 0's all-to-all per step: measured; predicted for the routing the run saw (its tokens
    per expert, `expert_parallel.cost`); the estimator's for a balanced router; and how unbalanced the routing was."""
    rows = [r for r in results if "error" not in r and r.get("experts")]
    if not rows:
        return ""
    header = (f"{'expert parallel':<18}{'all-to-all KiB/step':>21}{'routed':>10}{'meas/routed':>13}{'balanced':>10}"
              f"{'meas/bal':>10}{'imbalance':>11}")
    lines = ["", header, "-" * len(header)]
    for r in rows:
        measured = (r.get("comm_per_step") or {}).get("all_to_all/ep", {}).get("bytes_sent")
        routed = r["experts"].get("routed_bytes_per_step")
        balanced = ((r.get("predicted") or {}).get("comm") or {}).get("all_to_all/ep")
        kib = [_fmt(v / 1024 if v else None, ",.1f") for v in (measured, routed, balanced)]
        lines.append(f"{r['label']:<18}{kib[0]:>21}{kib[1]:>10}{_fmt(_ratio(measured, routed), '.4f'):>13}{kib[2]:>10}"
                     f"{_fmt(_ratio(measured, balanced), '.3f'):>10}"
                     f"{_fmt(r['experts'].get('imbalance_max'), '.2f'):>11}")
    lines.append("routed: what the all-to-alls send for the tokens per expert the run routed (expert_parallel.cost); "
                 "balanced: the estimator's, each token's experts spread evenly; imbalance: the busiest expert's "
                 "tokens over the mean (1: balanced; rank 0's layers, the worst)")
    return "\n".join(lines)


def run_comparison(labels: list[str], make_config, repeat: int = 1, runs_dir: str | None = None) -> tuple[str, list]:
    """Run ``labels`` (``repeat`` times, alternating the order) under one comparison id; return it and the
    results. ``make_config(label, comparison)`` gives each run's RunConfig."""
    from strategies.runs import new_comparison_id
    from strategies.runs import runs_dir as resolve

    comparison = new_comparison_id()
    total, done, results = repeat * len(labels), 0, []
    print(f"comparison {comparison}: {total} runs into {resolve(runs_dir)}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="stratpack_") as tmp:
        for r in range(repeat):
            # Alternate the order each repeat so slow drift on the machine does not favour one strategy.
            for label in labels if r % 2 == 0 else labels[::-1]:
                config = make_config(label, comparison)
                bar = "#" * (20 * done // total) + "." * (20 - 20 * done // total)
                print(f"[{bar}] {done + 1}/{total} {label} on {1 if label == 'single' else config.devices} rank(s)",
                      file=sys.stderr, flush=True)
                start = time.monotonic()
                results.append(run_in_subprocess(config, tmp, done))
                done += 1
                status = "failed" if "error" in results[-1] else "done"
                print(f"        {status} in {time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)
    print(f"[{'#' * 20}] {total}/{total}", file=sys.stderr, flush=True)
    return comparison, results


# -- the command line ---------------------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    from strategies.cli.train import add_run_options

    p = sub.add_parser("compare", help="train the workload (the demo GPT) with several strategies and print a table")
    p.add_argument("--strategies", default=DEFAULT, help=f"comma-separated (default {DEFAULT})")
    p.add_argument("--repeat", type=int, default=1, help="runs of each strategy, order alternating")
    p.add_argument("--baseline", default="single", help="strategy the speed column is relative to")
    p.add_argument("--json", default=None, help="also write every run's result to this file")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="on CPU, do not measure this host first (once, cached): runs then get no predicted step time")
    add_run_options(p)
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    from strategies.cli.train import config_from

    labels = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.strategies == DEFAULT:
        labels += _gpu_reference_rows(args.accelerator)
    args.runs_dir = args.runs_dir or None
    if args.accelerator == "cpu" and args.calibrate:
        from strategies.cli.plan import calibrate_host

        calibrate_host(config_from(args, "dp"))

    def make_config(label: str, comparison: str) -> Any:
        args.comparison = comparison
        return config_from(args, label)

    comparison, results = run_comparison(labels, make_config, args.repeat, args.runs_dir)
    print(format_table(results, args.baseline if args.baseline in labels else labels[0]))
    experts = expert_lines(results)
    if experts:
        print(experts)
    print(f"comparison id: {comparison} (in the run store; `stratpack dashboard` shows it)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any("error" in r for r in results) else 0


def _gpu_reference_rows(accelerator: str) -> list[str]:
    """Lightning's fsdp and DeepSpeed as reference rows where they run: on GPUs (Lightning refuses them on CPU),
    DeepSpeed where it is installed."""
    import importlib.util

    import torch

    if accelerator == "cpu" or not torch.cuda.is_available():
        return []
    rows = ["fsdp"]
    if importlib.util.find_spec("deepspeed") is not None:
        rows += ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"]
    return rows
