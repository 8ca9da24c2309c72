"""Resuming mid-epoch (issue 20, part 7) with random draws in the step: a run resumed from a checkpoint saved in
the middle of an epoch ends with the parameters of the uninterrupted run, bit for bit, under ZeRO-3 (accumulating)
and a pipeline at 2 ranks (`_resume_job`). Planted: without the saved random state both end ~2.5e-2 away; without
the sampler position (a plain DataLoader) Lightning starts the epoch again. Across plans and world sizes (resharded),
`test_reshard` resumes mid-epoch too."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import run_job

pytestmark = pytest.mark.slow
JOB = os.path.join(os.path.dirname(__file__), "_resume_job.py")


def test_mid_epoch_resume_with_dropout_ends_bit_identical_to_the_uninterrupted_run(tmp_path):
    results, proc = run_job(JOB, tmp_path, "2", str(tmp_path / "ckpt"))
    assert "not resumable" not in proc.stderr  # Lightning's warning for a loader it restarts
    assert set(results) == {"zero3", "pp2_mb2"}
    for plan, (straight, resumed) in results.items():
        assert straight.keys() == resumed.keys()
        for name, value in straight.items():
            assert torch.equal(resumed[name], value), f"{plan}: {name} differs by {(resumed[name] - value).abs().max()}"
