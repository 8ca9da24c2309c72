"""Plotly figures for the dashboard, built by pure functions from the tidy rows of `data` (tested alone)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

# plotly looks pandas up in sys.modules without importing it; while another thread of the Streamlit server is still
# importing pandas, plotly finds the half-made module and a chart fails with "partially initialized module 'pandas'
# has no attribute 'Series'" (a fresh server's first Pipeline page, 2026-11-25). An import here waits on pandas'
# module lock until that import is done. (Streamlit depends on pandas.)
import pandas  # noqa: F401
import plotly.graph_objects as go

from strategies.runs import MEMORY_CATEGORIES

COLORS = {"params": "#4C78A8", "grads": "#F58518", "optimizer": "#54A24B", "host": "#B279A2",
          "activations": "#E45756", "temporaries": "#9D755D", "forward": "#4C78A8", "backward": "#F58518",
          "weight": "#54A24B"}
MiB = 2**20


def memory_figure(rows: list[dict[str, Any]]) -> go.Figure:
    """Stacked bars of memory per rank by category, measured beside predicted, for every run."""
    fig = go.Figure()
    x_of = lambda r: [f"{r['run']} r{r['rank']}", r["source"][:4]]  # noqa: E731 - two-level axis
    for category in MEMORY_CATEGORIES:
        picked = [r for r in rows if r["category"] == category]
        if picked:
            fig.add_bar(name=category, marker_color=COLORS[category], x=list(zip(*[x_of(r) for r in picked])),
                        y=[r["bytes"] / MiB for r in picked])
    fig.update_layout(barmode="stack", yaxis_title="MiB per rank", legend_title="category",
                      title="Memory per rank: measured (meas) beside predicted (pred)")
    return fig


def heatmap_figure(rows: list[dict[str, Any]]) -> go.Figure:
    """Rank x strategy heatmap of measured memory (model states + activations): uneven stages show."""
    totals: dict[tuple[str, int], float] = defaultdict(float)
    for r in rows:
        if r["source"] == "measured" and r["category"] != "host":
            totals[(r["run"], r["rank"])] += r["bytes"] / MiB
    runs = sorted({run for run, _ in totals})
    ranks = sorted({rank for _, rank in totals})
    z = [[totals.get((run, rank)) for run in runs] for rank in ranks]
    fig = go.Figure(go.Heatmap(z=z, x=runs, y=[f"rank {r}" for r in ranks], colorscale="Viridis",
                               colorbar_title="MiB"))
    fig.update_layout(title="Device memory per rank (model states + activations)", yaxis_autorange="reversed")
    return fig


def throughput_figure(rows: list[dict[str, Any]]) -> go.Figure:
    """Tokens/s per run, and MFU where the device's peak is known."""
    fig = go.Figure()
    # Strategy names on the axis (ranks, and the run id's end to keep repeats apart); the run id in the hover text.
    names = [f"{r.get('strategy') or r['run']} ({r.get('world size', '?')}) #{r['run'][-4:]}" for r in rows]
    fig.add_bar(name="tokens/s", x=names, y=[r["tokens/s"] for r in rows], marker_color=COLORS["params"],
                hovertext=[r["run"] for r in rows])
    if any(r.get("MFU") is not None for r in rows):
        fig.add_scatter(name="MFU", x=names, y=[r.get("MFU") for r in rows], yaxis="y2",
                        mode="markers", marker_size=12)
        fig.update_layout(yaxis2={"overlaying": "y", "side": "right", "title": "MFU", "tickformat": ".0%"})
    fig.update_layout(title="Throughput", yaxis_title="tokens/s")
    return fig


def scaling_figure(rows: list[dict[str, Any]]) -> go.Figure | None:
    """Tokens/s against world size, one line per strategy: only when some strategy ran at several sizes."""
    by_strategy: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        if r.get("tokens/s") and r.get("world size"):
            by_strategy[r["strategy"]].append((r["world size"], r["tokens/s"]))
    lines = {k: sorted(v) for k, v in by_strategy.items() if len({n for n, _ in v}) > 1}
    if not lines:
        return None
    fig = go.Figure()
    for strategy, points in lines.items():
        fig.add_scatter(name=strategy, x=[n for n, _ in points], y=[t for _, t in points], mode="lines+markers")
    fig.update_layout(title="Scaling", xaxis_title="ranks", yaxis_title="tokens/s")
    return fig


def comm_figure(rows: list[dict[str, Any]]) -> go.Figure:
    """Bytes rank 0 sends per step, stacked by collective and axis, per run."""
    fig = go.Figure()
    for key in sorted({f"{r['collective']}/{r['axis']}" for r in rows}):
        picked = [r for r in rows if f"{r['collective']}/{r['axis']}" == key]
        fig.add_bar(name=key, x=[r["run"] for r in picked], y=[r["bytes"] / 1024 for r in picked])
    fig.update_layout(barmode="stack", title="Communication per step (rank 0)", yaxis_title="KiB sent")
    return fig


