"""The named strategy classes: each is exactly its plan string (same plan, same options), and refuses a bad
argument by name. (tests/e2e/test_named_trainer.py trains each beside its string.)"""

from __future__ import annotations

import pytest

import strategies
from strategies.plan import ParallelPlan

EQUAL = [
    (lambda: strategies.NaiveDataParallelStrategy(), "naive"),
    (lambda: strategies.NaiveDataParallelStrategy(server_rank=1), "naive"),
    (lambda: strategies.DataParallelStrategy(bucket_cap_mb=1), "dp"),
    (lambda: strategies.ZeroStrategy(stage=1), "zero1"),
    (lambda: strategies.ZeroStrategy(stage=2, offload=True), "zero2_offload"),
    (lambda: strategies.ZeroStrategy(stage=3), "zero3"),
    (lambda: strategies.TensorParallelStrategy(tp=2), "tp2"),
    (lambda: strategies.TensorParallelStrategy(tp=4, sequence_parallel=True), "tp4_sp"),
    (lambda: strategies.PipelineStrategy(pp=2), "pp2"),
    (lambda: strategies.PipelineStrategy(pp=4, schedule="gpipe", microbatches=8), "pp4_gpipe_mb8"),
    (lambda: strategies.PipelineStrategy(pp=2, schedule="interleaved"), "pp2_interleaved"),
    (lambda: strategies.PipelineStrategy(pp=2, schedule="interleaved", virtual_stages=3, microbatches=4),
     "pp2_interleaved_v3_mb4"),
    (lambda: strategies.PipelineStrategy(pp=2, schedule="interleaved", microbatches=5, microbatch_group=3),
     "pp2_interleaved_mb5_mbg3"),
]


@pytest.mark.parametrize("make, plan", EQUAL, ids=[plan for _, plan in EQUAL])
def test_a_named_class_is_its_plan_string(make, plan):
    named = make()
    assert named.plan == ParallelPlan.parse(plan)
    assert isinstance(named, strategies.PlanStrategy)


def test_options_pass_through_unchanged():
    named = strategies.ZeroStrategy(stage=3, bucket_cap_mb=2.0, timeout=30, find_unused_parameters=True)
    plain = strategies.PlanStrategy("zero3", bucket_cap_mb=2.0, timeout=30, find_unused_parameters=True)
    assert named.options == plain.options and named.options.timeout.total_seconds() == 30


@pytest.mark.parametrize("make, name", [
    (lambda: strategies.ZeroStrategy(stage=4), "stage"),
    (lambda: strategies.ZeroStrategy(stage=True), "stage"),
    (lambda: strategies.ZeroStrategy(stage=3, offload="yes"), "offload"),
    (lambda: strategies.TensorParallelStrategy(tp=0), "tp"),
    (lambda: strategies.TensorParallelStrategy(tp=2, sequence_parallel=1), "sequence_parallel"),
    (lambda: strategies.TensorParallelStrategy(tp=1, sequence_parallel=True), "sp"),
    (lambda: strategies.PipelineStrategy(pp=2, schedule="zb"), "schedule"),
    (lambda: strategies.PipelineStrategy(pp=2, schedule="1f1b", microbatches=1),
     "1F1B needs at least as many microbatches"),
    (lambda: strategies.PipelineStrategy(pp=2, schedule="gpipe", virtual_stages=2), "interleaved"),
    (lambda: strategies.DataParallelStrategy(bucket_cap_mb=0), "bucket_cap_mb"),
])
def test_a_bad_argument_is_named(make, name):
    with pytest.raises(ValueError, match=name):
        make()
