"""What `stratpack bench` writes: the table (markdown or CSV), and each measured side as a run in the run store."""

from __future__ import annotations

import csv
import platform
import time
from dataclasses import asdict
from typing import Any

# How each implementation is shown.
NAMES = {
    "dp": "dp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "tp": "tp", "pp_1f1b": "pp 1F1B",
    "tp_sp": "tp + sp", "tp_sp_async": "tp + sp, async",
    "pp_gpipe": "pp GPipe", "pp_interleaved": "pp interleaved", "torch_ddp": "torch DDP",
    "deepspeed1": "DeepSpeed ZeRO-1", "deepspeed2": "DeepSpeed ZeRO-2", "deepspeed3": "DeepSpeed ZeRO-3",
    "deepspeed_moe": "DeepSpeed-MoE",
    "fsdp2": "torch FSDP2", "zero3_bf16": "zero3, param_dtype bf16", "fsdp2_bf16": "torch FSDP2, param_dtype bf16",
    "dtensor_tp": "torch DTensor TP", "torch_pp_1f1b": "torch Schedule1F1B",
    "torch_pp_gpipe": "torch ScheduleGPipe", "torch_pp_interleaved": "torch ScheduleInterleaved1F1B",
    "pp_zb1p": "pp ZB-H1", "pp_zbv": "pp ZB-V", "pp_dualpipev": "pp DualPipeV",
    "torch_pp_zb1p": "torch ScheduleInterleavedZeroBubble", "torch_pp_zbv": "torch ScheduleZBVZeroBubble",
    "torch_pp_dualpipev": "torch ScheduleDualPipeV",
}
CSV_COLUMNS = ["ours", "peer", "pairs", "ours_tokens_per_s", "peer_tokens_per_s", "median_ratio", "ratios",
               "ours_peak_MiB_per_rank", "peer_peak_MiB_per_rank", "predicted_peak_MiB_per_rank", "skipped"]
BENCH_KEYS = ("ours", "peer", "pairs", "median_ratio", "ratios", "ours_tokens_per_s", "peer_tokens_per_s",
              "ours_peak_bytes", "peer_peak_bytes", "predicted_peak_bytes")


def _mib(values: list[float] | None, sep: str) -> str:
    return sep.join(f"{x / 2**20:.{1 if sep == ' / ' else 2}f}" for x in values) if values else ""


def format_report(results: list[dict[str, Any]]) -> str:
    """Markdown: throughput and its ratio, then each rank's peak memory for both sides and the estimate."""
    lines = ["| ours | peer | ours tokens/s | peer tokens/s | median ratio | pairs | peak MiB/rank ours | peer | "
             "estimate |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        names = f"| {NAMES.get(r['ours'], r['ours'])} | {NAMES.get(r['peer'], r['peer'])} |"
        if "skipped" in r:
            lines.append(f"{names} - | - | skipped: {r['skipped']} | 0 | - | - | - |")
            continue
        mib = [_mib(r[key], " / ") or "-" for key in ("ours_peak_bytes", "peer_peak_bytes", "predicted_peak_bytes")]
        lines.append(f"{names} {r['ours_tokens_per_s']:,.0f} | {r['peer_tokens_per_s']:,.0f} | "
                     f"{r['median_ratio']:.3f} | {r['pairs']} | {mib[0]} | {mib[1]} | {mib[2]} |")
    return "\n".join(lines)


def write_report(results: list[dict[str, Any]], description: str, path: str) -> None:
    """The table as markdown (``.md``, under ``description``: how it was measured) or CSV (any other suffix)."""
    if path.endswith(".md"):
        with open(path, "w") as f:
            f.write(f"# stratpack bench, {time.strftime('%Y-%m-%d %H:%M')}\n\n{description}\n\n"
                    f"{format_report(results)}\n")
        return
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(CSV_COLUMNS)
        for r in results:
            if "skipped" in r:
                out.writerow([r["ours"], r["peer"], 0, "", "", "", "", "", "", "", r["skipped"]])
                continue
            out.writerow([r["ours"], r["peer"], r["pairs"], f"{r['ours_tokens_per_s']:.1f}",
                          f"{r['peer_tokens_per_s']:.1f}", f"{r['median_ratio']:.4f}",
                          " ".join(f"{x:.4f}" for x in r["ratios"]), _mib(r["ours_peak_bytes"], " "),
                          _mib(r["peer_peak_bytes"], " "), _mib(r["predicted_peak_bytes"], " "), ""])


def write_runs(results: list[dict[str, Any]], cfg: Any, model: dict[str, Any], root: str | None = None) -> str:
    """Each measured side of each pair as one run in the run store, all under one comparison id ("bench-..."), so
    the dashboard shows them side by side. A run's records are every rank's step times from the pair whose ratio
    was the median; its memory is ``max_allocated`` (the profiled peak, see `bench._worker`); ``meta.bench`` and
    ``summary.bench`` hold the pair, the ratios and both sides' figures. ``model``: the workload's config."""
    from strategies import runs
    from strategies.measure.estimate import ModelShape

    comparison = runs.new_comparison_id("bench")
    num_params = ModelShape.from_config(model).total()  # exact for the demo GPT (tests/unit/test_estimate.py)
    for result in results:
        if "skipped" not in result:
            for role in ("ours", "peer"):
                _write_side(result, role, cfg, root, comparison, model=model, num_params=num_params)
    return comparison


def _write_side(result: dict[str, Any], role: str, cfg: Any, root: str | None, comparison: str, **meta: Any) -> None:
    from strategies import runs
    from strategies.cli.bench_engines import plan_of
    from strategies.plan import ParallelPlan

    impl = result[role]
    bench = {key: result[key] for key in BENCH_KEYS}
    plan = ParallelPlan.parse(plan_of(impl, cfg.world_size)).resolve(cfg.world_size)
    run_id = runs.new_run_id(f"bench-{impl}")
    writers = [runs.RunWriter(root, run_id, rank) for rank in range(cfg.world_size)]
    writers[0].write_meta(runs.run_meta(
        run_id=run_id, label=NAMES.get(impl, impl), comparison=comparison, world_size=cfg.world_size,
        devices=[platform.processor() or "cpu"], plan=plan if role == "ours" else None, degrees_of=plan,
        seed=cfg.seed, predicted=result["predicted"], bench={**bench, "role": role, "config": asdict(cfg)}, **meta))
    peaks = result[f"{role}_peak_bytes"]
    for rank, writer in enumerate(writers):
        got = result["runs"][impl][rank]
        for step, (seconds, end) in enumerate(zip(got["step_times"], got["step_ends"]), start=1):
            writer.append({"step": step, "time": end, "step_time_s": seconds, "loss": None, "lr": cfg.lr,
                           "tokens_per_s": got["tokens_per_step"] / seconds, "memory": {"max_allocated": peaks[rank]},
                           "comm": {}, "bubble": None, "warmup": step <= cfg.warmup_steps})
        writer.finish({"steps": cfg.steps, "world_size": cfg.world_size,
                       "tokens_per_s": result[f"{role}_tokens_per_s"],
                       "memory_bytes_per_rank": [{"max_allocated": p} for p in peaks],
                       "bench": {**bench, "role": role}} if rank == 0 else None)
