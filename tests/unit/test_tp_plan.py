"""TP plans without processes: which plan fits which model, and the errors when none does."""

from __future__ import annotations

import pytest
from torch import nn

from demos.gpt import GPT, GPTConfig
from strategies.comm import Axis
from strategies.tensor_parallel.families import detect_plan
from strategies.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from strategies.tensor_parallel.plans import (
    FUSED_QKV_PLAN,
    SEPARATE_QKV_PLAN,
    Colwise,
    Rowwise,
    apply_plan,
)


def _axis(size: int, index: int = 0) -> Axis:
    return Axis("tp", None, tuple(range(size)), index)  # splitting needs no process group


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))


class LlamaMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, 3 * dim, bias=False)
        self.down_proj = nn.Linear(3 * dim, dim, bias=False)


class LlamaLike(nn.Module):
    def __init__(self, dim: int = 8, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(16, dim)
        self.layers = nn.ModuleList(nn.ModuleDict({"self_attn": LlamaAttention(dim, heads), "mlp": LlamaMLP(dim)})
                                    for _ in range(layers))
        self.lm_head = nn.Linear(dim, 16, bias=False)


def test_detects_the_fused_plan_for_the_demo_gpt():
    assert detect_plan(GPT(GPTConfig(n_head=2, n_embd=16))) is FUSED_QKV_PLAN


def test_detects_the_separate_plan_for_llama_layouts():
    model = LlamaLike()
    assert detect_plan(model) is SEPARATE_QKV_PLAN
    found = apply_plan(model, SEPARATE_QKV_PLAN, _axis(2))
    assert len(found) == 2 * 7
    assert isinstance(model.layers[1].self_attn.q_proj, ColumnParallelLinear)
    assert isinstance(model.layers[1].mlp.down_proj, RowParallelLinear)
    assert model.layers[0].mlp.gate_proj.weight.shape == (12, 8)  # half of the 24 output features
    assert model.layers[0].mlp.down_proj.weight.shape == (8, 12)  # half of the 24 input features
    assert isinstance(model.lm_head, nn.Linear)  # not named by the plan: replicated


def test_model_no_plan_fits_lists_its_linear_layers():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"no tensor-parallel plan fits.*Linear layers found: 0, 2.*tp_plan="):
        detect_plan(model)


def test_a_user_plan_splits_what_it_names():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    found = apply_plan(model, {"0": Colwise(), "2": Rowwise()}, _axis(2, 1))
    assert set(found) == {"0", "2"}
    assert model[0].weight.shape == (4, 4) and model[2].weight.shape == (2, 4)


def test_a_plan_that_names_nothing_is_an_error():
    with pytest.raises(ValueError, match="names no module of this model"):
        apply_plan(nn.Sequential(nn.Linear(4, 4)), {"*.q_proj": Colwise()}, _axis(2))


@pytest.mark.parametrize("model,tp,heads,attr", [
    (lambda: GPT(GPTConfig(n_head=2, n_embd=16)), 4, 2, "n_head"),
    (lambda: LlamaLike(dim=12, heads=6), 4, 6, "num_heads"),
])
def test_heads_that_do_not_divide_by_tp_are_refused(model, tp: int, heads: int, attr: str):
    module = model()
    with pytest.raises(ValueError, match=rf"{heads} attention heads \({attr}\) do not divide by tp = {tp}"):
        apply_plan(module, detect_plan(module), _axis(tp))


def test_sizes_that_do_not_divide_by_tp_are_refused():
    with pytest.raises(ValueError, match="output features per block = 6 does not divide by tp = 4"):
        ColumnParallelLinear.from_linear(nn.Linear(4, 6), _axis(4))
    with pytest.raises(ValueError, match="input features = 6 does not divide by tp = 4"):
        RowParallelLinear.from_linear(nn.Linear(6, 4), _axis(4))


def test_the_split_indexes_a_weight_with_an_index_on_the_weights_own_device(monkeypatch):
    # On a GPU the weights are on the device when tp splits them (the model is moved first, or made there from
    # meta), and CUDA's index_select refuses an index on the CPU: every tp plan failed at set-up on a GPU (found by
    # `stratpack rehearse zero3_tp2 --real --target cuda`, docs/gpu-2026-11-28.md). The CPU accepts it, so here a
    # meta weight stands for the GPU's and the index's device is checked.
    import torch

    from strategies.tensor_parallel.layers import block_rows
    from strategies.tensor_parallel.plans import ParamSplit
    from strategies.tensor_parallel.state import split_like

    seen = []
    original = torch.Tensor.index_select

    def index_select(self, dim, index):
        seen.append((self.device.type, index.device.type))
        return original(self, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", index_select)
    with torch.device("meta"):
        fused = nn.Linear(8, 24)
    layer = ColumnParallelLinear.from_linear(fused, _axis(2, 1), chunks=3)
    split_like(torch.empty(24, 8, device="meta"), ParamSplit(0, (8, 8, 8)), _axis(2, 0))
    assert layer.weight.shape == (12, 8) and seen == [("meta", "meta")] * 2
    assert block_rows((8, 8, 8), _axis(2, 1), "meta").device.type == "meta"


def test_a_ranks_slice_of_the_sequence_holds_only_its_own_bytes():
    """Entering sequence parallel keeps this rank's slice of the sequence in storage of its own, also where the slice
    is contiguous already (one sample): a view would hold the whole input for as long as autograd keeps the slice
    (every microbatch's whole embedding output at 405B under sp and one sample per microbatch: rehearsed rank 0 held
    8 GiB more; planted, ``.contiguous()``'s view: the storage is the whole sequence's, fails). The same for the
    gradient's slices that leaving sp and tp's gather hand back."""
    from types import SimpleNamespace

    import torch

    from strategies.tensor_parallel.layers import _GatherFromTP, _split_dim, enter_sequence_parallel

    axis = SimpleNamespace(size=2, index=1)  # (a rank's place on the tp axis: all the slicing reads)
    x = torch.randn(1, 8, 4, requires_grad=True)
    piece = enter_sequence_parallel(x, axis)
    assert torch.equal(piece, x[:, 4:]) and piece.untyped_storage().nbytes() == piece.numel() * 4
    grad = torch.randn(1, 1, 8)
    assert _split_dim(grad.view(1, 8, 1), axis, 1).untyped_storage().nbytes() == 4 * 4
    assert _GatherFromTP.backward(SimpleNamespace(axis=axis), grad)[0].untyped_storage().nbytes() == 4 * 4
