"""Tensor parallel on the models people bring (tiny random configs of Hugging Face classes, a nanoGPT written as
nanoGPT writes it): each trains equal to one process under tp2 and tp2_sp, with plain SGD (no clipping: any error in
a gradient's scale shows) and with AdamW. All cases run in one pair of processes; the references run here."""

from __future__ import annotations

import pytest
import torch

from strategies.testing import run_ranks
from tests.models import zoo

pytest.importorskip("transformers")

STEPS = 3
LOSS_RTOL = 1e-5  # the bound, relative, per step
# SGD moves every weight by lr * grad, so a gradient error shows at its own size. AdamW divides by sqrt(v): where a
# gradient is ~0 in exact arithmetic (a key bias: softmax ignores it) its rounding noise, ~1e-9, would become a step
# of ~lr with the default eps; eps = 1e-6 keeps such steps small, and the bound is 1% of one step (lr = 1e-2).
PARAM_ATOL = {"sgd": 1e-6, "adamw": 1e-4}
SP_MODELS = [m for m in zoo.MODELS if m != "opt"]  # OPT flattens (batch, seq) before fc1: refused, see below
CASES = [(m, "tp2", o) for m in zoo.MODELS for o in ("sgd", "adamw")] + [(m, "tp2_sp", "sgd") for m in SP_MODELS]


def _optimizer(name: str, params):
    return torch.optim.SGD(params, lr=0.5) if name == "sgd" else torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


def _train(model, optimizer: str, sequence_parallel=None) -> list[float]:
    opt, losses = _optimizer(optimizer, model.parameters()), []
    for ids in zoo.batches(STEPS):
        loss = model.loss(ids)
        loss.backward()
        if sequence_parallel is not None:  # the norms saw half the sequence each: sum their gradients
            sequence_parallel.reduce_partial_grads()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _rank(rank: int, world: int, cases: list[tuple[str, str, str]]):
    from strategies.mesh import ParallelMesh
    from strategies.plan import ParallelPlan
    from strategies.tensor_parallel import TensorParallel, detect_plan

    out = {}
    for name, plan, optimizer in cases:
        mesh = ParallelMesh(ParallelPlan.parse(plan).resolve(world), "cpu")
        model = zoo.build(name)
        before = _attention_attributes(model)
        tp = TensorParallel(model, detect_plan(model), mesh.tp, sequence_parallel=mesh.plan.sp)
        losses = _train(model, optimizer, tp.sequence_parallel)
        full = tp.full_model_state({k: v.detach() for k, v in model.state_dict().items()})
        tp.teardown(healthy=True)  # the user's own layers back, whole, and the head counts as they were
        layer_types = sorted({type(m).__name__ for m in model.modules()})
        restored = _attention_attributes(model) == before and all(
            torch.equal(full[k], v) for k, v in model.state_dict().items())
        out[name, plan, optimizer] = losses, full, layer_types, restored
    return out


def _attention_attributes(model) -> list:
    from strategies.tensor_parallel.heads import HEAD_COUNTS, WIDTHS

    return [(name, attr, getattr(m, attr)) for name, m in model.named_modules() for attr in HEAD_COUNTS + WIDTHS
            if isinstance(getattr(m, attr, None), int)] + [
        (name, getattr(m.config, "num_attention_heads", None)) for name, m in model.named_modules()
        if hasattr(m, "config")]


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, 2, CASES, timeout_s=300)


@pytest.mark.parametrize("name,plan,optimizer", CASES)
def test_model_trains_as_one_process(results, name: str, plan: str, optimizer: str):
    model = zoo.build(name)
    ref_losses = _train(model, optimizer)
    for losses, state, layer_types, restored in (r[name, plan, optimizer] for r in results):
        assert restored and layer_types == sorted({type(m).__name__ for m in model.modules()})
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
        assert state.keys() == model.state_dict().keys()
        for key, value in model.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=PARAM_ATOL[optimizer],
                                       msg=lambda m, k=key: f"{k}: {m}")
