"""`stratpack drift`'s table (the long runs themselves are a benchmark: docs/drift-*.md)."""

from __future__ import annotations

import pytest


def test_drift_report_takes_the_worst_step_of_each_window_and_says_whether_the_goal_is_met():
    from strategies.cli.drift import report, windows

    reference = [2.0] * 5
    drift = windows([2.0, 2.0002, 2.0, 2.01, 2.0], reference, 2)
    assert drift == pytest.approx([1e-4, 5e-3, 0.0])
    text = report({"tp2 (2 ranks)": drift, "pp2 (2 ranks)": "RuntimeError: boom"}, 2, 5, "stratpack drift")
    assert "| 1-2 | 3-4 | 5-5 | max | goal |" in text
    assert "| tp2 (2 ranks) | 1.0e-04 | 5.0e-03 | 0.0e+00 | 5.0e-03 | missed |" in text
    assert "| pp2 (2 ranks) | failed: RuntimeError: boom |" in text
