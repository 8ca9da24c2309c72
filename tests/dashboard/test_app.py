"""The dashboard's pages in Streamlit's AppTest (no browser), over a fixture run store with good, incomplete,
corrupt and old-schema runs, and over an empty one; and its figures from their pure builders."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from dashboard import charts, data  # noqa: E402
from strategies import runs as runstore  # noqa: E402
from strategies.measure.planner import layout_of  # noqa: E402

APP = os.path.join(os.path.dirname(__file__), "..", "..", "dashboard", "app.py")


def _app(page: str | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    if page is not None:
        at.sidebar.radio[0].set_value(page).run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def _figures(at: AppTest) -> list[dict]:
    return [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]


def test_compare_page_table_export_and_messages(store):
    at = _app()
    table = at.dataframe[0].value
    assert list(table["strategy"]) == ["single", "dp", "pp2", "zero3"]
    assert list(table["status"]) == ["complete", "complete", "complete", "incomplete"]
    assert table["loss match vs single"][1] == 0.0
    # how each computed: Lightning's precision and the strategy's param_dtype (meta.json's)
    assert list(table["precision"]) == ["32-true", "bf16-mixed, param_dtype bf16", "32-true", "32-true"]
    warnings = " ".join(w.value for w in at.warning)
    assert "r5-corrupt: meta.json is not JSON" in warnings and "r6-old: schema 0" in warnings
    assert "Incomplete" in warnings and "r4-crashed (step 2)" in warnings  # how far it got
    # ... and why it stopped: the failed rank's error and last calls (not counted as a step).
    (failed,) = at.expander
    assert failed.label == "r4-crashed failed on rank 1: CollectiveError: all\\_gather on dp timed out"
    assert "#7 all_gather" in failed.text[0].value
    assert any(b.label == "Download table (CSV)" for b in at.get("download_button"))
    assert "`None`" not in [m.value for m in at.markdown]  # nothing written by Streamlit's magic from app.py
    # The answer first: the fixture's dp and pp2 run 2000 tokens/s against single's 1000; single holds least.
    text = at.markdown[0].value
    assert "**fastest**: dp: 2,000 tokens/s" in text and "5% of its step is waiting in all_reduce/dp" not in text
    assert "**least memory**: single" in text and "**pick**: dp: the fastest of the 3 of 3" in text
    # Correctness at a glance: each run's loss difference from single, log scale, the tolerance as a line.
    step, figure = _figures(at)
    # Where the step time goes (the fixture's split: 0.2 s forward, 0.4 backward, 0.1 optimizer, 0.1 in the
    # all-reduce, the rest of the 1 s step other), each rank beside the prediction, for every run.
    assert step["layout"]["title"]["text"].startswith("Where the step time goes")
    other = next(t for t in step["data"] if t["name"] == "other")
    assert dict(zip(zip(*other["x"]), other["y"]))[("dp #2-dp", "rank 1")] == pytest.approx(200.0)
    assert {b for t in step["data"] for b in t["x"][1]} == {"rank 0", "rank 1", "predicted"}
    assert figure["layout"]["yaxis"]["type"] == "log" and figure["layout"]["shapes"][0]["y0"] == 1e-5
    assert {t["name"] for t in figure["data"]} == {data.label({"id": i, "meta": {"label": s, "world_size": 2}})
                                                   for i, s in (("r2-dp", "dp"), ("r3-pp2", "pp2"))}
    # A budget below dp's and pp2's peak (rank 1's 560 bytes) leaves single (460 bytes) as the pick.
    at.number_input[0].set_value(500 / 2**20).run()
    assert "**pick**: single" in at.markdown[0].value


@pytest.mark.parametrize("page,titles", [
    ("Memory", ["Memory per rank", "Device memory per rank", "Memory per rank, category by category"]),
    ("Throughput", ["Throughput"]),
    ("Communication", ["Communication per step"]), ("Loss", ["Loss against step"]),
    ("Pipeline", ["Measured (last step)", "The schedule's table"]),
])
def test_every_page_draws_its_charts(store, page, titles):
    figures = _figures(_app(page))
    assert [f["layout"]["title"]["text"].split(":")[0].split(" (")[0] for f in figures] == [
        t.split(":")[0].split(" (")[0] for t in titles]


def test_pipeline_page_shows_the_bubble_and_every_rank_s_actions(store):
    at = _app("Pipeline")
    assert at.metric[0].value == "0.300 / 0.200"
    measured, ideal = _figures(at)
    # Runner's phases are "F"/"B": forward and backward bars, one row per rank, labelled by action.
    assert [t["name"] for t in measured["data"]] == ["forward", "backward"]
    assert measured["data"][0]["text"] == ["F0.0", "F1.0"] and measured["data"][1]["y"] == ["rank 0", "rank 1"]
    assert [t["name"] for t in ideal["data"]] == ["forward", "backward"]


def test_planner_page_ranks_plans(store):
    at = _app("Planner")
    table = at.dataframe[0].value
    assert len(table) > 0 and table["fits"].iloc[0]
    assert table["plan"].map(layout_of).is_unique and "also" in table  # a row per layout, its variants beside it


def test_empty_store_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv(runstore.RUNS_ENV, str(tmp_path / "nothing"))
    at = _app()
    assert "No runs in" in at.info[0].value and "stratpack compare" in at.info[0].value


def test_memory_figure_stacks_measured_beside_predicted(store):
    runs, _ = data.load_runs(store)
    fig = charts.memory_figure(data.memory_rows(runs))
    names = [trace.name for trace in fig.data]
    assert names == ["params", "grads", "optimizer", "host", "activations"]
    sources = {x[1] for trace in fig.data for x in zip(*trace.x)}
    assert sources == {"meas", "pred"}
    heat = charts.heatmap_figure(data.memory_rows(runs))
    assert len(heat.data[0].y) == 2  # ranks 0 and 1


def test_pages_other_than_the_planner_never_import_torch(store):
    # The app's modules and the store reader, in a fresh interpreter: torch would cost seconds at page load.
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    code = ("import sys; sys.path.insert(0, %r); from dashboard import charts, data; "
            "runs, problems = data.load_runs(%r); charts.memory_figure(data.memory_rows(runs)); "
            "print(len(runs), 'torch' in sys.modules)") % (root, str(store))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4", "False"]


def test_any_set_of_runs_can_be_picked(store):
    at = _app()
    at.sidebar.multiselect[-1].unselect("r2-dp").run()
    assert list(at.dataframe[0].value["strategy"]) == ["single", "pp2", "zero3"]


def test_links_out_of_the_store_and_odd_files_are_not_read(store, tmp_path):
    outside = tmp_path / "secret.json"
    outside.write_text(json.dumps({"schema": 1, "label": "leaked"}))
    (store / "r7-link").mkdir()
    (store / "r7-link" / "meta.json").symlink_to(outside)
    (store / "r2-dp" / "rank00000.old.jsonl").write_text("not a rank file\n")
    runs, problems = data.load_runs(store)
    assert "r7-link: meta.json is not a regular file" in " ".join(problems)
    assert "leaked" not in [r["meta"].get("label") for r in runs]
    assert sorted(next(r for r in runs if r["id"] == "r2-dp")["records"]) == [0, 1]


def test_a_live_page_reads_runs_that_start_after_the_choice(store):
    from tests.dashboard.conftest import _write_run

    at = _app()
    at.sidebar.toggle[0].set_value(True).run()  # the page body is now a fragment on a 5 s timer
    assert not at.exception and len(at.dataframe[0].value) == 4
    _write_run(store, "r7-zero1", "zero1", 2, [2.0, 1.5, 1.2])  # a run of the chosen comparison, started later
    at.run()
    assert not at.exception and "zero1" in list(at.dataframe[0].value["strategy"])


def test_a_gpu_comparison_shows_beside_a_cpu_one_with_its_device_mfu_and_allocator_peak(store):
    writer = runstore.RunWriter(store, "g1-dp", 0)
    writer.write_meta({"run_id": "g1-dp", "comparison": "cmp-gpu", "label": "dp", "plan": "dp", "world_size": 1,
                       "devices": ["NVIDIA H100 80GB HBM3"], "num_params": 1000})
    writer.append({"step": 1, "time": 1.0, "step_time_s": 0.5, "loss": 2.0, "tokens_per_s": 9e5,
                   "memory": {"params": 100, "total": 400, "max_allocated": 3 * 2**30}, "comm": {}})
    writer.finish({"losses": [2.0], "tokens_per_s": 9e5, "mfu": 0.49})
    at = _app()
    at.sidebar.multiselect[0].set_value(["cmp-gpu", "cmp-test"]).run()  # two comparisons side by side
    table = at.dataframe[0].value.set_index("run")
    assert table.loc["g1-dp", "device"] == "NVIDIA H100 80GB HBM3" and table.loc["g1-dp", "MFU"] == 0.49
    assert table.loc["g1-dp", "allocator peak MiB/rank"] == 3072 and table.loc["r2-dp", "device"] == "cpu"
    assert set(table["comparison"]) == {"cmp-gpu", "cmp-test"}


def test_step_time_rows_keep_numbers_only_from_records_the_schema_lets_through():
    # null phases (finite-or-null is the schema's "num"), comm entries of any type: drawn as zero, never raised on
    run = {"id": "r9-odd", "meta": {"label": "dp", "predicted": {"step_time": {"compute": "fast", "loop": 0.1}}},
           "records": {0: [{"step": 5, "step_time_s": 1.0, "split": {"forward": None, "backward": 0.5},
                            "comm": {"all_reduce/dp": 7, "send/pp": {"wait_s": "slow"}, "x/dp": {"wait_s": 0.25}}}]}}
    parts = {(r["bar"], r["part"]): r["seconds"] for r in data.step_rows([run])}
    assert parts == {("rank 0", "forward"): 0.0, ("rank 0", "backward"): 0.5, ("rank 0", "optimizer"): 0.0,
                     ("rank 0", "comm x/dp"): 0.25, ("rank 0", "other"): 0.25, ("predicted", "forward"): 0.0,
                     ("predicted", "backward"): 0.0, ("predicted", "other"): 0.1}


def test_a_rehearsal_shows_beside_real_runs_on_the_memory_and_communication_pages_marked_as_rehearsed():
    # Rank 5 of a 64-rank job, rehearsed alone (`stratpack rehearse --rank 5`), beside a real 1-rank run.
    memory = {"params": 100, "grads": 100, "optimizer": 200, "host": 0, "total": 400, "activations_peak": 50,
              "heap_peak": 600, "setup_peak": 500}
    comm = {"all_gather/dp": {"calls": 2, "bytes_sent": 64.0, "bytes_recv": 64.0, "wait_s": 0.0}}
    real = {"id": "r1-dp-cd34", "meta": {"label": "dp", "world_size": 1}, "records": {0: [{"memory": memory}]},
            "summary": {"comm_per_step": comm, "memory_bytes_per_rank": [memory]}}
    rehearsal = {"id": "r2-zero3-rehearsal-ab12", "records": {5: [{"step": 2, "memory": memory, "comm": comm}]},
                 "meta": {"label": "zero3", "world_size": 64, "kind": "rehearsal", "rehearsal": {"ranks": [5]},
                          "predicted": {"memory": [{"params": 90}] * 64, "setup": [450] * 64}},
                 "summary": {"comm_per_step": comm, "memory_bytes_per_rank": [None] * 5 + [memory] + [None] * 58}}
    runs, ours, theirs = [real, rehearsal], "dp (1) #cd34", "zero3 (64, rehearsed) #ab12"
    assert [(r["run"], r["rank"], r["source"], r["bytes"]) for r in data.memory_rows(runs) if r["category"] == "params"
            ] == [(ours, 0, "measured", 100), (theirs, 5, "measured", 100), (theirs, 5, "predicted", 90)]
    assert [(r["run"], r["rank"], r["set-up MiB (predicted)"]) for r in data.peak_rows(runs)] == [
        (ours, 0, None), (theirs, 5, 450 / 2**20)]
    assert [(r["run"], r["bytes"]) for r in data.comm_rows(runs)] == [(ours, 64), (theirs, 64)]


def test_no_page_uses_what_its_streamlit_warns_is_going_away(store):
    """Streamlit logs each deprecated argument it is given (``use_container_width``, say) through its deprecation
    logger, whatever the browser shows: every page, drawn here, must log nothing there, and no dashboard source may
    pass the argument on a path the fixture store does not reach (the bench table)."""
    import glob
    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("streamlit.deprecation_util")
    logger.addHandler(handler)
    try:
        at = _app()
        for page in ("Memory", "Throughput", "Communication", "Loss", "Pipeline", "Planner"):
            at.sidebar.radio[0].set_value(page).run()
            assert not at.exception, [e.message for e in at.exception]
    finally:
        logger.removeHandler(handler)
    assert said == []
    sources = glob.glob(os.path.join(os.path.dirname(APP), "*.py"))
    assert sources and not [s for s in sources if "use_container_width" in open(s).read()]


def _restarted_run(root, mark_sigterm: bool) -> dict:
    """A dp@2 run whose first attempt stopped after step 3 (rank 0 failed in a collective, rank 1 said nothing, half
    a line left in its file) and went on from its step-2 checkpoint: written and read as the monitor does."""
    from strategies.runs.restarts import restart_entry, sigterm_file

    path = root / "r7-restarted"
    writers = [runstore.RunWriter(root, path.name, rank) for rank in range(2)]
    writers[0].write_meta({"run_id": path.name, "label": "dp", "plan": "dp", "world_size": 2, "devices": ["cpu"]})
    for step in (1, 2, 3):
        for w in writers:
            w.append({"step": step, "time": 100.0 + step, "step_time_s": 1.0, "loss": 3.0 - step / 2,
                      "tokens_per_s": 1000.0})
    writers[0].append({"error": "CollectiveError: all_reduce on dp failed", "time": 104.0, "step": 3})
    writers[1]._log.write('{"schema": 1, "st')  # SIGKILLed while writing
    if mark_sigterm:
        sigterm_file(path, 1, 1).write_text("Fatal Python error: Terminated")
    for w in writers:
        w._log.close()
    entry = restart_entry(runstore.read_run(path), 2, checkpoint="ckpt/step=2", now=110.0)
    writers = [runstore.RunWriter(root, path.name, rank) for rank in range(2)]
    writers[0].add_restart(entry)
    for step in (3, 4):
        for w in writers:
            w.append({"step": step, "time": 110.0 + step, "step_time_s": 1.0, "loss": 1.4 - step / 10,
                      "tokens_per_s": 900.0, "attempt": 2, **({"redone": True} if step == 3 else {})})
    for rank, w in enumerate(writers):
        w.finish({"losses": [1.1, 1.0], "tokens_per_s": 900.0, "mfu": None, "comm_per_step": {}} if rank == 0 else None)
    return runstore.read_run(path)


def test_a_restarted_run_is_one_run_with_its_restart_on_the_loss_and_throughput_curves(tmp_path, monkeypatch):
    run = _restarted_run(tmp_path / "runs", mark_sigterm=False)
    (entry,) = run["restarts"]
    assert entry["attempt"] == 2 and entry["redone"] == [3, 3] and entry["ranks"] == [1]
    assert entry["cause"].startswith("rank 1 stopped without an error after step 3")  # the silent rank, not rank 0
    assert entry["time_lost_s"] == 8.0 and entry["downtime_s"] == 6.0  # from step 2's record; from the last line
    # the half line the kill left is one bad line, not the start of the next record
    assert [r["step"] for r in run["records"][1]] == [1, 2, 3, 3, 4] and len(run["problems"]) == 1
    monkeypatch.setenv(runstore.RUNS_ENV, str(tmp_path / "runs"))
    at = _app("Throughput")
    throughput, per_step = _figures(at)
    assert per_step["layout"]["title"]["text"] == "Throughput per step (rank 0)"
    assert [s["x0"] for s in per_step["layout"]["shapes"]] == [2]  # the restart, where it resumed
    assert "rank 1, 8 s lost" in per_step["layout"]["annotations"][0]["text"]
    assert list(at.dataframe[0].value["redone"]) == ["3-3"]
    (loss,) = _figures(_app("Loss"))
    again = [t for t in loss["data"] if t["name"].endswith("(done again after a restart)")]
    assert [t["x"] for t in again] == [[3]] and [s["x0"] for s in loss["layout"]["shapes"]] == [2]
    assert [t["x"] for t in loss["data"] if t not in again] == [[1, 2, 3, 4]]  # every step once


def test_a_rank_the_launcher_stopped_with_sigterm_is_not_taken_for_the_cause(tmp_path):
    (entry,) = _restarted_run(tmp_path / "runs", mark_sigterm=True)["restarts"]
    assert entry["ranks"] == [0] and entry["cause"].startswith("rank 0 failed after step 3: CollectiveError")


def test_an_expert_parallel_run_shows_its_load_balance(store):
    writer = runstore.RunWriter(store, "r7-ep2", 0)
    writer.write_meta({"run_id": "r7-ep2", "comparison": "cmp-test", "label": "ep2", "plan": "ep2", "world_size": 1,
                       "devices": ["cpu"]})
    for step, counts in ((1, [6, 2, 0, 0]), (2, [6, 2, 0, 0])):
        writer.append({"step": step, "time": 100.0 + step, "step_time_s": 1.0, "loss": 1.0, "tokens_per_s": 10.0,
                       "experts": {"tokens": {"blocks.0.mlp.experts": counts}, "routed_bytes": 64.0},
                       "comm": {"all_to_all/ep": {"calls": 5, "bytes_sent": 64.0, "bytes_recv": 64.0, "wait_s": 0.0}}})
    writer.finish({"losses": [1.0, 1.0], "comm_per_step": {"all_to_all/ep": {"bytes_sent": 64.0, "wait_s": 0.0}}})
    runs = data.load_runs(store)[0]
    rows = data.expert_rows([run for run in runs if run["id"] == "r7-ep2"])
    assert [r["load"] for r in rows] == [3.0, 1.0, 0.0, 0.0]  # 12, 4, 0, 0 tokens over a mean of 4
    at = _app("Communication")
    titles = [f["layout"]["title"]["text"] for f in _figures(at)]
    assert any(t.startswith("Load balance") for t in titles)
