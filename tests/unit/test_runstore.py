"""Reading the run store: complete lines only, and a clear error for what is not a run of this schema."""

from __future__ import annotations

import json

import pytest

from strategies import runs as runstore


def _run(tmp_path, name="r1", meta=None):
    writer = runstore.RunWriter(tmp_path, name, rank=0)
    writer.write_meta(meta or {"run_id": name, "label": "dp"})
    return writer


def test_records_round_trip_and_non_finite_numbers_become_null(tmp_path):
    writer = _run(tmp_path)
    writer.append({"step": 1, "loss": float("nan"), "memory": {"params": 10}})
    writer.append({"step": 2, "loss": 1.5, "memory": {"params": 10}})
    writer.finish({"losses": [float("inf"), 1.5]})
    run = runstore.read_run(tmp_path / "r1")
    assert run["status"] == "complete" and run["meta"]["schema"] == runstore.SCHEMA
    assert [r["step"] for r in run["records"][0]] == [1, 2]
    assert run["records"][0][0]["loss"] is None and run["summary"]["losses"] == [None, 1.5]
    assert runstore.list_runs(tmp_path) == [tmp_path / "r1"]


def test_a_crashed_run_is_incomplete_with_every_whole_line(tmp_path):
    writer = _run(tmp_path)
    writer.append({"step": 1})
    writer.append({"step": 2})
    writer._log.write('{"schema": 1, "step": 3, "lo')  # the process died mid-write
    writer._log.flush()
    run = runstore.read_run(tmp_path / "r1")
    assert run["status"] == "incomplete" and [r["step"] for r in run["records"][0]] == [1, 2]


@pytest.mark.parametrize("content,message", [
    (None, "no meta.json"), ("{not json", "meta.json is not JSON"), (json.dumps({"schema": 99}), "schema 99"),
])
def test_what_is_not_a_run_says_why(tmp_path, content, message):
    folder = tmp_path / "bad"
    folder.mkdir()
    if content is not None:
        (folder / "meta.json").write_text(content)
    with pytest.raises(runstore.RunError, match=message):
        runstore.read_run(folder)


def test_runs_dir_from_flag_then_environment_then_default(monkeypatch, tmp_path):
    monkeypatch.delenv(runstore.RUNS_ENV, raising=False)
    assert str(runstore.runs_dir()) == "runs"
    monkeypatch.setenv(runstore.RUNS_ENV, str(tmp_path))
    assert runstore.runs_dir() == tmp_path
    assert str(runstore.runs_dir("elsewhere")) == "elsewhere"
