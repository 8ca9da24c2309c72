"""The shared processes of the end-to-end tests: the Trainer fits of `_sgd_job` (every plan's equivalence with one
process under plain SGD and AdamW, their bytes, clipping, activation checkpointing, the pipeline's timeline), run
once per world size for the session and read by `test_sgd_matrix` and `test_trainer`."""

from __future__ import annotations

import os

import pytest

from tests.helpers import run_job

JOB = os.path.join(os.path.dirname(__file__), "_sgd_job.py")


def sgd_job(tmp_path_factory, world: int, which: str) -> dict:
    """``_sgd_job.py`` at ``world`` ranks (``which``: ci, or full for the matrix): {"states", "extras"}."""
    # PL_GLOBAL_SEED: the samplers' seed, as the reference's, not whatever this process was seeded with
    return run_job(JOB, tmp_path_factory.mktemp(f"sgd{world}"), str(world), which, timeout_s=900,
                   env={"PL_GLOBAL_SEED": "0"})[0]


@pytest.fixture(scope="session")
def sgd_jobs(tmp_path_factory) -> dict:
    from tests.e2e._sgd_job import CASES

    return {world: sgd_job(tmp_path_factory, world, "ci") for world in CASES}
