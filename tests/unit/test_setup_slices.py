"""Tensor parallel under pp, on a model built on meta: each rank makes the tp slices of its own stage's layers only
(`tensor_parallel.plans._later_slice`), not every layer's slice before the pipeline's cut drops the other stages'
(at Llama 3 405B, tp8 pp8: 126 slices of 1.6 GiB made where a stage keeps 16; set-up 79.6 GiB against a steady 37.6
at 48 layers). Rehearsed (one rank on meta tensors, every storage counted: deterministic): the set-up peak is the
estimator's, the model eight times deeper than a stage."""

from __future__ import annotations

from dataclasses import replace

import pytest

from strategies.cli.rehearse import _predicted_peak, rehearse_rank
from strategies.cli.train import RunConfig

CONFIG = RunConfig(strategy="tp2_pp4_1f1b", steps=1, batch_size=4, seq_len=16, n_layer=32, n_embd=256, n_head=4,
                   optimizer="sgd-plain", wandb="off", warmup_steps=0, check_first_batch=False)


def test_a_stage_makes_the_tp_slices_of_its_own_layers_only(tmp_path):
    """Measured: 28.8 MiB against the estimator's 28.8; every layer's slice made at once (planted): 49.2, fails."""
    rank = rehearse_rank(replace(CONFIG, runs_dir=str(tmp_path)), 0, 8)
    assert rank["memory_bytes"]["setup_peak"] == pytest.approx(rank["predicted"]["setup"][0], rel=0.03)



def test_an_interleaved_group_of_microbatches_holds_its_warm_up_and_the_estimator_follows(tmp_path):
    """``mbg<N>`` (`schedules.interleaved`): rank 0 of pp4 x v2 holds 2 x 3 + N + 1 chunk-microbatches at its peak,
    11 in groups of pp (the default), 15 in groups of 8; ten microbatches in groups of 5 run too (a count that is not
    a multiple of pp). The heap's peak (every storage on meta: the same to a few bytes run after run) against the
    estimator's, measured: 6.96, 8.85 and 7.62 MiB, the estimator within 0.5% of each."""
    base = replace(CONFIG, strategy="pp4_interleaved_v2_mb8", steps=2, batch_size=16, seq_len=64, n_layer=8, n_embd=64,
                   runs_dir=str(tmp_path))
    runs = {plan: rehearse_rank(replace(base, strategy=plan, batch_size=20 if "mb10" in plan else 16), 0, 4)
            for plan in ("pp4_interleaved_v2_mb8", "pp4_interleaved_v2_mb8_mbg8", "pp4_interleaved_v2_mb10_mbg5")}
    for plan, r in runs.items():
        assert r["memory_bytes"]["heap_peak"] == pytest.approx(_predicted_peak(r["predicted"]["memory"][0], "cpu"),
                                                                rel=0.02), plan
    # Four more chunk-microbatches in flight (of eleven), in the estimator's activations (which follow the table)
    act = {plan: r["predicted"]["memory"][0]["activations"] for plan, r in runs.items()}
    assert act["pp4_interleaved_v2_mb8_mbg8"] / act["pp4_interleaved_v2_mb8"] == pytest.approx(15 / 11, rel=0.02)
