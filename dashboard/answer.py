"""The first page's answer: which strategy was fastest, which used least memory per rank, and which to pick under a
memory budget, each with one line of reason taken from the measurements (where its step went: waiting in a
collective, the pipeline's idle time). Plain functions over `data.summary_rows` and the runs: no Streamlit here.
"""

from __future__ import annotations

import statistics
from typing import Any

from dashboard.data import _num, single_losses

LOSS_RTOL = 1e-5  # the pack's stated tolerance in fp32: losses within relative 1e-5 of one process (README)


def waiting(run: dict[str, Any]) -> tuple[float, str] | None:
    """The largest share of rank 0's step spent waiting, and on what: a collective on an axis
    (``all_gather/dp``) or the pipeline's idle time (``pipeline bubble``); None without a step time."""
    summary = run.get("summary") or {}
    step = _num(summary.get("step_time_s"))
    if not step:
        return None
    shares = [((_num(rec.get("wait_s")) or 0) / step, key)
              for key, rec in (summary.get("comm_per_step") or {}).items() if isinstance(rec, dict)]
    bubble = _num((summary.get("pipeline") or {}).get("bubble_measured"))
    if bubble:
        shares.append((bubble, "pipeline bubble"))
    return max(shares, default=None)


def by_strategy(runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per strategy among the finished runs (repeats pooled): median tokens/s, the largest measured peak
    per rank, and the median run's largest waiting share."""
    grouped: dict[str, list[tuple[dict, dict]]] = {}
    for run, row in zip(runs, rows):
        if row.get("tokens/s") and row.get("peak MiB/rank (measured)"):
            grouped.setdefault(row["strategy"] or row["run"], []).append((run, row))
    out = []
    for name, pairs in grouped.items():
        pairs.sort(key=lambda p: p[1]["tokens/s"])
        run, row = pairs[len(pairs) // 2]
        out.append({"strategy": name, "tokens/s": statistics.median(r["tokens/s"] for _, r in pairs),
                    "peak MiB": max(r["peak MiB/rank (measured)"] for _, r in pairs), "runs": len(pairs),
                    "waiting": waiting(run)})
    return out


def _why(entry: dict[str, Any]) -> str:
    share = entry["waiting"]
    return f"{share[0]:.0%} of its step is waiting in {share[1]}" if share and share[0] >= 0.05 else \
        "its step is mostly compute"


def answer(runs: list[dict[str, Any]], rows: list[dict[str, Any]], budget_mib: float | None = None) -> dict[str, str]:
    """``fastest``, ``least memory`` and ``pick`` (the fastest whose peak per rank fits ``budget_mib``; all fit
    without one), each a line naming the strategy and why. Empty when no run finished with figures."""
    entries = by_strategy(runs, rows)
    if not entries:
        return {}
    fast = max(entries, key=lambda e: e["tokens/s"])
    small = min(entries, key=lambda e: (e["peak MiB"], -e["tokens/s"]))
    lines = {"fastest": f"{fast['strategy']}: {fast['tokens/s']:,.0f} tokens/s at {fast['peak MiB']:.3g} MiB per "
                        f"rank; {_why(fast)}"}
    if small is fast:
        lines["least memory"] = f"{small['strategy']}: also the least memory per rank ({small['peak MiB']:.3g} MiB)"
    else:
        lines["least memory"] = (
            f"{small['strategy']}: {small['peak MiB'] / fast['peak MiB']:.2f}x the memory of {fast['strategy']} "
            f"({small['peak MiB']:.3g} MiB per rank), {fast['tokens/s'] / small['tokens/s']:.1f}x slower: "
            f"{_why(small)}")
    fits = [e for e in entries if budget_mib is None or e["peak MiB"] <= budget_mib]
    if not fits:
        lines["pick"] = (f"none fits {budget_mib:.3g} MiB per rank; the least memory is {small['strategy']} "
                         f"({small['peak MiB']:.3g} MiB)")
        return lines
    best = max(fits, key=lambda e: e["tokens/s"])
    within = f"within {budget_mib:.3g} MiB per rank" if budget_mib is not None else "with no memory budget set"
    lines["pick"] = f"{best['strategy']}: the fastest of the {len(fits)} of {len(entries)} strategies {within}"
    return lines


def loss_differences(runs: list[dict[str, Any]], label) -> list[dict[str, Any]]:
    """Per step and run, the loss's relative difference from its comparison's ``single`` run (the baseline), for a
    log-scale chart: a difference of exactly zero is kept as zero (the chart shows it at its floor)."""
    base = single_losses(runs)
    rows = []
    for run in runs:
        meta = run["meta"]
        ref = base.get(meta.get("comparison"))
        losses = (run.get("summary") or {}).get("losses") or []
        if not ref or meta.get("label") == "single" or not isinstance(losses, list):
            continue
        for step, (a, b) in enumerate(zip(losses, ref), start=1):
            a, b = _num(a), _num(b)
            if a is not None and b:
                rows.append({"run": label(run), "step": step, "relative difference": abs(a - b) / abs(b)})
    return rows
