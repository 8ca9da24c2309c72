"""`checkpoint.async_save.AsyncSaver` in one process: what it writes is the state as it was when save returned, one
save is in flight at a time, an older checkpoint is removed only once the newer one is whole, and a failed write is
raised at the next wait with nothing removed."""

from __future__ import annotations

import threading

import pytest
import torch

from strategies.checkpoint import async_save, is_sharded, sharded
from strategies.checkpoint.async_save import AsyncSaver
from strategies.checkpoint.sharded import CheckpointError, load_sharded
from strategies.comm.stats import Axis


def _hold_writes(monkeypatch) -> threading.Event:
    """Writes wait for the returned event: a save stays in flight until the test lets it go."""
    go, write = threading.Event(), sharded._write_part

    def held(*args):
        go.wait(10)
        return write(*args)

    monkeypatch.setattr(sharded, "_write_part", held)
    return go


def test_a_save_writes_the_state_as_it_was_and_an_older_checkpoint_goes_only_once_the_new_one_is_whole(tmp_path,
                                                                                                     monkeypatch):
    saver, weight = AsyncSaver(Axis.solo("checkpoint")), torch.arange(5000.0)
    saver.save({"state_dict": {"w": weight}}, str(tmp_path / "a"), rank=0, world_size=1)
    saver.wait()
    go = _hold_writes(monkeypatch)
    saver.save({"state_dict": {"w": weight}, "step": 2}, str(tmp_path / "b"), rank=0, world_size=1)
    weight.add_(1.0)  # training goes on: the save in flight keeps what it copied
    removed = []
    saver.after_save(lambda: removed.append("a"))
    assert removed == [] and not (tmp_path / "b").exists()  # still in flight: "a" is the newest whole checkpoint
    go.set()
    saver.wait()
    assert removed == ["a"] and torch.equal(load_sharded(tmp_path / "b")["state_dict"]["w"], torch.arange(5000.0))
    saver.after_save(lambda: removed.append("b"))  # none in flight: at once
    assert removed == ["a", "b"] and len(saver.writes_s) == 2


def test_the_next_save_waits_for_the_one_in_flight(tmp_path, monkeypatch):
    saver, go = AsyncSaver(Axis.solo("checkpoint")), _hold_writes(monkeypatch)
    saver.save({"w": torch.zeros(3)}, str(tmp_path / "a"), rank=0, world_size=1)
    second = threading.Thread(target=saver.save, args=({"w": torch.ones(3)}, str(tmp_path / "b")),
                              kwargs={"rank": 0, "world_size": 1})
    second.start()
    second.join(0.5)
    assert second.is_alive() and not (tmp_path / "a").exists()  # blocked behind the first
    go.set()
    second.join(10)
    saver.wait()
    assert is_sharded(tmp_path / "a") and is_sharded(tmp_path / "b")


def test_a_failed_write_is_raised_at_the_next_wait_and_removes_nothing(tmp_path, monkeypatch):
    saver = AsyncSaver(Axis.solo("checkpoint"))

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sharded, "_write_part", full)
    saver.save({"w": torch.zeros(3)}, str(tmp_path / "a"), rank=0, world_size=1)
    saver._thread.join()
    removed = []
    saver.after_save(lambda: removed.append("older"))
    with pytest.raises(CheckpointError, match=r"asynchronous save of .*a failed: .*No space left on device"):
        saver.wait()
    assert removed == [] and not (tmp_path / "a").exists()
    saver.wait()  # raised once


def test_stalls_run_from_the_dump_to_the_barrier_after_the_save():
    stalls = async_save.SaveStalls()
    stalls.end()  # no save started: nothing
    stalls.start()
    stalls.start()  # (a second call inside one dump keeps the first start)
    stalls.end()
    assert len(stalls.stalls) == 1 and stalls.stalls[0] >= 0


def test_bench_saves_reports_the_stall_ratio_and_steps_per_second_against_no_saving():
    import argparse

    from strategies.cli import bench_saves

    results = {"off": {"step_time_s": 2.0},
               "sync": {"step_time_s": 4.0, "checkpoint": {"saves": 2, "stall_s": 5.0, "stall_s_later": 5.0}},
               "async": {"step_time_s": 2.5, "checkpoint": {"saves": 2, "stall_s": 0.5, "stall_s_first": 0.8,
                                                            "stall_s_later": 0.2, "write_s": 6.0}},
               "gathered": {"step_time_s": 5.0, "checkpoint": {"saves": 2, "stall_s": 8.0}}}
    rows = [bench_saves.row(mode, results[mode], results["off"]) for mode in bench_saves.MODES]
    assert [r["vs off"] for r in rows] == [1.0, 0.5, 0.8, 0.4]
    args = argparse.Namespace(plan="dp", devices=4, n_layer=16, n_embd=1024, steps=25, every=10)
    text = bench_saves.report(rows, args, 201_000_000)
    assert "201M parameters" in text and "asynchronous / synchronous: **0.100** over every save, **0.040**" in text
    assert "| async | 0.400 | 0.80x | 2 | 0.50 | 0.80 | 0.20 | 6.00 |" in text
    assert "by slice / gathered (the format before #59): **0.625**" in text
