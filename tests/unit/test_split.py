"""Where a step's time goes (`strategies.measure.split`): windows less blocked time, the pipeline's re-split, and
parts that never count a second twice."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from strategies.measure import split


@pytest.fixture
def clock(monkeypatch):
    """A clock the test moves, and blocked-seconds counters (all, pp) it sets."""
    state = SimpleNamespace(now=0.0, blocked=(0.0, 0.0))
    monkeypatch.setattr(split.time, "perf_counter", lambda: state.now)
    return state


def _window(s: split.StepSplit, clock, phase: str, seconds: float, blocked: float = 0.0, pp: float = 0.0) -> None:
    s.enter(phase)
    clock.now += seconds
    clock.blocked = (clock.blocked[0] + blocked, clock.blocked[1] + pp)


def test_each_phase_is_its_window_less_the_seconds_blocked_in_it_averaged_over_steps(clock):
    s = split.StepSplit(lambda: clock.blocked)
    for _ in range(2):  # two optimizer steps, the second accumulating two micro-steps
        _window(s, clock, "forward", 10.0, blocked=2.0)
        _window(s, clock, "backward", 5.0, blocked=1.0)
    _window(s, clock, "optimizer", 3.0)
    s.enter(None)
    clock.now += 100.0  # between steps (data loading): no phase's
    _window(s, clock, "forward", 10.0, blocked=2.0)
    s.enter(None)
    assert s.take(2) == {"forward": 12.0, "backward": 4.0, "optimizer": 1.5, "bubble": 0.0}
    assert s.take(1) == dict.fromkeys(("forward", "backward", "optimizer", "bubble"), 0.0)  # a fresh start


def test_a_pipeline_window_is_split_by_its_timeline_and_its_idle_time_is_the_bubble(clock):
    s = split.StepSplit(lambda: clock.blocked)
    # The schedule: waits 1 s for its input (pp), F 1-3 (1 s of it blocked in a tp collective), idle 3-4, B 4-7;
    # the window (12 s) also holds 5 s of Python around the actions.
    _window(s, clock, "forward", 12.0, blocked=3.0, pp=2.0)
    s.enter(None)
    entry = lambda phase, start, end: SimpleNamespace(phase=phase, start=start, end=end)  # noqa: E731
    s.add_pipeline([entry("F", 1.0, 3.0), entry("B", 4.0, 7.0)])
    got = s.take(1)
    # busy 5 s less the 1 s blocked in tp: 4 s of compute, shared 2:3 between F and B; idle 7 - 5 = 2 s
    assert got == pytest.approx({"forward": 1.6, "backward": 2.4, "optimizer": 0.0, "bubble": 2.0})


def test_pipeline_waits_count_in_the_bubble_up_to_its_length_and_the_parts_add_up_to_the_step():
    comm = {"send/pp": {"wait_s": 3.0}, "all_reduce/dp": {"wait_s": 1.0}, "all_gather/dp": {"wait_s": 0.0}}
    assert split.exposed_comm(comm, bubble=2.0) == {"send/pp": 1.0, "all_reduce/dp": 1.0}
    parts = split.breakdown(10.0, {"forward": 2.0, "backward": 3.0, "optimizer": 1.0, "bubble": 2.0}, comm)
    assert parts == {"forward": 2.0, "backward": 3.0, "optimizer": 1.0, "bubble": 2.0, "comm send/pp": 1.0,
                     "comm all_reduce/dp": 1.0, "other": 0.0}
    assert sum(parts.values()) == 10.0
