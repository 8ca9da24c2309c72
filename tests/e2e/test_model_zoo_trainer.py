"""The models people bring through the Trainer at 8 ranks, each equal to one process: every model of the issue once
under `dp_tp2_pp2` or `zero3_tp2_pp2` (GPT-2 with `vp`, its head tied to the embedding, so the first and last stage
share it, with clipping), with plain SGD or AdamW (`_zoo_job.CASES`); every model under both plans with both
optimizers with ``-m matrix`` (`_zoo_job.FULL`). Context parallel with rotary and learned positions: Llama under
`dp_cp4` (AdamW), `cp2_pp2_mb2` (its labels shifted per microbatch: counting the whole batch's items instead gives
a wrong gradient scale, caught here), Llama GQA under `zero3_tp2_cp2`, GPT-2 under `zero3_cp4` (AdamW).
Each fit runs the first-batch check, which must pass.
The one-process reference runs here, on the batches
Lightning's DistributedSampler gives (shuffled with seed 0: the dp ranks' k-th batches together are the k-th
slice of that permutation)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.e2e._zoo_job import BATCH, CASES, FULL, STEPS, data, optimizer_for
from tests.helpers import run_job
from tests.models import zoo

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
JOB = os.path.join(os.path.dirname(__file__), "_zoo_job.py")
PARAM_ATOL = {"sgd": 1e-5, "adamw": 1e-4}  # 3 steps, fp32: sums in another order; AdamW: tests/multirank/test_model_zoo


def _reference(name: str, optimizer: str, clip: float | None) -> dict[str, torch.Tensor]:
    model = zoo.build(name)
    opt = optimizer_for(optimizer, model.parameters())
    ids = data().tensors[0]
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))  # DistributedSampler, epoch 0
    for step in range(STEPS):
        model.loss(ids[order[step * BATCH : (step + 1) * BATCH]]).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _job(tmp_path_factory, which: str):
    return run_job(JOB, tmp_path_factory.mktemp("zoo"), which, hf=True)[0]


@pytest.fixture(scope="module")
def results(zoo_jobs):
    return zoo_jobs[8]  # (the session's shared ranks: tests/e2e/conftest.py)


@pytest.fixture(scope="module")
def full_results(tmp_path_factory):
    return _job(tmp_path_factory, "full")


def _check(state: dict, name: str, optimizer: str, clip) -> None:
    check = state.pop("check")  # the first-batch check ran and passed (a difference would have stopped the fit)
    assert check["skipped"] is None and check["plan"] == pytest.approx(check["reference"], rel=check["tolerance"])
    reference = _reference(name, optimizer, clip)
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=PARAM_ATOL[optimizer],
                                   msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.parametrize("name,plan,optimizer,clip", CASES)
def test_model_trains_through_the_trainer_as_one_process(results, name: str, plan: str, optimizer: str, clip):
    _check(results[name, plan, optimizer, clip], name, optimizer, clip)


@pytest.mark.matrix
@pytest.mark.parametrize("name,plan,optimizer,clip", FULL)
def test_model_matrix_through_the_trainer(full_results, name: str, plan: str, optimizer: str, clip):
    _check(full_results[name, plan, optimizer, clip], name, optimizer, clip)
