"""The estimator on mixture-of-experts models (#48): the shape read from the demo's and Hugging Face's configs counts
the parameters the model has; expert states per rank are 1/ep of the experts (ZeRO: sharded over the dp x cp / ep
ranks that hold the same ones); the all-to-all of a balanced router is `expert_parallel.cost`'s."""

from __future__ import annotations

import dataclasses

import pytest

from demos.gpt import GPT, GPTConfig
from strategies.expert_parallel import cost
from strategies.measure.estimate import ModelShape, estimate, model_states, stage_experts
from strategies.plan import ParallelPlan

CONFIG = GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_embd=32, seq_len=16, n_experts=4, top_k=2)


def test_demo_moe_shape_counts_its_parameters():
    shape = ModelShape.from_config(dataclasses.asdict(CONFIG))
    assert (shape.experts, shape.top_k) == (4, 2)
    assert shape.total() == sum(p.numel() for p in GPT(CONFIG).parameters())


def test_mixtral_shape_counts_its_parameters():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32)
    shape = ModelShape.from_config(config.to_dict())
    assert (shape.family, shape.experts, shape.expert_ffn) == ("llama", 4, 48)
    assert shape.total() == sum(p.numel() for p in transformers.MixtralForCausalLM(config).parameters())


def test_expert_states_per_rank():
    shape = ModelShape.from_config(dataclasses.asdict(CONFIG), batch=4)
    experts = shape.expert_params()  # per block, all 4 experts: 4 x (fc 128 x 32 + proj 32 x 128)
    assert experts == 4 * 2 * 32 * 128
    for text, world, held in (("ep2", 2, experts), ("ep4", 4, experts // 2), ("ep2", 4, experts)):
        plan = ParallelPlan.parse(text).resolve(world)
        assert stage_experts(shape, plan) == [held]  # 2 blocks, E/ep experts each (not a factor of the world)
    # ZeRO-3 over 4 ranks with ep2: the dense part over 4 ranks, the experts' 1/2 over the 2 ranks holding them
    plan = ParallelPlan.parse("zero3_ep2").resolve(4)
    psi, mine = 10_000 + experts, experts  # (a rank's parameters: any dense count, one block's expert share)
    assert model_states(psi, plan, experts=mine)["params"] == 4 * (2_500 + experts // 2)


def test_balanced_all_to_all_is_the_cost_formula():
    shape = ModelShape.from_config(dataclasses.asdict(CONFIG), batch=4)
    got = estimate(shape, "ep2", 2).comm["all_to_all/ep"]
    per_block = cost.balanced_all_to_all_bytes(4 * 16, 2, 4, 2, 32, 4)
    assert got == pytest.approx(2 * per_block)
    with pytest.raises(ValueError, match="a dense model"):
        estimate(dataclasses.replace(shape, experts=0), "ep2", 2)


def test_expert_states_per_rank_are_what_the_technique_keeps():
    from strategies.comm import Axis, CommStats
    from strategies.expert_parallel import ExpertParallel
    from strategies.measure.estimate import stage_params

    shape = ModelShape.from_config(dataclasses.asdict(CONFIG))
    for ep in (2, 4):
        model = GPT(CONFIG)
        ExpertParallel(model, Axis("ep", None, tuple(range(ep)), ep - 1, CommStats()))  # (slices, sends nothing)
        held = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        plan = ParallelPlan.parse(f"ep{ep}").resolve(ep)
        assert held == stage_experts(shape, plan)[0] == 2 * 4 // ep * 2 * 32 * 128
        assert sum(p.numel() for p in model.parameters()) == stage_params(shape, plan)[0]


def test_planner_weighs_ep_for_a_mixture_of_experts():
    from strategies.measure.planner import GiB, Hardware, candidates, rank_plans

    shape = ModelShape(layers=8, hidden=1024, heads=16, seq=1024, vocab=32000, experts=8, top_k=2)
    plans = candidates(shape, 8)
    assert {"zero3_ep8", "dp_tp2_ep4", "zero1_ep2_pp2_mb8"} <= set(plans)
    assert not any("_sp" in p and "_ep" in p for p in plans)  # refused together (`ParallelPlan`)
    assert not any("_ep" in p for p in candidates(dataclasses.replace(shape, experts=0), 8))
    ranked = {r.label: r for r in rank_plans(shape, Hardware(gpus=8, memory=80 * GiB), global_batch=8)}
    ep8 = ranked["zero3_ep8"]
    assert ep8.estimate.comm["all_to_all/ep"] > 0 and ep8.parts["ep comm"] > 0
    # Under dp (no ZeRO) ep8 holds 1/8 of the experts: less state than dp itself
    assert ranked["dp_ep8"].estimate.states[0]["params"] < ranked["dp"].estimate.states[0]["params"]
