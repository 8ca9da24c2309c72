"""The suite's second lane (tests/lane.py): work a reader finds not started runs once, where the reader is, and each
later reader gets that result (or its error); work registered twice (a conftest imported again by a test file, with
fixtures and caches of its own) stops the session at once instead of handing two readers two different folders."""

import pytest

from tests import lane


def test_work_not_queued_runs_once_where_it_is_read_and_is_kept():
    calls = []
    key = "test_lane:inline"
    assert lane.result(key, lambda: calls.append(1) or len(calls)) == 1
    assert lane.result(key, lambda: calls.append(1) or len(calls)) == 1 and calls == [1]
    assert not lane.in_lane()


def test_an_error_is_kept_for_every_reader():
    def fails():
        raise ValueError("the run failed")

    for _ in range(2):
        with pytest.raises(ValueError, match="the run failed"):
            lane.result("test_lane:error", fails)


def test_work_registered_twice_is_refused():
    lane.register("test_lane:twice", lambda item: False, lambda factory, readers: [])
    try:
        with pytest.raises(RuntimeError, match="registered twice"):
            lane.register("test_lane:twice", lambda item: False, lambda factory, readers: [])
    finally:
        del lane.PREFETCH["test_lane:twice"]
