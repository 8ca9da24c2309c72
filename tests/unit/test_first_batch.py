"""The first-batch check's own logic, in one process (`strategies.lightning.first_batch`): what it compares, its
tolerances, and each reason it is skipped for. Through the Trainer at 2 ranks: tests/e2e/test_first_batch_trainer.py."""

from __future__ import annotations

import contextlib

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from strategies.comm import Axis
from strategies.lightning.first_batch import ATOL, FP32_RTOL, LOW_PRECISION_FLOOR, FirstBatchCheck, FirstBatchMismatch

BATCH = (torch.randn(4, 8), torch.randn(4, 1))


class Net(L.LightningModule):
    def __init__(self, dropout: float = 0.0, manual: bool = False) -> None:
        super().__init__()
        self.body, self.drop = nn.Linear(8, 1), nn.Dropout(dropout)
        self.automatic_optimization = not manual
        self.data = TensorDataset(torch.randn(1000, 8))  # data the module holds: shared with the copy, not copied

    def training_step(self, batch, index):
        x, y = batch
        self.log("loss", 1.0)  # collected, not sent to a Trainer the copy does not have
        return {"loss": nn.functional.mse_loss(self.drop(self.body(x)), y)}


WORLD = Axis.solo("world")


def _check(module, precision: str = "32-true", context=contextlib.nullcontext, microbatches: int = 1):
    check = FirstBatchCheck.prepare(module, precision, context, WORLD)
    check.reference(module.state_dict(), (BATCH, 0), microbatches)
    return check


def test_equal_losses_pass_and_the_copy_is_dropped():
    module = Net()
    check = FirstBatchCheck.prepare(module, "32-true", contextlib.nullcontext, WORLD)
    assert check.copy.data is module.data and check.copy.body.weight is not module.body.weight
    assert check.copy._trainer is None  # what training_step does through the Trainer must not happen twice
    check.reference(module.state_dict(), (BATCH, 0), 1)
    assert check.copy is None and check.mine.tolerance == FP32_RTOL
    outcome = check.compare(module.training_step(BATCH, 0), "dp", WORLD)
    assert outcome.skipped is None and outcome.relative == 0.0


def test_a_difference_above_the_tolerance_stops_with_both_losses():
    module = Net()
    check = _check(module)
    loss = module.training_step(BATCH, 0)["loss"]
    # the bound is relative with an absolute floor (FP32_RTOL * |loss| + ATOL): three bounds off, whatever the random
    # loss is (a loss near zero once made "3 * FP32_RTOL relative" fall under the floor: CI stop 63)
    bound = FP32_RTOL * abs(float(loss)) + ATOL
    wrong = loss + 3 * bound
    with pytest.raises(FirstBatchMismatch, match=r"plan 'tp2' gives loss [\d.]+ on rank 0's first batch, where the "
                                                 r"whole model in one process's arithmetic gives [\d.]+"):
        check.compare(wrong, "tp2", WORLD)
    check = _check(module)  # within the tolerance: passes
    assert check.compare(loss + bound / 3, "tp2", WORLD)


def test_bf16_takes_its_tolerance_from_the_measured_spread():
    check = _check(Net(), "bf16-mixed", lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert check.mine.tolerance >= LOW_PRECISION_FLOOR and check.mine.skipped is None


@pytest.mark.parametrize("module,reason", [
    (Net(dropout=0.5), "draws random numbers"),
    (Net(manual=True), "manual optimization"),
])
def test_skipped_with_the_reason(module, reason: str):
    check = _check(module)
    with pytest.warns(UserWarning, match=f"first-batch check of 'dp' skipped: .*{reason}"):
        outcome = check.compare(torch.tensor(1.0), "dp", WORLD)
    assert reason in outcome.skipped


def test_dropout_is_seen_whatever_its_draws():
    # 4 dropout draws: two runs from different seeds give one loss once in 16 seeds; the generators' states still
    # moved (a run that compared the two losses alone checked such a model and stopped it: CI stop 63)
    for seed in range(48):
        torch.manual_seed(seed)
        assert "draws random numbers" in (_check(Net(dropout=0.5)).mine.skipped or ""), seed


def test_a_model_on_the_meta_device_is_skipped():
    with torch.device("meta"):
        module = Net()
    assert "meta device" in FirstBatchCheck.prepare(module, "32-true", contextlib.nullcontext, WORLD).mine.skipped


def test_a_step_that_fails_under_the_plan_names_the_plan():
    check = _check(Net())
    error = check.failed(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), "tp2")
    assert isinstance(error, FirstBatchMismatch) and "plan 'tp2' failed on its first batch (RuntimeError" in str(error)
    for other in (torch.OutOfMemoryError("out of memory"), ValueError("a batch of 3 does not split into mb4")):
        assert check.failed(other, "tp2") is other  # the pack's own refusals and OOM keep their type and text


def test_weights_changed_after_set_up_are_the_ones_checked():
    # A model that loads its weights in on_fit_start (after the copy): the copy takes the plan's weights of now.
    module = Net()
    check = FirstBatchCheck.prepare(module, "32-true", contextlib.nullcontext, WORLD)
    with torch.no_grad():
        module.body.weight.mul_(3)
    check.reference(module.state_dict(), (BATCH, 0), 1)
    assert check.compare(module.training_step(BATCH, 0), "dp", WORLD).skipped is None


def test_a_loss_near_zero_passes_on_its_rounding():
    check = _check(Net())
    check.mine = type(check.mine)(1e-7, None, FP32_RTOL)
    assert check.compare(torch.tensor(1.3e-7), "tp2", WORLD).skipped is None  # 30% relative, 3e-8 absolute


def test_a_pipelines_loss_is_the_mean_over_its_microbatches():
    module = Net()
    check = _check(module, microbatches=2)
    halves = [module.training_step((x, y), 0)["loss"] for x, y in zip(*(t.chunk(2) for t in BATCH))]
    assert check.mine.reference == pytest.approx(float(sum(halves) / 2), rel=1e-6)
