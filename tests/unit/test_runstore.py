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


def test_a_fit_resumed_from_its_run_s_checkpoint_goes_on_in_it_under_the_same_plan_and_world_size_only(tmp_path):
    from types import SimpleNamespace

    from strategies.measure.monitor import StrategyMonitor

    writer = runstore.RunWriter(tmp_path, "r1", 0)
    writer.write_meta({"run_id": "r1", "label": "dp", "plan": "dp_dp2", "world_size": 2, "devices": ["cpu"]})
    writer.append({"step": 2, "time": 1.0, "loss": 1.0})
    writer.finish(None)
    for world, goes_on in ((2, True), (4, False)):
        monitor = StrategyMonitor(runs_dir=tmp_path)
        monitor.load_state_dict({"run_id": "r1"})
        trainer = SimpleNamespace(strategy=SimpleNamespace(resolved_plan="dp_dp2"), world_size=world, global_step=2,
                                  ckpt_path="ckpt/step=2")
        found = monitor._restart(trainer)
        if goes_on:
            assert found[0] == "r1" and found[1]["attempt"] == 2 and found[1]["resumed_step"] == 2
        else:  # resharded to another world size: a run of its own, which names the one it came from
            assert found is None and monitor.extra_meta["resumed_from"] == "r1"


def test_a_run_resumed_after_it_finished_says_so_rather_than_naming_a_rank():
    from strategies.runs.restarts import restart_entry

    run = {"meta": {"world_size": 2}, "path": "nowhere", "records": {0: [{"step": 4, "time": 1.0}], 1: []},
           "summary": {"attempt": 1}, "errors": {}}
    entry = restart_entry(run, 4, now=3.0)
    assert entry["cause"] == "the previous attempt finished at step 4: resumed to go on" and entry["ranks"] == []
    assert entry["time_lost_s"] is None and entry["downtime_s"] == 2.0 and entry["redone"] is None
    run["summary"] = None  # the same records, no summary: both ranks stopped without a word
    assert restart_entry(run, 4, now=3.0)["ranks"] == [0, 1]
