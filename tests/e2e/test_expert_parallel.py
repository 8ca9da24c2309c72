"""Expert parallel (#48) through the Trainer equal to one process: tiny Mixtral (with its router's aux loss too),
Qwen2-MoE (a shared expert beside the routed ones), Qwen3-MoE, OLMoE and the demo GPT's MoE, 4 experts, top 2, fp32,
plain SGD without momentum or clipping (and AdamW once, with activation checkpointing), 2 steps (`_ep_job.CASES`):
`ep2` at 2 ranks and `ep4` at 4 (each rank the whole ep group), `zero3_ep2` at 2 (experts unsharded: one rank per
expert group) and at 4 (experts ZeRO-sharded over the 2 ranks that hold them), `zero1_ep2`, `tp2_ep2` (routers and
experts whole on each tp rank), `ep2_pp2_mb2`, and at 8 ranks dp, ep, tp and pp together.

Tolerance: parameters to 1e-6 absolute (AdamW: 1e-4); they move by up to ~5e-2 and the runs differ only in the order
of sums (observed <= 6e-8). Planted: the return all-to-all giving each sender's rows back reversed
(`_ep_job.planted_exchange`) fails by far more (checked in `test_broken_return_order_fails`)."""

from __future__ import annotations

import os

import pytest

from tests.e2e._ep_job import CASES, reference
from tests.helpers import run_job

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
JOB = os.path.join(os.path.dirname(__file__), "_ep_job.py")
PARAM_ATOL = {"sgd": 1e-6, "adamw": 1e-4}  # AdamW divides by sqrt(v): sum-order differences grow (test_model_zoo)


def _job(tmp_path_factory, world: int, *extra: str) -> dict:
    return run_job(JOB, tmp_path_factory.mktemp(f"ep{world}"), str(world), *extra, timeout_s=900,
                   env={"PL_GLOBAL_SEED": "0"}, hf=True)[0]


@pytest.fixture(scope="module")
def results(ep_jobs) -> dict:
    return ep_jobs  # (the session's shared ranks: tests/e2e/conftest.py)


@pytest.fixture(scope="module")
def references() -> dict:
    return {case: reference(*case) for case in {(name, opt) for cases in CASES.values() for name, _, opt in cases}}


def _max_error(state: dict, expected: dict) -> float:
    assert state.keys() == expected.keys()
    return max(float((state[k] - expected[k]).abs().max()) for k in expected)


@pytest.mark.parametrize(("world", "name", "plan", "optimizer"), [(w, *case) for w, cases in CASES.items()
                                                                   for case in cases])
def test_expert_parallel_equals_one_process(results, references, world: int, name: str, plan: str, optimizer: str):
    result = results[world][(name, plan, optimizer)]
    got = _max_error(result["params"], references[(name, optimizer)])
    assert got <= PARAM_ATOL[optimizer], got
    check = result["check"]  # the first-batch check ran and passed (the router's loss: each rank's share of it)
    assert check["skipped"] is None and abs(check["plan"] - check["reference"]) <= check["tolerance"], check


def test_each_rank_saves_its_experts_by_slice_and_another_plan_resumes_them(results):
    """#59: under ep a checkpoint is saved by slice (it was gathered): each rank writes its rows of the fused expert
    weights, placed in the whole tensors (with ZeRO-3's shards, tp's slices, a pipeline stage's own). Read whole in
    one process it is the fit's final parameters exactly; mixtral's `zero3_ep2` checkpoint resumed under
    `ep2_pp2_mb2` (each rank reading its experts of its stage) holds them exactly. Planted, the experts not placed
    (ep's `place_box` as is): every rank's rows land at row 0, fails."""
    import torch

    from strategies.checkpoint.dcp_dir import load_whole

    saved = {(w, case): result for w, cases in CASES.items() for case in cases
             if (result := results[w][case])["saved"]}
    assert len(saved) == 4
    for (world, case), result in saved.items():
        state = load_whole(result["saved"])["state_dict"]
        assert {k.removeprefix("net."): v for k, v in state.items()}.keys() == result["params"].keys()
        for key, value in result["params"].items():
            assert torch.equal(state[f"net.{key}"], value), (world, case, key)
    resumed = results[4]["resumed", "mixtral", "ep2_pp2_mb2", "sgd"]["params"]
    for key, value in results[4]["mixtral", "zero3_ep2", "sgd"]["params"].items():
        assert torch.equal(resumed[key], value), key


def test_broken_return_order_fails(tmp_path_factory, references):
    got = _job(tmp_path_factory, 2, "plant")
    (case, result), = got.items()
    assert _max_error(result["params"], references[(case[0], case[2])]) > 100 * PARAM_ATOL["sgd"]
