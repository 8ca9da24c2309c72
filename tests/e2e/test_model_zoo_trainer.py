"""The models people bring through the Trainer at 8 ranks: a Hugging Face Llama with grouped-query attention under
`dp_tp2_pp2`, and GPT-2 (its head tied to the embedding, so the first and last stage share it) under
`zero3_tp2_pp2` with clipping, each equal to one process. The one-process reference runs here, on the batches
Lightning's DistributedSampler gives (shuffled with seed 0: the dp ranks' k-th batches together are the k-th
slice of that permutation)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.e2e._zoo_job import BATCH, CASES, STEPS, data
from tests.models import zoo

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
JOB = os.path.join(os.path.dirname(__file__), "_zoo_job.py")
PARAM_ATOL = 1e-5  # SGD, 3 steps, fp32: sums in another order only


def _reference(name: str, clip: float | None) -> dict[str, torch.Tensor]:
    model = zoo.build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = data().tensors[0]
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))  # DistributedSampler, epoch 0
    for step in range(STEPS):
        model.loss(ids[order[step * BATCH : (step + 1) * BATCH]]).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo") / "results.pt"
    env = {**os.environ, "STRATPACK_TIMEOUT": "120", "STRATPACK_RUNS": str(out.parent / "runs"),
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, JOB, str(out)], cwd=out.parent, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("name,plan,clip", CASES)
def test_model_trains_through_the_trainer_as_one_process(results, name: str, plan: str, clip):
    state, reference = results[name, plan], _reference(name, clip)
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=PARAM_ATOL, msg=lambda m, k=key: f"{k}: {m}")
