"""``stratpack drift``: long runs beside one process. Each plan trains the workload for ``--steps`` optimizer steps
(1,000 by default) in fp32, as does the single-device reference, and the table gives, for each window of ``--window``
steps, the largest relative difference of a step's loss from the reference's. The runs differ only in the order of float
sums, so this shows how far that rounding carries over a long run (the equivalence tests take 2-8 steps).

A benchmark, not a test: minutes of CPU; the result is printed, and written
to ``--report`` (default: the run store's ``reports/drift-<date>.md``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from typing import Any

DEFAULT = "tp2:2,pp2_1f1b_mb4:2,zero3:2,zero3_tp2_pp2:8"
GOAL = 1e-3


def windows(losses: list[float], reference: list[float], window: int) -> list[float]:
    """The largest relative loss difference in each window of ``window`` steps."""
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
    return [max(rel[i : i + window]) for i in range(0, len(rel), window)]


def report(rows: dict[str, list[float] | str], window: int, steps: int, command: str, setup: str = "") -> str:
    """The markdown table: one row per plan, one column per window (or the run's error)."""
    heads = [f"{i + 1}-{min(i + window, steps)}" for i in range(0, steps, window)]
    what = (f"Largest relative difference of a step's loss from the single-process run's, per {window} steps "
            f"(goal <= {GOAL:g} in fp32).")
    lines = [f"# Loss drift over {steps} steps beside one process", "", f"`{command}`", "",
             *([setup, ""] if setup else []), what, "",
             "| plan | " + " | ".join(heads) + " | max | goal |", "|---" * (len(heads) + 3) + "|"]
    for plan, values in rows.items():
        if isinstance(values, str):
            lines.append(f"| {plan} | failed: {values} |")
            continue
        worst = max(values)
        lines.append(f"| {plan} | " + " | ".join(f"{v:.1e}" for v in values)
                     + f" | {worst:.1e} | {'met' if worst <= GOAL else 'missed'} |")
    return "\n".join(lines) + "\n"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from strategies.cli.train import add_run_options

    p = sub.add_parser("drift", help="train plans for many steps beside one process and report the loss drift")
    p.add_argument("--plans", default=DEFAULT, help=f"plan:devices, comma-separated (default {DEFAULT})")
    p.add_argument("--window", type=int, default=100, help="steps per column of the table")
    p.add_argument("--report", default=None,
                   help="write the markdown here (default: the run store's reports/drift-<date>.md)")
    add_run_options(p)
    p.set_defaults(func=command, steps=1000, wandb="off", warmup_steps=0)
    p.set_defaults(batch_size=8, seq_len=32, n_embd=32)


def command(args: argparse.Namespace) -> int:
    from strategies.cli.compare import parse_plans
    from strategies.cli.reports import write_report
    from strategies.cli.train import SINGLE, config_from

    base = config_from(args, SINGLE)
    rows: dict[str, list[float] | str] = {}
    with tempfile.TemporaryDirectory(prefix="stratpack_drift_") as tmp:
        reference = _run(base, tmp, 0)
        if "error" in reference:
            print(reference["error"], file=sys.stderr)
            return 1
        for index, (plan, devices) in enumerate(parse_plans(args.plans), start=1):
            result = _run(replace(base, strategy=plan, devices=devices), tmp, index)
            rows[f"{plan} ({devices} ranks)"] = (result["error"].splitlines()[-1] if "error" in result
                                                 else windows(result["losses"], reference["losses"], args.window))
    command_line = " ".join(["stratpack drift", *sys.argv[2:]]) if sys.argv[1:2] == ["drift"] else "stratpack drift"
    setup = (f"Demo GPT {base.n_layer} x {base.n_embd}, {base.n_head} heads, sequence {base.seq_len}, global batch "
             f"{base.batch_size}, {base.optimizer} lr {base.lr:g}, {base.precision}, seed {base.seed}; "
             f"{args.accelerator} ranks.")
    text = report(rows, args.window, args.steps, command_line, setup)
    write_report(text, args.report, "drift")
    return 1 if any(isinstance(v, str) for v in rows.values()) else 0


def _run(config: Any, tmp: str, index: int) -> dict[str, Any]:
    from strategies.cli.compare import run_in_subprocess

    print(f"{config.strategy} on {config.devices if index else 1} rank(s), {config.steps} steps...", file=sys.stderr,
          flush=True)
    return run_in_subprocess(config, tmp, index)
