"""The comparison dashboard: `stratpack dashboard` (or, with the pack installed, `streamlit run dashboard/app.py`).

Reads only the run store (``$STRATPACK_RUNS``, else ``./runs``). Nothing here imports torch at page load;
the planner page imports the estimator (and so torch) when it is opened.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable

import streamlit as st

from dashboard import answer, charts, data

LIVE_SECONDS = 5  # how often a live page reads the run store again
PAGES = ("Compare", "Memory", "Throughput", "Communication", "Loss", "Pipeline", "Planner")

st.set_page_config(page_title="stratpack: strategies compared", layout="wide")
root = os.environ.get(data.runstore.RUNS_ENV) or "runs"
page = st.sidebar.radio("Page", PAGES)
st.sidebar.caption(f"run store: `{root}`")


def _plain(text: str) -> str:
    """``text`` (run names, file contents in messages) shown as written, not as Markdown: no link, image, HTML or
    formula a run folder could smuggle into the page."""
    return "".join("\\" + c if c in "\\`*_[]<>!$~|#{}" else c if c.isprintable() else " " for c in str(text))


def _csv(rows: list[dict]) -> str:
    out = io.StringIO()
    if rows:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return out.getvalue()


def _chart(fig, name: str) -> None:
    st.plotly_chart(fig, width="stretch")
    st.download_button(f"Download {name} (HTML)", fig.to_html(include_plotlyjs="cdn"), f"{name}.html",
                       mime="text/html", key=f"html-{name}")


def _select(runs: list[dict]) -> Callable[[list[dict]], list[dict]]:
    """The sidebar's filters (comparison, model size, world size, device, runs) as a function over the runs read
    now or later: a run that starts after the choice, in a chosen comparison, is shown too (live pages)."""
    comparisons = sorted({r["meta"].get("comparison") or "(none)" for r in runs})
    chosen = st.sidebar.multiselect("Comparison", comparisons, default=comparisons[-1:])
    tests: list[Callable[[dict], bool]] = [lambda r: (r["meta"].get("comparison") or "(none)") in chosen]
    picked = [r for r in runs if tests[0](r)]
    for title, key in (("Model parameters", "num_params"), ("World size", "world_size")):
        values = sorted({r["meta"].get(key) for r in picked if r["meta"].get(key) is not None})
        if len(values) > 1:
            keep = st.sidebar.multiselect(title, values, default=values)
            tests.append(lambda r, key=key, keep=keep: r["meta"].get(key) in keep)
            picked = [r for r in picked if tests[-1](r)]
    devices = sorted({", ".join(r["meta"].get("devices") or []) for r in picked})
    if len(devices) > 1:
        keep_devices = st.sidebar.multiselect("Device", devices, default=devices)
        tests.append(lambda r: ", ".join(r["meta"].get("devices") or []) in keep_devices)
        picked = [r for r in picked if tests[-1](r)]
    names = [r["id"] for r in picked]
    keep_runs = st.sidebar.multiselect("Runs", names, default=names, help="any set of runs of the comparisons above")
    known = {r["id"] for r in runs}
    tests.append(lambda r: r["id"] in keep_runs or r["id"] not in known)
    return lambda current: [r for r in current if all(test(r) for test in tests)]


def page_planner() -> None:
    st.header("Planner: which plans fit, before running anything")
    col = st.columns(4)
    params = col[0].number_input("Parameters (billions)", 1.0, 1000.0, 7.0)
    gpus = col[1].number_input("GPUs", 1, 4096, 8)
    memory = col[2].number_input("GiB per GPU", 1.0, 1024.0, 80.0)
    batch = col[3].number_input("Global batch (samples)", 1, 65536, 64)
    from strategies.measure.estimate import ModelShape  # torch: only on this page
    from strategies.measure.planner import GiB, Hardware, by_layout, rank_plans

    shape = ModelShape.from_params(params * 1e9)
    ranked = rank_plans(shape, Hardware(gpus=int(gpus), memory=memory * GiB), int(batch))
    fits = [r for r in ranked if r.fits]
    layouts = by_layout(fits or ranked)
    st.caption(f"{shape.layers} layers x {shape.hidden} wide, {shape.heads} heads, sequence {shape.seq}; "
               f"bf16-mixed (fp32 weights and gradients), Adam; {len(fits)} of {len(ranked)} plans fit. A row per "
               "layout at its fastest data mode and offload (least memory among ties), the others under 'also'")
    best = fits[0] if fits else None
    rows = [{"plan": r.label, "fits": r.fits, "GiB/GPU": round(r.estimate.peak() / GiB, 1),
             "step s": round(r.seconds, 2), "bubble": round(r.estimate.bubble, 3),
             "why": r.explain(shape, best).split(": ", 1)[-1], "also": row.also().removeprefix("; also ")}
            for row in layouts[:25] for r in (row.shown,)]
    st.dataframe(rows, width="stretch")


def main() -> None:
    st.title("Strategies compared")
    if page == "Planner":
        page_planner()
        return
    runs, problems = data.load_runs(root)
    if not runs:
        for problem in problems:
            st.warning(_plain(problem))
        st.info(f"No runs in `{root}` yet. Run `stratpack compare` (it writes there), or point "
                f"${data.runstore.RUNS_ENV} at a run store.")
        return
    pick = _select(runs)
    live = st.sidebar.toggle(f"Live: read the run store again every {LIVE_SECONDS} s",
                             help="for a comparison in progress: the page's figures refresh, the sidebar stays")

    def body() -> None:
        current, issues = data.load_runs(root) if live else (runs, problems)
        shown = _shown(pick(current), issues)
        if shown:
            VIEWS[page](shown, data.summary_rows(shown))
    # A fragment reruns on its own timer, only this part of the page (Streamlit's run_every): no loop here. (A
    # statement, not a conditional expression: Streamlit's "magic" would write the expression's value, None.)
    if live:
        st.fragment(run_every=LIVE_SECONDS)(body)()
    else:
        body()


def _shown(runs: list[dict], problems: list[str]) -> list[dict]:
    """The selected runs, saying what was skipped, how far each incomplete run got, or that nothing matches."""
    for problem in problems:
        st.warning(_plain(problem))
    if not runs:
        st.info("No run matches the filters.")
        return []
    incomplete = [f"{r['id']} ({data.progress(r)})" for r in runs if r["status"] != "complete"]
    if incomplete:
        st.warning("Incomplete (crashed or still running; shown up to their last step): "
                   + _plain(", ".join(incomplete)))
    for run in runs:
        for rank, error in sorted((run.get("errors") or {}).items()):
            went_on = run.get("restarts")
            attempt = f" in attempt {error.get('attempt', 1)} (it went on after a restart)" if went_on else ""
            with st.expander(_plain(f"{run['id']} failed on rank {rank}{attempt}: {error.get('error', '')}"[:300])):
                st.text("\n".join([str(error.get("error")), "last calls:", *map(str, error.get("last_calls") or [])]))
    return runs


def _answer(runs: list[dict], rows: list[dict]) -> None:
    """Which strategy was fastest, which used least memory, which to pick under the budget the user sets."""
    peaks = [r["peak MiB/rank (measured)"] for r in rows if r.get("peak MiB/rank (measured)")]
    if not peaks:
        return
    budget = st.number_input("Memory budget per rank (MiB) for the pick", 0.0, value=float(max(peaks)),
                             help="the pick is the fastest strategy whose measured peak per rank fits")
    lines = answer.answer(runs, rows, budget)
    st.subheader("The answer")
    st.markdown("\n".join(f"- **{key}**: {_plain(text)}" for key, text in lines.items()))


def _step_time(runs: list[dict]) -> None:
    steps = data.step_rows(runs)
    if steps:
        _chart(charts.step_figure(steps), "step-time")
        st.caption("Compute is each phase's time less what the rank was blocked in collectives; comm is that blocked "
                   "time (a pipeline's wait for its neighbour counts as bubble); other is the rest of the step "
                   "(data, Lightning's loop). Predicted: the planner's step time, calibrated on this host where it "
                   "says so in the run's meta (`step_basis`).")


def page_compare(runs: list[dict], rows: list[dict]) -> None:
    st.header("Side by side")
    _answer(runs, rows)
    _step_time(runs)
    st.dataframe(rows, width="stretch")
    st.download_button("Download table (CSV)", _csv(rows), "runs.csv", mime="text/csv")
    bench = data.bench_rows(runs)
    if bench:
        st.subheader("stratpack bench: ours against the peer, same model, data and ranks")
        st.dataframe(bench, width="stretch")
    differences = answer.loss_differences(runs, data.label)
    if differences:
        _chart(charts.loss_difference_figure(differences, answer.LOSS_RTOL), "loss-difference")
    else:
        _chart(charts.loss_figure(data.loss_rows(runs), restarts=data.restart_rows(runs)), "loss")


def page_memory(runs: list[dict], rows: list[dict]) -> None:
    st.header("Memory per rank")
    memory = data.memory_rows(runs)
    _chart(charts.memory_figure(memory), "memory")
    _chart(charts.heatmap_figure(memory), "memory-heatmap")
    peaks = data.peak_rows(runs)
    if peaks:
        st.subheader("Set-up and steady peaks per rank")
        st.caption("Set-up: from before the model is built to the end of the first step. A model built in "
                   "configure_model under a plan is made slice by slice (docs/larger-models.md); one built whole "
                   "needs it whole on every rank first.")
        st.dataframe(peaks, width="stretch")
    names = list(dict.fromkeys(r["run"] for r in memory))
    if len(names) > 1:
        first = next((k for k, n in enumerate(names) if n.startswith("single ")), 0)
        col = st.columns(2)
        baseline = col[0].selectbox("Waterfall from", names, index=first)
        other = col[1].selectbox("to", names, index=(first + 1) % len(names))
        _chart(charts.waterfall_figure(memory, baseline, other), "memory-waterfall")


def page_throughput(runs: list[dict], rows: list[dict]) -> None:
    st.header("Throughput")
    _chart(charts.throughput_figure(rows), "throughput")
    scaling = charts.scaling_figure(rows)
    if scaling is not None:
        _chart(scaling, "scaling")
    else:
        st.caption("Scaling curves appear when a strategy has runs at several world sizes.")
    _restarts(runs)


def _restarts(runs: list[dict]) -> None:
    """Runs that went on after a restart: each restart, and tokens/s per step with the restarts on it."""
    restarts = data.restart_rows(runs)
    if not restarts:
        return
    st.subheader("Restarts")
    st.caption("A run resumed from its own checkpoint goes on in the same run: the steps after the checkpoint are "
               "done again (hollow markers); time lost runs from the checkpoint's step to the restart.")
    st.dataframe(restarts, width="stretch")
    picked = [r for r in runs if r.get("restarts")]
    _chart(charts.step_throughput_figure(data.step_throughput_rows(picked), restarts), "throughput-restarts")


def page_communication(runs: list[dict], rows: list[dict]) -> None:
    st.header("Communication by collective and axis")
    _chart(charts.comm_figure(data.comm_rows(runs)), "communication")
    experts = data.expert_rows(runs)
    if experts:
        st.subheader("Expert parallel: load balance")
        st.caption("Tokens each expert got, over the mean of its layer: the all-to-all's bytes and the busiest "
                   "expert's work grow with the imbalance (`stratpack compare` prints the bytes measured beside those "
                   "the routing implies and the estimator's balanced figure).")
        _chart(charts.load_balance_figure(experts), "load-balance")


def page_loss(runs: list[dict], rows: list[dict]) -> None:
    st.header("Loss: runs of the same model and data should coincide")
    x = st.radio("against", ("step", "seconds"), horizontal=True)
    _chart(charts.loss_figure(data.loss_rows(runs), x, data.restart_rows(runs)), "loss-curves")


def page_pipeline(runs: list[dict], rows: list[dict]) -> None:
    st.header("Pipeline timeline")
    piped = [r for r in runs if (r["summary"] or {}).get("pipeline")]
    if not piped:
        st.info("No pipeline-parallel run (pp > 1) among the selected runs.")
        return
    labels = [data.label(r) for r in piped]  # unique: they end with the run id
    run = piped[labels.index(st.selectbox("Run", labels))]
    pipeline = run["summary"]["pipeline"]

    def fmt(value) -> str:
        return f"{value:.3f}" if isinstance(value, (int, float)) else "-"

    st.metric("bubble measured / ideal",
              f"{fmt(pipeline.get('bubble_measured'))} / {fmt(pipeline.get('bubble_ideal'))}")
    st.text("\n".join(pipeline.get("partition") or []))
    timelines = pipeline.get("timelines") or {"0": pipeline.get("timeline") or []}
    _chart(charts.timeline_figure(timelines, "Measured (last step)"), "timeline")
    if pipeline.get("ideal"):
        ideal = charts.ideal_timelines(pipeline["ideal"])
        _chart(charts.timeline_figure(ideal, "The schedule's table (stages of equal cost: F 1, B 2 or B 1 + W 1)"),
               "timeline-ideal")


VIEWS = {"Compare": page_compare, "Memory": page_memory, "Throughput": page_throughput,
         "Communication": page_communication, "Loss": page_loss, "Pipeline": page_pipeline}
main()
