"""Checkpoints that move between plans and world sizes: saved by one, resumed by another, the run goes on with
the losses and parameters of an uninterrupted single-process run (tolerances of test_trainer.py).

The runs have two epochs of 4 steps and save a checkpoint every 3 steps: the resumed runs start mid-epoch, from the
one of step 3, and train to step 8 across the epoch boundary, so they must take up the sampler where the saved run
left it (`strategies.lightning.resume`; without it they would train on the epoch's first batches again).
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from tests import lane
from tests.helpers import ATOL, PARAM_ATOL, RTOL, train_demo

EPOCHS = ("--epoch-steps", "4", "--steps", "8")
SAVE = ("--checkpoint-every", "3")
STEP3 = "epoch=0-step=3.ckpt"  # mid-epoch


def _reference(factory):
    return train_demo(factory.mktemp("ref"), "single", 1, *EPOCHS)


def _saved(factory):
    # The headline plan saves: dp2 x tp2 x pp2, ZeRO-3 over dp, each rank writing its part.
    tmp = factory.mktemp("zero3_tp2_pp2")
    result, params = train_demo(tmp, "zero3_tp2_pp2", 8, *EPOCHS, *SAVE, "--checkpoint-dir", str(tmp / "ckpt"))
    return result, params, str(tmp / "ckpt" / STEP3)


# (both on the suite's second lane, tests/lane.py)
lane.register(
    "reshard", lambda item: item.path.name == "test_reshard.py" and lane.takes(item, "reference", "saved"),
    lambda factory, readers: [(f"reshard-{name}", partial(fn, factory)) for name, fn in (
        ("reference", _reference), ("saved", _saved)) if any(lane.takes(item, name) for item in readers)])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return lane.result("reshard-reference", partial(_reference, tmp_path_factory))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, reference):
    return lane.result("reshard-saved", partial(_saved, tmp_path_factory))


def _assert_continues(result, params, reference) -> None:
    ref_result, ref_params = reference
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_result["losses"][3:]), rtol=RTOL,
                               atol=ATOL)
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=RTOL, atol=PARAM_ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_a_save_is_a_dcp_directory_of_each_ranks_slice(saved, reference):
    result, params, path = saved
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference[0]["losses"]), rtol=RTOL,
                               atol=ATOL)  # saving does not disturb the run
    names = sorted(os.listdir(path))
    assert names == [".metadata"] + [f"__{r}_0.distcp" for r in range(8)] + ["meta.pt"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy,devices", [("zero1_pp2", 4), ("single", 1), ("dp_tp2_sp", 4),
                                              pytest.param("zero3_tp2_pp2", 8, marks=pytest.mark.matrix)])  # (its own)
def test_resume_under_another_plan_and_world_size(tmp_path, saved, reference, strategy: str, devices: int):
    result, params = train_demo(tmp_path, strategy, devices, *EPOCHS, "--resume", saved[2])
    _assert_continues(result, params, reference)


@pytest.mark.slow
def test_a_sharded_checkpoint_converts_to_the_model_s_own_state_dict(tmp_path, saved):
    # docs/checkpoints.md's third line, on the headline plan's checkpoint of step 6 (its first two lines are
    # `saved` and the resume under zero1_pp2 at 4 above, with the same options)
    from strategies.cli import main

    out, ckpt = tmp_path / "model.pt", os.path.join(os.path.dirname(saved[2]), "epoch=1-step=6.ckpt")
    assert main(["convert", ckpt, str(out), "--model-only", "--strip-prefix", "model."]) == 0
    state = torch.load(out)  # what model.load_state_dict takes: the model's own names, every parameter whole
    final = {name.removeprefix("model."): p for name, p in saved[1].items()}
    assert {k: v.shape for k, v in state.items() if k in final} == {k: p.shape for k, p in final.items()}
    assert not any(k.startswith("model.") for k in state)


@pytest.mark.slow
def test_single_file_checkpoint_resumes_under_a_plan(tmp_path, reference):
    first = tmp_path / "single"
    first.mkdir()
    train_demo(first, "single", 1, *EPOCHS, *SAVE, "--checkpoint-dir", str(first / "ckpt"))
    assert os.path.isfile(first / "ckpt" / STEP3)  # Lightning's own single-file format
    result, params = train_demo(tmp_path, "zero2_tp2", 4, *EPOCHS, "--resume", str(first / "ckpt" / STEP3))
    _assert_continues(result, params, reference)


@pytest.mark.slow
def test_checkpoint_of_another_model_fails_naming_the_mismatch(tmp_path, saved):
    with pytest.raises(AssertionError) as failed:
        train_demo(tmp_path, "zero1_pp2", 4, *EPOCHS, "--n-embd", "16", "--resume", saved[2])
    message = str(failed.value)
    # Lightning's strict load names each parameter: "size mismatch for model.head.weight: copying a param
    # with shape torch.Size([88, 32]) from checkpoint, the shape in current model is torch.Size([88, 16])"
    assert "size mismatch for model." in message
    assert "torch.Size([88, 32]) from checkpoint, the shape in current model is torch.Size([88, 16])" in message
