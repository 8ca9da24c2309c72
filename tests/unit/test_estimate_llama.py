"""The estimator's Llama family (`ModelShape.family`): Hugging Face's Llama and Qwen2 counted as they are built and as
their forward saves for backward, tensor by tensor, on meta under each precision the pack runs (no data, a second)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers

from strategies.lightning.rehearsal import target_kernels
from strategies.measure.estimate import ModelShape, step_pieces
from strategies.measure.memory import _storage_key
from strategies.plan import ParallelPlan
from strategies.tensors import MetaAutocast

TINY = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, intermediate_size=704, num_hidden_layers=3,
            vocab_size=1000, max_position_embeddings=128, tie_word_embeddings=False)


def _model(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    config = getattr(transformers, f"{kind}Config")(**TINY)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return getattr(transformers, f"{kind}ForCausalLM")(config).to(dtype)


def _saved_in_forward(model: torch.nn.Module, batch: int, seq: int, mixed: bool) -> int:
    """Bytes of the storages autograd saves in one forward with its loss, the parameters left out (the rehearsal's
    kernels: flash attention as on CUDA; autocast on meta where ``mixed``)."""
    params = {_storage_key(p) for p in model.parameters()}
    seen: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _storage_key(t) not in params:
            seen[_storage_key(t)] = t.untyped_storage().nbytes()
        return t

    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()
    with target_kernels("cuda"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast, \
            MetaAutocast():
        model(input_ids=ids, labels=ids)
    return sum(seen.values())


def test_the_llama_familys_parameters_are_counted_exactly():
    for kind in ("Llama", "Qwen2"):
        model = _model(kind, torch.float32)
        shape = ModelShape.from_config(model.config.to_dict())
        assert shape.family == "llama" and shape.kv_heads == 2 and shape.qkv_bias == (kind == "Qwen2")
        assert shape.total() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind,precision", [("Llama", "bf16-mixed"), ("Llama", "32-true"), ("Qwen2", "bf16-true")])
def test_what_a_llama_forward_saves_for_backward_is_what_the_estimator_counts(kind: str, precision: str):
    # A rank's whole model as one chunk (the first and the last): its blocks, the embedding's output, the final norm's
    # and the float32 log-softmax, plus autocast's half copy of each matmul's weight. The estimator leaves out only
    # what is a few values per token (the norms' row statistics, the positions' sines, the ids and labels).
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    mixed = precision == "bf16-mixed"
    model, batch, seq = _model(kind, dtype), 2, 128
    shape = ModelShape.from_config({**model.config.to_dict(), "seq_len": seq}, batch=batch)
    plan = ParallelPlan.parse("dp").resolve(1)
    act, weight = (2, 4) if mixed else (4, 4) if precision == "32-true" else (2, 2)
    pieces = step_pieces(shape, plan, act, weight, wide_bytes=weight if mixed else None)
    casts = act * (shape.layers * shape.block()[0] + shape.vocab * shape.hidden) if mixed else 0
    expected = pieces.saved(shape.layers, True, True) + casts
    assert _saved_in_forward(model, batch, seq, mixed) == pytest.approx(expected, rel=0.01)


def test_recompute_turns_hugging_faces_key_value_cache_off_and_teardown_puts_it_back():
    # Under recompute the cache would keep, for every block, the graph its recompute rebuilds (rehearsed: Llama 3 70B
    # at zero3_tp8_ac peaked 31 GiB higher per rank): `ac` turns it off for the run, as Hugging Face's own does.
    from strategies.activation_checkpoint import ActivationCheckpointing

    model = _model("Llama", torch.float32)
    assert model.config.use_cache is True
    ac = ActivationCheckpointing(model.model.layers, model)
    assert model.config.use_cache is False and all("forward" in vars(b) for b in model.model.layers)
    ac.teardown(healthy=True)
    assert model.config.use_cache is True and not any("forward" in vars(b) for b in model.model.layers)
