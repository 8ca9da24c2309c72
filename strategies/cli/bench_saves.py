"""``stratpack bench-saves``: what checkpointing costs training, synchronous against asynchronous.

The same fit four times, each its own `stratpack train` process, one after the other in one session: no saving,
saving every ``--every`` steps synchronously by slice (torch's DCP), the same asynchronously (``--async-save``), and
synchronously in the gathered format the pack wrote before (every rank gathering the whole state). Reported: the stall
per save on rank 0 (how long training waited: Lightning's dump of the state to the end of its barrier after the save,
`checkpoint.async_save.SaveStalls`), asynchronous over synchronous as a ratio, the background write's time, and the
steps per second of each run against the run without saving (timed steps after the warm-up, which hold every save).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any

MODES = ("off", "sync", "async", "gathered")  # gathered: synchronous, in the format before #59 (every rank whole)


def _config(args: argparse.Namespace, mode: str, folder: str) -> Any:
    from strategies.cli.train import RunConfig

    return RunConfig(strategy=args.plan, devices=args.devices, steps=args.steps, batch_size=args.batch_size,
                     seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                     warmup_steps=args.warmup_steps, wandb="off", check_first_batch=False, runs_dir=args.runs_dir,
                     checkpoint_dir=os.path.join(folder, mode) if mode != "off" else None,
                     checkpoint_every=args.every if mode != "off" else None, async_save=mode == "async",
                     checkpoint_format="gathered" if mode == "gathered" else "dcp")


def row(mode: str, result: dict[str, Any], off: dict[str, Any] | None) -> dict[str, Any]:
    """One mode's figures (rank 0's saves) from its `stratpack train` result."""
    saves = result.get("checkpoint") or {}
    step = result.get("step_time_s")
    steps_per_s = 1 / step if step else None
    base = 1 / off["step_time_s"] if off and off.get("step_time_s") else None
    return {"mode": mode, "steps/s": steps_per_s, "vs off": steps_per_s / base if steps_per_s and base else None,
            "saves": saves.get("saves", 0), "stall s": saves.get("stall_s"), "first s": saves.get("stall_s_first"),
            "later s": saves.get("stall_s_later"), "write s": saves.get("write_s")}


def report(rows: list[dict[str, Any]], args: argparse.Namespace, num_params: int | None) -> str:
    by = {r["mode"]: r for r in rows}
    ratio, later = (_ratio(by, key) for key in ("stall s", "later s"))
    lines = [f"# stratpack bench-saves: {args.plan} at {args.devices} ranks, "
             f"{(num_params or 0) / 1e6:.0f}M parameters, a save every {args.every} steps", "",
             f"`stratpack bench-saves --plan {args.plan} --devices {args.devices} --n-layer {args.n_layer} --n-embd "
             f"{args.n_embd} --steps {args.steps} --every {args.every}`: {args.steps} steps, each mode a fresh "
             "process, one after the other on this machine.", "",
             "| saving | steps/s | against no saving | saves | stall per save (s) | first save (s) | later saves (s) "
             "| background write (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {_f(r['steps/s'], '.3f')} | {_f(r['vs off'], '.2f')}x | {r['saves']} | "
                     f"{_f(r['stall s'], '.2f')} | {_f(r['first s'], '.2f')} | {_f(r['later s'], '.2f')} | "
                     f"{_f(r['write s'], '.2f')} |")
    lines += ["", f"Stall per save, asynchronous / synchronous: **{_f(ratio, '.3f')}** over every save, "
              f"**{_f(later, '.3f')}** after the first (goal: at most 0.1 from the first save on)."]
    gathered = by.get("gathered", {}).get("stall s")
    if gathered and by.get("sync", {}).get("stall s"):
        lines += ["", f"Synchronous stall by slice / gathered (the format before #59): "
                      f"**{by['sync']['stall s'] / gathered:.3f}**."]
    return "\n".join(lines) + "\n"


def _ratio(by: dict[str, dict[str, Any]], key: str) -> float | None:
    sync, asynchronous = by.get("sync", {}).get(key), by.get("async", {}).get(key)
    return asynchronous / sync if sync and asynchronous else None


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-saves", help="the training stall of a checkpoint save, asynchronous against synchronous")
    p.add_argument("--plan", default="dp")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=16)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4, help="global")
    p.add_argument("--steps", type=int, default=35)
    p.add_argument("--every", type=int, default=10, help="save every this many optimizer steps")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--runs-dir", default=None)
    p.add_argument("--report", default=None,
                   help="write the markdown here (default: the run store's reports/bench-saves-<date>.md)")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    from strategies.cli.compare import run_in_subprocess
    from strategies.cli.reports import write_report

    folder = tempfile.mkdtemp(prefix="stratpack-saves-")
    rows, results = [], {}
    try:
        for index, mode in enumerate(MODES):
            results[mode] = run_in_subprocess(_config(args, mode, folder), folder, index)
            if "error" in results[mode]:
                print(f"{mode}: failed\n{results[mode]['error']}")
                return 1
            rows.append(row(mode, results[mode], results.get("off")))
            shutil.rmtree(os.path.join(folder, mode), ignore_errors=True)  # (the disk: a few GB a mode)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    write_report(report(rows, args, results["off"].get("num_params")), args.report, "bench-saves")
    return 0
