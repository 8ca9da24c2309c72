"""`Trainer(strategy=strategies.ZeroStrategy(stage=3))` trains exactly as `Trainer(strategy="zero3")`, and likewise
for every named class: the same losses and final parameters, bit for bit, in the same processes."""

from __future__ import annotations

import torch


def test_named_classes_train_exactly_as_their_plan_strings(named_jobs):
    results = named_jobs[2]  # (the session's shared ranks: tests/e2e/conftest.py)
    assert len(results) == 6
    for plan, got in results.items():
        (named_losses, named_params), (losses, params) = got["named"], got["string"]
        assert len(losses) == 3 and named_losses == losses, (got["class"], plan, named_losses, losses)
        assert named_params.keys() == params.keys()
        for name, value in params.items():
            assert torch.equal(named_params[name], value), (got["class"], plan, name)
        assert losses[-1] < losses[0], (plan, losses)  # it trained
