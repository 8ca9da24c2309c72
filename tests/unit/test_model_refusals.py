"""Models and settings tensor parallel cannot handle are refused at setup with a message that says why and what to
do, instead of a partial split, a deep traceback, or a run that trains on wrong numbers."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from strategies.comm import Axis
from strategies.lightning.assemble import check_optimization, check_precision
from strategies.plan import ParallelPlan
from strategies.tensor_parallel import apply_plan, detect_plan
from strategies.tensor_parallel.layers import gather_sequence

transformers = pytest.importorskip("transformers")


def _axis(size: int) -> Axis:
    return Axis("tp", None, tuple(range(size)), 0)  # splitting needs no process group


def _hf(config: str, model: str, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return getattr(transformers, model)(getattr(transformers, config)(**(sizes | kwargs)))


def test_kv_heads_fewer_than_tp_are_refused_with_the_arithmetic():
    model = _hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"1 key/value heads \(num_key_value_heads\) and 4 query heads cannot split "
                                         r"over tp = 2.*Use a tp that divides 1"):
        apply_plan(model, detect_plan(model), _axis(2))


def test_parameters_inside_a_split_attention_are_refused():
    model = _hf("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2)  # per-head q_norm / k_norm
    with pytest.raises(ValueError, match=r"self_attn: tensor parallel splits.*q_norm.weight.*partial sum"):
        apply_plan(model, detect_plan(model), _axis(2))


def test_a_layout_matched_in_part_is_refused_naming_what_is_not_understood():
    model = _hf("LlamaConfig", "LlamaForCausalLM")
    for layer in model.model.layers:
        layer.mlp.extra = nn.Linear(32, 32)  # a linear no shipped plan names
    with pytest.raises(ValueError, match=r"split only part.*Llama.*does not understand 2: model.layers.0.mlp.extra, "
                                         r"model.layers.1.mlp.extra.*tp_plan="):
        detect_plan(model)


@pytest.mark.parametrize("config,model,kind", [
    ("FalconConfig", "FalconForCausalLM", "falcon"),  # its fused query_key_value is not NeoX's per-head layout
    ("BloomConfig", "BloomForCausalLM", "bloom"),
])
def test_fused_layouts_of_other_model_types_are_refused(config: str, model: str, kind: str):
    m = _hf(config, model, n_head=4) if kind == "bloom" else _hf(config, model)
    with pytest.raises(ValueError, match=rf"no tensor-parallel plan fits.*model_type '{kind}'.*tp_plan="):
        detect_plan(m)


def test_sequence_parallel_refuses_hidden_states_flattened_before_a_split_layer():
    with pytest.raises(ValueError, match=r"shaped \(batch, sequence, features\).*\(32, 16\).*Drop 'sp'"):
        gather_sequence(torch.zeros(32, 16), _axis(2))


@pytest.mark.parametrize("plan", ["tp2", "pp2", "dp_tp2_pp2"])
def test_fp16_loss_scaling_is_refused_with_model_parallelism(plan: str):
    fp16 = types.SimpleNamespace(scaler=object())
    with pytest.raises(ValueError, match=r"16-mixed.*own part of the gradients.*bf16-mixed"):
        check_precision(fp16, ParallelPlan.parse(plan))
    check_precision(fp16, ParallelPlan.parse("zero2"))  # ZeRO shares the overflow decision over dp
    check_precision(types.SimpleNamespace(scaler=None), ParallelPlan.parse(plan))


def test_manual_optimization_is_refused_under_pipeline_parallel():
    manual = types.SimpleNamespace(automatic_optimization=False)
    with pytest.raises(ValueError, match=r"manual optimization.*cannot run under it"):
        check_optimization(manual, ParallelPlan.parse("pp2"))
    check_optimization(manual, ParallelPlan.parse("tp2"))


def test_vocab_parallel_is_refused_where_it_cannot_split_the_vocabulary():
    from strategies.tensor_parallel import VocabHead
    from strategies.tensor_parallel.families import vocab_plan

    with pytest.raises(ValueError, match=r"vp \(vocab parallel\).*needs tp<N> with N > 1"):
        ParallelPlan.parse("zero3_vp")
    odd = _hf("LlamaConfig", "LlamaForCausalLM", vocab_size=66)
    with pytest.raises(ValueError, match=r"vocabulary of lm_head \(66\) does not divide by tp = 4; pad it.*256"):
        vocab_plan(odd, 4)
    headless = nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 64), nn.Linear(8, 64))  # two candidate heads
    with pytest.raises(ValueError, match=r"no single output layer.*VocabHead\(\)"):
        vocab_plan(headless, 2)
    tied = _hf("LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight \(not split\), lm_head.weight \(VocabHead\) are "
                                         r"one tied parameter"):
        apply_plan(tied, {"lm_head": VocabHead(), **detect_plan(tied)}, _axis(2))


def test_vocab_parallel_keeps_an_embedding_whole_that_its_split_would_change():
    from strategies.tensor_parallel import VocabHead
    from strategies.tensor_parallel.families import vocab_layers, vocab_plan

    # Gemma scales its embedding's output by sqrt(hidden) in the embedding's own forward: untied, only the head
    # splits; tied, refused.
    untied = _hf("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    assert vocab_plan(untied, 2) == {"lm_head": VocabHead()}
    tied = _hf("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"model.embed_tokens is tied to lm_head, but it is not a plain nn.Embedding"):
        vocab_plan(tied, 2)
    # A model without a vocabulary (its get_input_embeddings raises) has no output layer to meter or split.
    vision = _hf("ResNetConfig", "ResNetForImageClassification", hidden_sizes=[8, 8], depths=[1, 1], embedding_size=8,
                 num_labels=3) if hasattr(transformers, "ResNetConfig") else None
    assert vision is None or vocab_layers(vision) is None
