"""The planner beside published large runs (`measure.published`): the one constant the time model takes from them is
re-derived from its row, and a row's comparison is computed, not copied."""

from __future__ import annotations

import dataclasses

import pytest

from strategies.measure.published import EFFICIENCY, RUNS, compare, implied_efficiency, predicted_seconds


def test_the_compute_efficiency_is_the_one_its_calibration_row_implies():
    # Megatron-LM's 18.4B (tp8, no pipeline): a change to the time model that moves this row must re-derive it.
    (row,) = [r for r in RUNS if r.source.endswith("18.4B")]
    assert implied_efficiency(row) == pytest.approx(EFFICIENCY, rel=0.005)
    assert predicted_seconds(row)[0] == pytest.approx(row.published_seconds(), rel=0.01)


def test_a_published_row_is_ranked_among_the_planners_candidates_and_timed():
    row = RUNS[0]  # Megatron-LM's 1.7B on 32 A100s: dp with recomputation
    got = compare(row)
    assert got["candidates"] > 100 and 1 <= got["rank"] <= got["candidates"] + 1
    assert got["ratio"] == pytest.approx(got["predicted_s"] / got["published_s"])
    # Megatron counts recomputation's forward: the same run published at the same FLOP/s without it is faster.
    plain = dataclasses.replace(row, counts_recompute=False)
    assert plain.published_seconds() == pytest.approx(row.published_seconds() * 3 / 4)