def load_balance_figure(rows: list[dict[str, Any]]) -> go.Figure:
    """Each expert's tokens over its layer's mean (1: balanced), one group of bars per layer and run."""
    fig = go.Figure()
    for key in dict.fromkeys((r["run"], r["layer"]) for r in rows):
        picked = [r for r in rows if (r["run"], r["layer"]) == key]
        fig.add_bar(name=f"{key[0]}: {key[1]}", x=[f"expert {r['expert']}" for r in picked],
                    y=[r["load"] for r in picked])
    fig.add_hline(y=1.0, line_dash="dot")
    fig.update_layout(barmode="group", title="Load balance: tokens per expert over the layer's mean (1: balanced)",
                      yaxis_title="tokens / mean")
    return fig


def loss_figure(rows: list[dict[str, Any]], x: str = "step", restarts: list[dict[str, Any]] = ()) -> go.Figure:
    """Loss curves overlaid: runs of the same model and data should coincide. A run that restarted: its steps done
    again drawn apart, and a line where each restart resumed (`restart_lines`)."""
    fig = _curves(rows, "loss", x)
    fig.update_layout(title=f"Loss against {x}", xaxis_title=x, yaxis_title="loss")
    return restart_lines(fig, restarts) if x == "step" else fig


def step_throughput_figure(rows: list[dict[str, Any]], restarts: list[dict[str, Any]] = ()) -> go.Figure:
    """Tokens/s at each step, with the restarts."""
    fig = _curves(rows, "tokens/s", "step")
    fig.update_layout(title="Throughput per step (rank 0)", xaxis_title="step", yaxis_title="tokens/s")
    return restart_lines(fig, restarts)


def _curves(rows: list[dict[str, Any]], y: str, x: str) -> go.Figure:
    """One line per run of ``y`` against ``x``; the points of steps done again after a restart as hollow markers."""
    fig = go.Figure()
    for run in sorted({r["run"] for r in rows}):
        picked = [r for r in rows if r["run"] == run and not r.get("redone")]
        fig.add_scatter(name=run, x=[r[x] for r in picked], y=[r[y] for r in picked], mode="lines+markers")
        again = [r for r in rows if r["run"] == run and r.get("redone")]
        if again:
            fig.add_scatter(name=f"{run} (done again after a restart)", x=[r[x] for r in again],
                            y=[r[y] for r in again], mode="markers", marker={"symbol": "circle-open", "size": 11})
    return fig


def restart_lines(fig: go.Figure, restarts: list[dict[str, Any]]) -> go.Figure:
    """A dotted line at the step each restart resumed from, saying which ranks stopped and the time lost."""
    for r in restarts:
        lost = f", {r['time lost s']:.0f} s lost" if r.get("time lost s") is not None else ""
        fig.add_vline(x=r["step"], line_dash="dot", line_color="crimson",
                      annotation_text=f"restart {r['attempt']} (rank {r['ranks']}{lost})")
    return fig


FLOOR = 1e-10  # a log axis has no zero: an exactly equal loss is drawn here


def loss_difference_figure(rows: list[dict[str, Any]], tolerance: float) -> go.Figure:
    """Each run's relative loss difference from its baseline per step, log scale, with the stated tolerance."""
    fig = go.Figure()
    for run in sorted({r["run"] for r in rows}):
        picked = [r for r in rows if r["run"] == run]
        fig.add_scatter(name=run, x=[r["step"] for r in picked], mode="lines+markers",
                        y=[max(r["relative difference"], FLOOR) for r in picked])
    fig.add_hline(y=tolerance, line_dash="dash", annotation_text=f"stated tolerance (fp32): {tolerance:g}")
    fig.update_layout(title=f"Loss: relative difference from the single-process run (exactly equal drawn at "
                            f"{FLOOR:g})", xaxis_title="step", yaxis_title="|loss - single| / single", yaxis_type="log")
    return fig


def _by_rank(item: tuple[str, Any]) -> tuple[int, int, str]:
    """Ranks in numeric order ("2" before "10"); a key that is not a number after them, not an error."""
    key = str(item[0])
    return (0, int(key), "") if key.isascii() and key.isdigit() and len(key) < 19 else (1, 0, key)


def timeline_figure(timelines: dict[str, list[dict[str, Any]]], title: str) -> go.Figure:
    """Gantt of a pipeline step: one row per rank, a bar per forward (blue) / backward (orange) / weight-gradient
    (green: the W a zero-bubble schedule splits off a backward) action."""
    fig = go.Figure()
    for phase in ("forward", "backward", "weight"):
        bars = [(rank, e) for rank, events in sorted(timelines.items(), key=_by_rank)
                for e in events if str(e.get("phase", "")).upper()[:1] == phase[0].upper()]  # "F" / "forward"
        if bars:
            fig.add_bar(name=phase, orientation="h", marker_color=COLORS[phase],
                        y=[f"rank {rank}" for rank, _ in bars], x=[e["end"] - e["start"] for _, e in bars],
                        base=[e["start"] for _, e in bars], text=[e["action"] for _, e in bars],
                        textposition="inside")
    fig.update_layout(barmode="overlay", title=title, xaxis_title="seconds (or schedule slots)",
                      yaxis_autorange="reversed")
    return fig


