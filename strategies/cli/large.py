"""``stratpack large``: a model whose whole fp32 weights, once per rank, exceed this machine's memory, built in
``configure_model`` (on meta) and trained for ``--steps`` under each plan, each rank making only its slice.

Per rank the report gives the set-up peak (the heap from before the build to the end of the first step) and the steady
peak (the heap's, over the later steps) beside the estimator's; and for the same model built in ``__init__`` (whole,
on every rank) the estimator's set-up peak summed over the ranks against this machine's memory: not run, since it
would not fit. A plan whose predicted set-up, summed over its ranks, would not fit either is skipped, with why.

A benchmark, not a test: minutes of CPU; the result is printed, and written
to ``--report`` (default: the run store's ``reports/large-<date>.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import tempfile
from typing import Any

# One microbatch for the 3D plan: ZeRO-3 under pp holds each stage's gradients whole until its last microbatch's
# backward (why DeepSpeed refuses the pair); with two, this model's 8 ranks need about 21 GiB, more than is left here
DEFAULT = "zero3:8,zero3_tp2_pp2_gpipe_mb1:8"
RANK_OVERHEAD = 0.35 * 2**30  # what a CPU rank's interpreter, torch and Lightning hold before any model (measured)
GiB, MiB = 2**30, 2**20


def add_parser(sub: argparse._SubParsersAction) -> None:
    from strategies.cli.train import add_run_options

    p = sub.add_parser("large", help="train a model larger than this machine holds once per rank, by slice, with "
                                     "each rank's set-up and steady peaks beside the estimator's")
    p.add_argument("--plans", default=DEFAULT, help="plan:devices, comma-separated")
    p.add_argument("--report", default=None,
                   help="write the markdown here (default: the run store's reports/large-<date>.md)")
    add_run_options(p)
    p.set_defaults(func=command, steps=2, wandb="off", warmup_steps=0, heap=True, configure_model=True,
                   optimizer="sgd-plain", check_first_batch=False)
    p.set_defaults(batch_size=8, seq_len=16, n_embd=1024, n_layer=64, n_head=8)


def _shape(base: Any) -> dict[str, int]:
    """The demo's config as the estimator reads it (its character vocabulary: a few dozen tokens, taken as 256)."""
    return {"n_layer": base.n_layer, "n_embd": base.n_embd, "n_head": base.n_head, "seq_len": base.seq_len,
            "vocab_size": 256}


def _predict(base: Any, plan: str, devices: int, deferred: bool) -> dict | None:
    from strategies.measure.predict import predict_run

    return predict_run(plan, devices, _shape(base), base.batch_size, base.accumulate, base.precision, "cpu",
                       optimizer=base.optimizer, deferred=deferred)


def command(args: argparse.Namespace) -> int:
    from strategies.cli.compare import parse_plans, run_in_subprocess
    from strategies.cli.reports import write_report
    from strategies.cli.train import config_from

    base = config_from(args, "dp")
    # glibc raises its mmap threshold as large blocks are freed, and then keeps freed blocks in the heap: the ranks'
    # resident memory was 2.5x the heap in use (19 against 8 GiB at 0.4B). A fixed threshold returns them.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**20))
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    from strategies.measure.estimate import ModelShape

    h = base.n_embd
    params = ModelShape.from_config(_shape(base)).total()  # the demo's count (exact for it: `estimate`)
    lines = [f"# A model larger than this machine holds once per rank ({datetime.date.today().isoformat()})", "",
             f"`stratpack large {' '.join(sys.argv[2:])}`".replace(" `", "`"), "",
             f"Demo GPT {base.n_layer} x {h}, {base.n_head} heads: {params / 1e9:.2f}B parameters, "
             f"{4 * params / GiB:.2f} GiB of fp32 weights; sequence {base.seq_len}, global batch {base.batch_size}, "
             f"{base.optimizer}, {base.steps} steps; this machine: {machine / GiB:.1f} GiB, CPU ranks (gloo), heap "
             "sampled (`--heap`). MiB per rank.", ""]
    failed = False
    with tempfile.TemporaryDirectory(prefix="stratpack_large_") as tmp:
        for index, (plan, devices) in enumerate(parse_plans(args.plans)):
            lines += _plan_section(base, plan, devices, machine, params, tmp, index, run_in_subprocess)
            failed = failed or "failed:" in lines[-1]
    write_report("\n".join(lines) + "\n", args.report, "large")
    return 1 if failed else 0


def _plan_section(base: Any, plan: str, devices: int, machine: float, params: int, tmp: str, index: int,
                  run: Any) -> list[str]:
    """The report's lines for one plan: built whole (predicted, not run), then built on meta (run, if it fits)."""
    whole, meta = _predict(base, plan, devices, False), _predict(base, plan, devices, True)
    if whole is None or meta is None:
        return [f"## {plan} on {devices} ranks", "", "failed: the estimator cannot predict this plan", ""]
    need_whole = sum(whole["setup"]) + devices * RANK_OVERHEAD
    need = sum(meta["setup"]) + devices * RANK_OVERHEAD
    out = [f"## {plan} on {devices} ranks", "",
           f"Built in `__init__`, every rank first holds the whole model ({4 * params / GiB:.2f} GiB): predicted "
           f"set-up {need_whole / GiB:.1f} GiB over the {devices} ranks, against {machine / GiB:.1f} GiB: "
           + ("not run, it does not fit." if need_whole > machine else "it would fit here."),
           f"Built in `configure_model`: predicted {need / GiB:.1f} GiB over the ranks.", ""]
    if need > 0.95 * machine:
        return out + [f"skipped: {need / GiB:.1f} GiB predicted does not fit {machine / GiB:.1f} GiB", ""]
    print(f"{plan} on {devices} ranks...", file=sys.stderr, flush=True)
    result = run(dataclasses.replace(base, strategy=plan, devices=devices), tmp, index)
    if "error" in result:
        return out + [f"failed: {result['error'].splitlines()[-1]}", ""]
    return out + _rank_table(result) + [f"{result['steps']} steps, {result['step_time_s']:.1f} s a step", ""]


def _rank_table(result: dict[str, Any]) -> list[str]:
    from strategies.runs import MEMORY_CATEGORIES

    rows = ["| rank | set-up measured | set-up predicted | steady measured | steady predicted |",
            "|---|---|---|---|---|"]
    predicted = result["predicted"]
    for rank, measured in enumerate(result["memory_bytes_per_rank"]):
        steady = sum(predicted["memory"][rank][k] for k in MEMORY_CATEGORIES if k != "host")
        rows.append(f"| {rank} | {measured['setup_peak'] / MiB:,.0f} | {predicted['setup'][rank] / MiB:,.0f} | "
                    f"{measured['heap_peak'] / MiB:,.0f} | {steady / MiB:,.0f} |")
    return rows + [""]
