"""``stratpack sweep``: does the planner pick what a measured sweep would? Every candidate plan for the workload at
``--devices`` ranks is predicted with this machine's calibration (`strategies.measure.calibrate`) and then trained
for a few steps; the table puts predicted beside measured step time, and compares the planner's top pick with the
fastest plan measured. A benchmark (minutes), printed and written to
``--report`` (default: the run store's ``reports/sweep-<date>.md``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace
from typing import Any

GOAL_STEP, GOAL_PICK = 0.25, 0.10


def add_parser(sub: argparse._SubParsersAction) -> None:
    from strategies.cli.train import add_run_options

    p = sub.add_parser("sweep", help="predict and measure every candidate plan for the workload; the planner's pick "
                                     "against the fastest")
    p.add_argument("--plans", default=None, help="comma-separated (default: the planner's candidates, no offload)")
    p.add_argument("--report", default=None,
                   help="write the markdown here (default: the run store's reports/sweep-<date>.md)")
    add_run_options(p)
    p.add_argument("--repeat", type=int, default=3,
                   help="runs per plan, in alternating order (the median is measured: one run is noisy here)")
    p.set_defaults(func=command, devices=4, steps=12, warmup_steps=4, wandb="off")


def command(args: argparse.Namespace) -> int:
    from strategies.cli.plan import calibrated_hardware, workload_costs, workload_shape
    from strategies.cli.reports import write_report
    from strategies.cli.train import config_from

    base = config_from(args, "dp")
    shape = workload_shape(base)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / base.devices
    hw = replace(calibrated_hardware(base.devices, memory), costs=workload_costs(shape, base.devices))
    ranked = predicted_plans(shape, hw, base, args.plans)
    measured = measure_plans([label for label, _ in ranked], base, args.repeat)
    text = report([(label, seconds, measured[label]) for label, seconds in ranked], base, hw, args.repeat)
    write_report(text, args.report, "sweep")
    return 0


def measure_plans(labels: list[str], base: Any, repeat: int) -> dict[str, float | None]:
    """Each plan's median step time over ``repeat`` runs, the order reversed on every other round (None: failed)."""
    from statistics import median

    from strategies.cli.compare import run_in_subprocess

    times: dict[str, list[float]] = {label: [] for label in labels}
    with tempfile.TemporaryDirectory(prefix="stratpack_sweep_") as tmp:
        for round_ in range(repeat):
            order = labels if round_ % 2 == 0 else labels[::-1]
            for index, label in enumerate(order):
                print(f"[round {round_ + 1}/{repeat}, {index + 1}/{len(order)}] {label}...", file=sys.stderr,
                      flush=True)
                result = run_in_subprocess(replace(base, strategy=label), tmp, round_ * len(labels) + index)
                if "error" not in result and result.get("step_time_s"):
                    times[label].append(result["step_time_s"])
    return {label: median(t) if t else None for label, t in times.items()}


def predicted_plans(shape: Any, hw: Any, config: Any, plans: str | None) -> list[tuple[str, float]]:
    """(plan, predicted seconds a step), fastest first: the planner's candidates that divide the batch."""
    from strategies.measure.planner import rank_plans

    ranked = rank_plans(shape, hw, config.batch_size, precision=config.precision)
    wanted = [p.strip() for p in plans.split(",")] if plans else None
    return [(r.label, r.seconds) for r in ranked
            if (wanted is None and "offload" not in r.label) or (wanted is not None and r.label in wanted)]


def report(rows: list[tuple[str, float, float | None]], config: Any, hw: Any, repeat: int = 1) -> str:
    """Markdown: predicted beside measured per plan, then the pick against the fastest."""
    measured = [r for r in rows if r[2]]
    fastest = min(measured, key=lambda r: r[2]) if measured else None
    pick = rows[0] if rows else None
    order = {label: k + 1 for k, (label, _, _) in enumerate(sorted(measured, key=lambda r: r[2]))}
    lines = [f"# Planner against a measured sweep: demo GPT {config.n_layer} x {config.n_embd}, sequence "
             f"{config.seq_len}, global batch {config.batch_size}, {config.devices} {config.accelerator} ranks", "",
             f"Calibrated: {hw.flops / 1e9:.1f} GFLOP/s per rank; "
             + ", ".join(f"{k} {lat * 1e3:.2f} ms + {bw / 1e6:.0f} MB/s"
                         for k, (lat, bw) in hw.calibration.links.items())
             + (f"; per step: Lightning's loop {hw.costs.loop * 1e3:.1f} ms, a block "
                f"{hw.costs.block[1][0] * 1e3:.2f} ms + {hw.costs.block[1][1] * 1e6:.1f} us per token (tp1)"
                if hw.costs else "")
             + f". Measured: the median over {repeat} runs (alternating order) of the mean step of "
             f"{config.steps} steps, the first {config.warmup_steps} left out.", "",
             "| predicted rank | plan | predicted s/step | measured s/step | error | measured rank |",
             "|---|---|---|---|---|---|"]
    for k, (label, predicted, got) in enumerate(rows, start=1):
        error = f"{predicted / got - 1:+.0%}" if got else "-"
        lines.append(f"| {k} | {label} | {predicted:.4f} | {got:.4f} | {error} | {order[label]} |" if got
                     else f"| {k} | {label} | {predicted:.4f} | failed | - | - |")
    if fastest and pick and pick[2]:
        within = sum(abs(p / g - 1) <= GOAL_STEP for _, p, g in measured)
        lines += ["", f"- predicted within {GOAL_STEP:.0%} of measured: {within} of {len(measured)} plans",
                  f"- the planner's pick `{pick[0]}` measured {pick[2]:.4f} s; the fastest `{fastest[0]}` "
                  f"{fastest[2]:.4f} s: the pick is {pick[2] / fastest[2] - 1:+.1%} "
                  f"(goal within {GOAL_PICK:.0%})"]
    return "\n".join(lines) + "\n"
