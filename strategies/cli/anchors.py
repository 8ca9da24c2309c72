"""`stratpack rehearse --anchors`: the runs torchtitan and Meta published, one rank of each rehearsed under the pack's
plan for it, beside the anchor's memory per GPU (`../shared/MEMORY-NOTES.md`: torchtitan's
`benchmarks/llama3_h100_202412_torchtitan.md`, the allocator's reserved peak; Meta's "The Llama 3 Herd of Models",
section 3.3.2, which gives only that the run fits 80 GB). The goal (issue 58): at most 0.9 of the anchor's figure,
set-up included (a rehearsal counts tensors, an allocator reserves more)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

# (workload, ranks, the pack's plan, global batch, the anchor's GiB per GPU, the anchor's run)
ANCHORS = [
    ("llama3-8b", 8, "zero3_dp8_sac", 16, 82.4, "torchtitan 8B, FSDP 8, local batch 2, selective AC (op-level; "
     "as the pack's sac: every second matmul's output kept)"),
    ("llama3-8b", 8, "zero3_dp8_ac", 16, 82.4, "the same, full AC"),
    ("llama3-70b", 256, "zero3_dp32_tp8_sp_vp_ac", 512, 71.9, "torchtitan 70B, FSDP 32 x TP 8, local batch 16, "
     "full AC"),
    ("llama3-405b", 512, "zero2_dp8_tp8_sp_vp_pp8_1f1b_mb32_ac", 256, 82.5, "torchtitan 405B, FSDP 8 x TP 8 x PP 8, "
     "local batch 32, full AC, 1F1B (its TP plan splits the embedding and output by vocabulary, loss parallel: vp)"),
    ("llama3-405b", 512, "zero2_dp8_tp8_sp_vp_pp8_interleaved_v2_mb32_ac", 256, 72.7, "the same, interleaved"),
    ("llama3-405b", 8192, "zero2_dp64_tp8_sp_vp_pp16_interleaved_v2_mb32", 2048, 80.0, "Meta, 8,192 H100 80 GB, "
     "tp8 pp16, 32 sequences per DP rank, no AC (fits 80 GB)"),
    ("llama3-405b", 8192, "zero2_dp64_tp8_sp_vp_pp16_interleaved_v2_mb32_ac", 2048, 80.0, "the same with the least "
     "recompute that fits (sac: 98.2 GiB, ac2: 107.1 on rank 0; docs/memory-anchors.md)"),
]
GOAL = 0.9


def anchor_row(row: tuple, base: Any, rehearse_ends: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """``row`` of `ANCHORS` rehearsed by ``rehearse_ends`` (`cli.rehearse`: the first and last stage's first rank),
    with bf16 copies of the weights for compute (``param_dtype``), as every anchor computes (FSDP2's param_dtype,
    Megatron's half weights)."""
    workload, world, plan, batch, anchor, run = row
    out = rehearse_ends(replace(base, strategy=plan, workload=workload, batch_size=batch, param_dtype="bf16"), world)
    return {**out, "anchor": anchor * 2**30, "run": run}


def report(rows: list[dict[str, Any]], command: str) -> str:
    GiB = 2**30
    lines = [f"# The anchors' published runs, rehearsed ({time.strftime('%Y-%m-%d')})", "", f"`{command}`", "",
             "One rank of each run rehearsed on this machine (`--target cuda`: NCCL's ranks, bf16-mixed with "
             "`param_dtype=torch.bfloat16` (`--param-dtype bf16`, as the anchors compute), AdamW, "
             "sequences of 8,192 tokens): the first and the last pipeline stage's first rank, the worse shown. "
             f"GiB per GPU; goal: the larger of the steady and set-up peaks at most {GOAL} x the anchor's.", "",
             "| anchor's run | ranks | the pack's plan | rank | anchor | rehearsed steady | set-up | estimator | "
             "/ anchor | s |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | {r['ranks']:,} | `{r['plan']}` | failed: {r['error']} |")
            continue
        worst = max(r["rehearsed"], r["setup"])
        lines.append(f"| {r['run']} | {r['ranks']:,} | `{r['plan']}` | {r['rank']} | {r['anchor'] / GiB:.1f} | "
                     f"{r['rehearsed'] / GiB:,.1f} | {r['setup'] / GiB:,.1f} | {r['predicted'] / GiB:,.1f} | "
                     f"{worst / r['anchor']:.2f} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def run_anchors(args: argparse.Namespace, base: Any, rehearse_ends: Callable[..., dict[str, Any]]) -> int:
    from strategies.cli.reports import write_report

    rows = []
    for row in ANCHORS:
        try:
            rows.append(anchor_row(row, base, rehearse_ends))
        except Exception as err:  # noqa: BLE001 - a row that fails is reported, the others still run
            rows.append({"run": row[5], "ranks": row[1], "plan": row[2],
                         "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"})
        print({k: v for k, v in rows[-1].items() if k != "run"}, flush=True)
    text = report(rows, "stratpack rehearse --anchors")
    if args.report:
        write_report(text, args.report, "anchors")
    else:
        print(text)
    return 0
