"""Tensor and pipeline parallel on the models people bring (tiny random configs of Hugging Face classes, a nanoGPT
written as nanoGPT writes it, a model registered out of order): each trains equal to one process, with plain SGD
(no clipping: any error in a gradient's scale shows) and with AdamW; the last batch is shorter (under pp, the
activations' shapes are sent again). nanoGPT as users change it (`zoo.VARIANTS`) trains equal to one process under
tp2 and tp2_sp, or is refused with the module named (`zoo.REFUSED_UNDER_TP`). The cases of one world size run in one
set of processes; the references run here."""

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
ALL = list(zoo.MODELS)
SP = [m for m in ALL if m != "opt"]  # OPT flattens (batch, seq) before fc1: refused (tests/unit/test_model_refusals)
CASES = {
    2: [(m, "tp2", o) for m in ALL for o in ("sgd", "adamw")] + [(m, "tp2_sp", "sgd") for m in SP]
    + [(m, "tp2_vp", "sgd") for m in ALL] + [(m, "tp2_sp_vp", "adamw") for m in ("llama_tied", "gpt2")]
    + [(m, "pp2_gpipe_mb2", o) for m in ALL for o in ("sgd", "adamw")]
    + [(m, plan, "sgd") for m in zoo.VARIANTS for plan in ("tp2", "tp2_sp")],
    4: [(m, "tp2_pp2_1f1b_mb2", "sgd") for m in ALL]
    + [(m, "tp2_vp_pp2_1f1b_mb2", "sgd") for m in ("llama_tied", "gpt2")],
}
PARAMS = [(*case, world) for world, cases in CASES.items() for case in cases]


def _optimizer(name: str, params):
    return torch.optim.SGD(params, lr=0.5) if name == "sgd" else torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


def _train(model, optimizer: str) -> list[float]:
    opt, losses = _optimizer(optimizer, model.parameters()), []
    for ids in zoo.batches(STEPS, shorter_last=True):
        loss = model.loss(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _rank(rank: int, world: int, cases: list[tuple[str, str, str]]):
    out = {}
    for case in cases:
        try:
            out[case] = _run(*case, world)
        except Exception as error:  # reported by the case's test; the other cases still run
            out[case] = f"{type(error).__name__}: {error}"
    return out


def _run(name: str, plan_text: str, optimizer: str, world: int):
    from strategies.mesh import ParallelMesh
    from strategies.pipeline import PipelineParallel
    from strategies.pipeline.stages import split_microbatches
    from strategies.pipeline.trace import trace_forward
    from strategies.plan import ParallelPlan
    from strategies.technique import HeldGrad
    from strategies.tensor_parallel import TensorParallel, detect_plan
    from strategies.tensor_parallel.families import vocab_layers, vocab_plan

    plan = ParallelPlan.parse(plan_text).resolve(world)
    mesh, model, batches = ParallelMesh(plan, "cpu"), zoo.build(name), zoo.batches(STEPS, shorter_last=True)
    before, techniques, pipe, sp = _attention_attributes(model), [], None, None
    head_name, widths = vocab_layers(model)[0], []  # found before the split replaces it (under the same name)
    if plan.tp > 1:
        rules = {**vocab_plan(model, plan.tp), **detect_plan(model)} if plan.vp else detect_plan(model)
        techniques.append(TensorParallel(model, rules, mesh.tp, sequence_parallel=plan.sp))
        sp = techniques[-1].sequence_parallel
    hook = model.get_submodule(head_name).register_forward_hook(  # the logits a rank holds
        lambda m, args, out: widths.append(out.shape[-1]))
    if plan.pp > 1:
        micro = split_microbatches(batches[0], plan.microbatches)[0]
        trace = trace_forward(model, lambda: model.loss(micro))  # which stage uses what: one forward, watched
        pipe = PipelineParallel(model, plan, mesh, trace.blocks, None, trace)
        techniques.append(pipe)
    opt, losses = _optimizer(optimizer, [p for p in model.parameters() if p.requires_grad]), []
    for ids in batches:
        if pipe is not None:
            loss = pipe.train_step(ids, 0, lambda micro, index: model.loss(micro), torch.device("cpu"))
            pipe.finish_backward(lambda: [HeldGrad(n, p, p.grad) for n, p in model.named_parameters()
                                          if p.grad is not None], True)  # a tied head: the two stages' shares
        else:
            loss = model.loss(ids)
            loss.backward()
        if sp is not None:  # the norms saw half the sequence each: sum their gradients
            sp.reduce_partial_grads()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    hook.remove()
    full = {k: v.detach() for k, v in model.state_dict().items()}
    for technique in reversed(techniques):
        full = technique.full_model_state(full)
    for technique in reversed(techniques):
        technique.teardown(healthy=True)  # the user's own layers back, whole, and the head counts as they were
    layer_types = sorted({type(m).__name__ for m in model.modules()})
    restored = _attention_attributes(model) == before and all(
        torch.equal(full[k], v) for k, v in model.state_dict().items())
    return losses, full, layer_types, restored, sorted(set(widths)), len(list(model.parameters()))


def _attention_attributes(model) -> list:
    from strategies.tensor_parallel.heads import HEAD_COUNTS, WIDTHS

    return [(name, attr, getattr(m, attr)) for name, m in model.named_modules() for attr in HEAD_COUNTS + WIDTHS
            if isinstance(getattr(m, attr, None), int)] + [
        (name, getattr(m.config, "num_attention_heads", None)) for name, m in model.named_modules()
        if hasattr(m, "config")]


@pytest.fixture(scope="module")
def results():
    return {world: run_ranks(_rank, world, cases, timeout_s=300) for world, cases in CASES.items()}


@pytest.mark.parametrize("name,plan,optimizer,world", PARAMS)
def test_model_trains_as_one_process(results, name: str, plan: str, optimizer: str, world: int):
    if name in zoo.REFUSED_UNDER_TP:  # refused at set-up, naming the module, on every rank (never a wrong run)
        for result in (r[name, plan, optimizer] for r in results[world]):
            assert isinstance(result, str) and result.startswith("ValueError: tensor parallel: "), result
            assert zoo.REFUSED_UNDER_TP[name] in result and "read widths and head counts from the module" in result
        return
    model = zoo.build(name)
    ref_losses = _train(model, optimizer)
    for result in (r[name, plan, optimizer] for r in results[world]):
        assert not isinstance(result, str), result
        losses, state, layer_types, restored, widths, n_params = result
        assert restored and layer_types == sorted({type(m).__name__ for m in model.modules()})
        assert n_params == len(list(model.parameters()))  # a tied head is tied again
        # The logits a rank holds (on the ranks that run the head): the whole vocabulary, or 1/tp of it under vp.
        assert widths in ([], [zoo.VOCAB // (2 if "vp" in plan else 1)]), widths
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
        assert state.keys() == model.state_dict().keys()
        for key, value in model.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=PARAM_ATOL[optimizer],
                                       msg=lambda m, k=key: f"{k}: {m}")
