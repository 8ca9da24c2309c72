"""The dashboard over a run store written by real commands (tests/conftest.py's ``compared``: `stratpack compare` of
single, dp, ddp, zero2 and pp2 at 2 CPU ranks, and a `stratpack train` killed mid-run)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from strategies import runs as runstore  # noqa: E402
from tests.dashboard.test_app import APP  # noqa: E402


@pytest.fixture
def real(compared, monkeypatch):
    assert compared.proc.returncode == 0, compared.proc.stderr[-2000:]
    monkeypatch.setenv(runstore.RUNS_ENV, str(compared.runs))
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    at.sidebar.multiselect[0].set_value(at.sidebar.multiselect[0].options).run()  # the comparison and the killed run
    assert not at.exception, [e.message for e in at.exception]
    return at


def _figure(at: AppTest, title: str) -> dict:
    figures = [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]
    return next(f for f in figures if f["layout"]["title"]["text"].startswith(title))


def test_the_first_page_answers_and_shows_where_each_rank_s_step_time_goes(real):
    answer = real.markdown[0].value
    assert "**fastest**:" in answer and "**least memory**:" in answer and "**pick**:" in answer
    step = _figure(real, "Where the step time goes")
    bars = {(s, b) for trace in step["data"] for s, b in zip(*trace["x"])}
    strategies = {s.split(" #")[0] for s, _ in bars}
    assert {"single", "dp", "ddp", "zero2", "pp2"} <= strategies
    for name in ("dp", "zero2", "pp2"):  # two ranks measured, and the estimator's prediction (calibrated here)
        assert {b for s, b in bars if s.startswith(name + " #")} >= {"rank 0", "rank 1", "predicted"}
    parts = {trace["name"]: trace for trace in step["data"]}
    assert {"forward", "backward", "optimizer", "other"} <= set(parts)
    assert any(name.startswith("comm ") and name.endswith("/dp") for name in parts)  # zero2's reduce-scatter
    bubble = parts["bubble"]  # the pipeline's idle time: pp2's measured ranks and its prediction only
    assert {(s.split(" #")[0], b) for s, b, y in zip(*bubble["x"], bubble["y"]) if y > 0} == {
        ("pp2", "rank 0"), ("pp2", "rank 1"), ("pp2", "predicted")}
    # The run killed mid-run reads as incomplete, with how far it got.
    warnings = " ".join(w.value for w in real.warning)
    assert "Incomplete" in warnings and "of 100000)" in warnings


def test_the_memory_page_has_a_waterfall_from_single_to_another_strategy(real):
    real.sidebar.radio[0].set_value("Memory").run()
    assert not real.exception
    waterfall = _figure(real, "Memory per rank, category by category")
    x = waterfall["data"][0]["x"]
    assert x[0].startswith("single ") and x[-1] != x[0] and {"params", "grads", "optimizer"} <= set(x[1:-1])
    peaks = real.dataframe[0].value  # set-up beside steady, measured beside predicted, every rank
    zero2 = peaks[peaks["run"].str.startswith("zero2")]
    assert list(zero2["rank"]) == [0, 1] and (zero2["set-up MiB (measured)"] > 0).all()
    assert (zero2["set-up MiB (predicted)"] >= zero2["steady MiB (predicted)"]).all()
