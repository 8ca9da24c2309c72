"""``stratpack heap``: the estimator's memory beside the heap each rank really used, for the plans of the 3D matrix.

Each plan trains the workload for ``--steps`` steps with ``stratpack train --heap`` (`measure.monitor.StrategyMonitor`:
glibc's heap sampled every 0.2 ms, MKL's buffer cache off). Per pipeline stage (ranks of a stage alike; its first rank
shown) the table gives the estimator's peak (model states + host + activations) beside the steady heap peak (the steps
after the first), the tensors counted at the end (states, activations autograd saved), and the first step's peak
(which holds the pipeline's cut: forwards of the whole model on every rank). On CPU the host is the same heap.

A benchmark, not a test: minutes of CPU; the result is printed, and written
to ``--report`` (default: the run store's ``reports/heap-<date>.md``).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from dataclasses import replace
from typing import Any

# pp without a schedule token is chosen for the model (`planner.choose_schedule`): named here, so that the matrix stays
# the one measured (1F1B was the default then), with the zero-bubble schedules' B/W split beside them.
EIGHT = ["dp_tp2_pp2_1f1b", "zero1_tp2_pp2_1f1b", "zero2_tp2_pp2_1f1b", "zero3_tp2_pp2_1f1b", "zero3_tp2_pp2_1f1b_ac",
         "zero3_tp2_pp2_1f1b_mb4", "naive_tp2_pp2_1f1b", "zero1_tp2_pp2_1f1b_sp", "zero2_tp2_pp2_interleaved_v2_mb4"]
FOUR = ["zero2_tp2", "zero3_pp2_1f1b", "zero1_pp2_interleaved_v2_mb4", "zero3_tp2_sp", "tp2_pp2_1f1b_sp",
        "zero3_offload_pp2_1f1b", "zero3_tp2_vp", "zero1_pp2_zb1p_mb4", "dp_pp2_dualpipev"]
DEFAULT = ",".join([f"{p}:8" for p in EIGHT] + [f"{p}:4" for p in FOUR])
GOAL = 0.05
MiB = 2**20


def stage_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per pipeline stage: the estimator's peak (every rank of a stage alike), its first rank's measured
    figures, the range of its ranks' heap peaks, and the error of the rank furthest from the prediction."""
    from strategies.plan import ParallelPlan
    from strategies.runs import MEMORY_CATEGORIES

    world = result["world_size"]
    plan = ParallelPlan.parse(result["label"]).resolve(world)
    rows: dict[int, dict[str, Any]] = {}
    for rank, measured in enumerate(result["memory_bytes_per_rank"]):
        stage = plan.coordinates(rank)["pp"]
        predicted = sum(result["predicted"]["memory"][rank].get(k, 0.0) for k in MEMORY_CATEGORIES)
        peak = measured["heap_peak"]
        error = (predicted - peak) / peak
        row = rows.setdefault(stage, {
            "stage": stage, "rank": rank, "predicted": predicted, "heap_peak": peak, "low": peak, "high": peak,
            "states": measured["total"], "activations": measured.get("activations_peak", 0),
            "temporaries": measured.get("temporaries", 0), "first_step": measured["heap_first_step"],
            "error": error, "at": (result["predicted"].get("peak_at") or [""] * plan.pp)[stage]})
        row["low"], row["high"] = min(row["low"], peak), max(row["high"], peak)
        if abs(error) > abs(row["error"]):
            row["error"] = error
    return [rows[s] for s in sorted(rows)]


def report(rows: dict[str, list[dict[str, Any]] | str], command: str, setup: str = "") -> str:
    lines = [f"# Predicted memory beside the heap ({datetime.date.today().isoformat()})", "", f"`{command}`", "",
             *([setup, ""] if setup else []),
             "MiB per rank. Predicted: the estimator's peak (`measure.peak`: states, activations and temporaries "
             "at the action it names). Heap peak: the stage's first rank, and the range over its ranks. Error: "
             f"(predicted - measured) / measured for the stage's rank furthest off; goal within {GOAL:.0%}. States, "
             "activations (saved for backward) and temporaries (the rest of the peak) as the first rank measured them.",
             "",
             "| plan | stage (rank) | predicted (at) | heap peak (ranks) | error | states | activations | temporaries "
             "| first step | goal |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for plan, stages in rows.items():
        if isinstance(stages, str):
            lines.append(f"| {plan} | failed: {stages} |")
            continue
        for r in stages:
            counted = " | ".join(f"{r[k] / MiB:.2f}" for k in ("states", "activations", "temporaries", "first_step"))
            lines.append(f"| {plan} | {r['stage']} ({r['rank']}) | {r['predicted'] / MiB:.2f} ({r['at']}) | "
                         f"{r['heap_peak'] / MiB:.2f} ({r['low'] / MiB:.2f}-{r['high'] / MiB:.2f}) | {r['error']:+.1%} "
                         f"| {counted} | {'met' if abs(r['error']) <= GOAL else 'missed'} |")
    met = sum(abs(r["error"]) <= GOAL for stages in rows.values() if not isinstance(stages, str) for r in stages)
    total = sum(len(stages) for stages in rows.values() if not isinstance(stages, str))
    return "\n".join(lines + ["", f"{met} of {total} stages within {GOAL:.0%} on every rank."]) + "\n"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from strategies.cli.train import add_run_options

    p = sub.add_parser("heap", help="the estimator's memory per rank beside the measured heap, for the 3D matrix")
    p.add_argument("--plans", default=DEFAULT, help="plan:devices, comma-separated (default: the 3D matrix)")
    p.add_argument("--report", default=None,
                   help="write the markdown here (default: the run store's reports/heap-<date>.md)")
    add_run_options(p)
    p.set_defaults(func=command, steps=6, wandb="off", warmup_steps=0, heap=True)
    p.set_defaults(batch_size=16, seq_len=128, n_embd=128, n_layer=4, n_head=4)


def command(args: argparse.Namespace) -> int:
    from strategies.cli.compare import parse_plans, run_in_subprocess
    from strategies.cli.reports import write_report
    from strategies.cli.train import config_from

    rows: dict[str, list[dict[str, Any]] | str] = {}
    base = config_from(args, "dp")  # --heap is this command's default
    with tempfile.TemporaryDirectory(prefix="stratpack_heap_") as tmp:
        for index, (plan, devices) in enumerate(parse_plans(args.plans)):
            print(f"{plan} on {devices} ranks...", file=sys.stderr, flush=True)
            result = run_in_subprocess(replace(base, strategy=plan, devices=devices), tmp, index)
            rows[f"{plan} ({devices})"] = (result["error"].splitlines()[-1] if "error" in result
                                           else stage_rows(result))
    command_line = " ".join(["stratpack heap", *sys.argv[2:]]) if sys.argv[1:2] == ["heap"] else "stratpack heap"
    setup = (f"Demo GPT {base.n_layer} x {base.n_embd}, {base.n_head} heads, sequence {base.seq_len}, global batch "
             f"{base.batch_size}, {base.optimizer}, {base.precision}, {base.steps} steps; CPU ranks (gloo).")
    text = report(rows, command_line, setup)
    write_report(text, args.report, "heap")
    return 1 if any(isinstance(v, str) for v in rows.values()) else 0