def ideal_timelines(ideal: dict[str, list[list[Any]]]) -> dict[str, list[dict[str, Any]]]:
    """The schedule's table on stages of equal cost, as timeline events ([action, start, end]; runs stored before
    the end was kept have [action, start] on unit-time stages)."""
    phases = {"F": "forward", "B": "backward", "W": "weight"}
    return {rank: [{"action": e[0], "phase": phases.get(e[0][:1], "backward"), "start": e[1],
                    "end": e[2] if len(e) > 2 else e[1] + 1} for e in actions] for rank, actions in ideal.items()}


_STEP_COLORS = {"forward": "#4C78A8", "backward": "#72B7B2", "optimizer": "#54A24B", "bubble": "#BAB0AC",
                "other": "#D3D3D3"}
_AXIS_COLORS = {"dp": ("#F58518", "#FFBF79", "#E45756", "#FF9D98"), "tp": ("#B279A2", "#D6A5C9", "#9D755D"),
                "pp": ("#EECA3B", "#F2CF5B"), "cp": ("#17BECF", "#9EDAE5"), "dp_cp": ("#F58518", "#FFBF79", "#E45756")}


def step_figure(rows: list[dict[str, Any]]) -> go.Figure:
    """Where a step's time goes: per strategy, a stacked bar per rank (measured) and the estimator's (predicted),
    by part: compute by phase, communication each rank was blocked in by collective and axis, the pipeline's
    bubble, the rest."""
    fig = go.Figure()
    order = list(dict.fromkeys(r["part"] for r in rows))
    comm = sorted(p for p in order if p.startswith("comm "))
    # Every trace has every bar (zero where a part is absent): Plotly orders a two-level axis by first appearance.
    bars = list(dict.fromkeys((r["strategy"], r["bar"], r["run"]) for r in rows))
    seconds = {(r["strategy"], r["bar"], r["part"]): r["seconds"] for r in rows}
    for part in [p for p in ("forward", "backward", "optimizer", "bubble") if p in order] + comm + \
            [p for p in order if p not in _STEP_COLORS and not p.startswith("comm ")] + \
            (["other"] if "other" in order else []):
        fig.add_bar(name=part, marker_color=_part_color(part, comm),
                    x=[[s for s, _, _ in bars], [b for _, b, _ in bars]],
                    y=[seconds.get((s, b, part), 0.0) * 1e3 for s, b, _ in bars], hovertext=[r for _, _, r in bars])
    fig.update_layout(barmode="stack", yaxis_title="ms per step", legend_title="part", height=560,
                      margin={"b": 140}, title="Where the step time goes: each rank measured, and the estimator's "
                                               "prediction")
    return fig


def _part_color(part: str, comm: list[str]) -> str | None:
    """A phase's own colour; a collective a shade of its axis' (``comm all_gather/dp``, predicted ``comm dp``)."""
    if part in _STEP_COLORS:
        return _STEP_COLORS[part]
    axis_of = lambda p: p.rpartition("/")[2] if "/" in p else p.split()[-1]  # noqa: E731
    shades = _AXIS_COLORS.get(axis_of(part))
    same = [p for p in comm if axis_of(p) == axis_of(part)]
    return shades[same.index(part) % len(shades)] if shades and part in same else None


def waterfall_figure(rows: list[dict[str, Any]], baseline: str, other: str) -> go.Figure:
    """From the ``baseline`` run's measured memory per rank (its largest rank) to the ``other``'s, category by
    category: which categories a strategy shrinks and which it grows (``rows``: `data.memory_rows`)."""
    def per_category(run: str) -> dict[str, float]:
        mine = [r for r in rows if r["run"] == run and r["source"] == "measured"]
        ranks = {r["rank"] for r in mine}
        top = max(ranks, key=lambda k: sum(r["bytes"] for r in mine if r["rank"] == k)) if ranks else None
        return {r["category"]: r["bytes"] / MiB for r in mine if r["rank"] == top}
    before, after = per_category(baseline), per_category(other)
    categories = [c for c in MEMORY_CATEGORIES if c in before or c in after]
    steps = [after.get(c, 0.0) - before.get(c, 0.0) for c in categories]
    fig = go.Figure(go.Waterfall(
        x=[baseline, *categories, other], measure=["absolute", *["relative"] * len(categories), "total"],
        y=[sum(before.values()), *steps, 0.0], text=[f"{v:+.2f}" for v in [sum(before.values()), *steps]] + [""],
        decreasing={"marker": {"color": COLORS["optimizer"]}}, increasing={"marker": {"color": COLORS["activations"]}},
        totals={"marker": {"color": COLORS["params"]}}))
    fig.update_layout(title=f"Memory per rank, category by category: {baseline} to {other} (largest rank, measured)",
                      yaxis_title="MiB per rank", showlegend=False)
    return fig
