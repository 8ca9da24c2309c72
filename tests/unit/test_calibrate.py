"""This machine's calibration (`strategies.measure.calibrate`) and the planner's step times from it."""

from __future__ import annotations

import pytest

from strategies.measure import calibrate
from strategies.measure.calibrate import Calibration
from strategies.measure.estimate import ModelShape
from strategies.measure.planner import Hardware, rank_plans

LINKS = {"all_reduce@4": (4e-3, 2e9), "all_reduce@2": (1e-3, 3e9), "all_gather@4": (3e-3, 1e9),
         "all_gather@2": (1e-3, 1e9), "reduce_scatter@4": (5e-3, 1e9), "reduce_scatter@2": (1e-3, 5e8),
         "send@2": (2e-3, 3e9)}


def test_measured_at_two_ranks_fits_latency_and_bandwidth_and_caches_them(tmp_path, monkeypatch):
    monkeypatch.setenv(calibrate.CACHE_ENV, str(tmp_path / "calibration.json"))
    assert calibrate.load(2) is None
    cal = calibrate.measure(2, hidden=32, tokens=64)
    assert cal.world == 2 and cal.flops > 1e6
    assert set(cal.links) == {"all_reduce@2", "all_gather@2", "reduce_scatter@2", "send@2"}
    assert all(latency > 0 and bandwidth > 0 for latency, bandwidth in cal.links.values())
    assert calibrate.load(2) == cal and calibrate.load(4) is None  # per world size (and host, torch)


def test_a_link_is_the_measured_group_size_nearest_below_and_bytes_follow_the_ring():
    cal = Calibration(4, 1e10, LINKS)
    assert cal.link("all_reduce", 2) == (1e-3, 3e9)
    assert cal.link("all_reduce", 8) == (4e-3, 2e9)  # 8 ranks: the 4-rank figures
    assert cal.link("send", 4) == (2e-3, 3e9)
    assert calibrate.sent_bytes("all_reduce", 100, 4) == 150 and calibrate.sent_bytes("all_gather", 100, 4) == 75
    # Latency: a small call between computes (what training pays); bandwidth: back-to-back small against large.
    latency, bandwidth = calibrate._fit({calibrate.SMALL: 1e-3, calibrate.LARGE: 3e-3, "loaded": 2.5e-3}, 2, "send")
    assert latency == 2.5e-3 and bandwidth == pytest.approx((calibrate.LARGE - calibrate.SMALL) / 2e-3)
    # A loaded figure under the back-to-back one (a core taken from the loaded timing's baseline): the back-to-back one
    assert calibrate._fit({calibrate.SMALL: 1e-3, calibrate.LARGE: 3e-3, "loaded": 0.0}, 2, "send")[0] == 1e-3


def test_calibrated_step_times_pay_a_latency_per_collective_and_hide_nothing_on_cpu():
    shape = ModelShape(layers=2, hidden=64, heads=2, seq=64, vocab=158)
    hw = Hardware.calibrated(Calibration(4, 4e10, LINKS), memory=4e9)
    ranked = {r.label: r for r in rank_plans(shape, hw, 16, precision="32-true")}
    dp, tp = ranked["dp"].parts, ranked["dp_tp2_sp_vp"].parts
    assert dp["dp comm"] > 4e-3  # one bucket's all_reduce over 4 ranks: its latency at least, none of it hidden
    # tp: four collectives per block per microbatch over 2 ranks: at least 8 latencies of 1 ms
    assert tp["tp comm"] >= 8 * 1e-3
    zero3_pp2 = [r for label, r in ranked.items() if label.startswith("zero3_pp2_") and label.endswith("_mb8")]
    assert len(zero3_pp2) == 1 and ranked["dp"].seconds < zero3_pp2[0].seconds  # (with the schedule it chose)
