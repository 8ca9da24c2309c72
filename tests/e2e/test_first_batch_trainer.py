"""The first-batch check (`PlanStrategy(check_first_batch=True)`) through the Trainer at 2 ranks: it stops a plan
that computes something other than the model, with both losses (or the step's error) and the plan named, and passes
the same models planted nothing. Every `stratpack train` run of the e2e tests runs it too (on by default there), and
`tests/e2e/test_model_zoo_trainer.py` runs it on the Hugging Face models' 3D plans."""

from __future__ import annotations

import math
import os
import re

import pytest

from tests.helpers import run_job

pytest.importorskip("transformers")
JOB = os.path.join(os.path.dirname(__file__), "_first_batch_job.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return run_job(JOB, tmp_path_factory.mktemp("first_batch"), timeout_s=300, collective_timeout="60", hf=True)[0]


@pytest.mark.parametrize("case,expected", [
    ("chunks", r"plan 'dp1_tp2' gives loss [\d.]+ on rank \d's first batch, where the whole model .* gives [\d.]+"),
    ("row_as_col", r"plan 'dp1_tp2' failed on its first batch \(RuntimeError: .*\), where the whole model"),
    ("stage_order", r"plan 'dp1_pp2\S*' gives loss [\d.]+ on rank \d's first batch, where the whole model"),
])
def test_a_planted_error_stops_the_run_with_both_losses(results, case: str, expected: str):
    result = results[case]
    assert isinstance(result, str) and result.startswith("FirstBatchMismatch: first-batch check: "), result
    assert re.search(expected, result), result


def test_the_same_model_with_the_right_plan_passes(results):
    outcome = results["ok_tp"]
    assert outcome["skipped"] is None and outcome["tolerance"] == 1e-5, outcome
    assert outcome["plan"] == pytest.approx(outcome["reference"], rel=1e-5) and math.isfinite(outcome["plan"])
