"""The first page's answer from measurements: fastest, least memory, the pick under a budget, each with why."""

from __future__ import annotations

from dashboard import answer


def _run(label: str, tokens: float, peak_mib: float, step_s: float, waits: dict[str, float],
         bubble: float | None = None, losses: list[float] | None = None) -> tuple[dict, dict]:
    summary = {"step_time_s": step_s, "comm_per_step": {k: {"wait_s": w} for k, w in waits.items()},
               "losses": losses or [2.0, 1.0]}
    if bubble is not None:
        summary["pipeline"] = {"bubble_measured": bubble}
    run = {"id": f"x-{label}", "meta": {"label": label, "comparison": "c", "world_size": 2}, "summary": summary}
    return run, {"run": run["id"], "strategy": label, "tokens/s": tokens, "peak MiB/rank (measured)": peak_mib}


def test_the_answer_names_the_fastest_the_smallest_and_the_pick_with_their_reasons():
    runs, rows = zip(_run("dp", 2000, 100, 1.0, {"all_reduce/dp": 0.02}),
                     _run("zero3", 1000, 50, 2.0, {"all_gather/dp": 0.92, "reduce_scatter/dp": 0.1}),
                     _run("pp2", 1500, 70, 1.3, {"send/pp": 0.01}, bubble=0.3))
    got = answer.answer(list(runs), list(rows))
    assert got["fastest"] == "dp: 2,000 tokens/s at 100 MiB per rank; its step is mostly compute"
    assert got["least memory"] == ("zero3: 0.50x the memory of dp (50 MiB per rank), 2.0x slower: 46% of its "
                                   "step is waiting in all_gather/dp")
    assert got["pick"].startswith("dp: the fastest of the 3 of 3 strategies with no memory budget")
    # Under 80 MiB per rank dp does not fit: pp2 is the fastest that does, and its reason is the bubble.
    assert answer.answer(list(runs), list(rows), 80)["pick"] == ("pp2: the fastest of the 2 of 3 strategies within "
                                                                 "80 MiB per rank")
    assert answer.waiting(runs[2]) == (0.3, "pipeline bubble")
    assert answer.answer(list(runs), list(rows), 10)["pick"].startswith("none fits 10 MiB per rank")


def test_repeats_pool_into_their_median_and_runs_without_figures_are_left_out():
    runs, rows = zip(_run("dp", 2000, 100, 1.0, {}), _run("dp", 1000, 110, 1.0, {}), _run("dp", 1600, 90, 1.0, {}),
                     _run("zero3", 0, 0, 1.0, {}))
    (entry,) = answer.by_strategy(list(runs), list(rows))
    assert (entry["strategy"], entry["tokens/s"], entry["peak MiB"], entry["runs"]) == ("dp", 1600, 110, 3)
    assert answer.answer([], []) == {}


def test_loss_differences_are_relative_to_the_comparison_s_single_run():
    (single, _), (dp, _) = _run("single", 1, 1, 1, {}, losses=[2.0, 1.0]), _run("dp", 1, 1, 1, {}, losses=[2.0, 1.1])
    rows = answer.loss_differences([single, dp], lambda run: run["meta"]["label"])
    assert [(r["run"], r["step"]) for r in rows] == [("dp", 1), ("dp", 2)]
    assert rows[0]["relative difference"] == 0.0 and abs(rows[1]["relative difference"] - 0.1) < 1e-12


def test_throughput_bars_are_named_by_strategy_with_the_run_id_on_hover():
    from dashboard import charts

    rows = [{"run": "20261123-082945-single-568d", "strategy": "single", "world size": 1, "tokens/s": 10.0}]
    (bar,) = charts.throughput_figure(rows).data
    assert list(bar.x) == ["single (1) #568d"] and list(bar.hovertext) == ["20261123-082945-single-568d"]
