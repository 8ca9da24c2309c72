"""Every place the pack wraps or replaces a user's code or objects (docs/safety.md, "What the pack wraps or replaces
in your code"), each with a user's variation it must honour or refuse clearly. The places tested elsewhere are named
there; these are the ones that had no such case."""

from __future__ import annotations

import types

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader

from strategies.activation_checkpoint import apply_activation_checkpointing, remove_activation_checkpointing
from strategies.lightning.resume import resumable
from strategies.pipeline.stages import _StageBlocks
from strategies.tensor_parallel import Colwise, Rowwise
from strategies.tensor_parallel.heads import prove_forwards
from strategies.tensor_parallel.plans import matches

# -- tensor parallel: head counts and the config made local ----------------------------------------------------

PLAN = {"*.attn.qkv": Colwise(chunks=3), "*.attn.out": Rowwise()}


class Attention(nn.Module):
    """Heads counted from ``self.config`` (made local: its own copy), or from an attribute the pack does not know."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.qkv, self.out, self.source = nn.Linear(16, 48), nn.Linear(16, 16), source
        self.config = types.SimpleNamespace(num_attention_heads=4, hidden_size=16)
        self.heads = 4

    def forward(self, x):
        B, T, _ = x.shape
        heads = self.config.num_attention_heads if self.source == "config" else self.heads
        q, k, v = (t.view(B, T, heads, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.out(y.reshape(B, T, self.config.hidden_size if self.source == "width" else -1))


def _model(source: str) -> nn.Module:
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Module()])
    model.blocks[0].attn = Attention(source)
    return model


def test_heads_read_from_the_config_run_the_users_forward_with_a_local_copy():
    model = _model("config")
    assert prove_forwards(model, matches(PLAN, model), 2) == set()
    assert model.blocks[0].attn.config.num_attention_heads == 4  # the proof worked on copies


@pytest.mark.parametrize("source", ["attribute", "width"])
def test_a_count_or_width_the_pack_does_not_make_local_is_refused_naming_the_module(source: str):
    model = _model(source)  # self.heads, config.hidden_size: neither is divided by tp
    with pytest.raises(ValueError, match=r"blocks\.0\.attn \(Attention\) computes something else on a rank's slice"):
        prove_forwards(model, matches(PLAN, model), 2)


# -- activation checkpointing's wrapper ------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.3)

    def forward(self, x, scale=1.0):  # a keyword argument and a tuple out, dropout inside
        return self.drop(torch.tanh(self.fc(x))) * scale, x.sum()


def _grads(blocks: nn.ModuleList) -> list[torch.Tensor]:
    torch.manual_seed(3)
    x = torch.randn(4, 8)
    for block in blocks:
        x, _ = block(x, scale=0.5)
    x.sum().backward()
    grads = [p.grad.clone() for p in blocks.parameters()]
    blocks.zero_grad()
    return grads


def test_checkpointing_honours_keywords_tuples_and_dropout():
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(2))
    plain = _grads(blocks)
    wrapped = apply_activation_checkpointing(blocks)  # the recomputation draws the same dropout masks
    for a, b in zip(plain, _grads(blocks), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    remove_activation_checkpointing(wrapped)
    assert all("forward" not in vars(b) for b in blocks)


def test_checkpointing_refuses_a_block_whose_forward_is_set_on_the_instance():
    blocks = nn.ModuleList([Block()])
    blocks[0].forward = torch.compile(blocks[0].forward)
    with pytest.raises(ValueError, match="has a forward set on the instance .* compile the whole model"):
        apply_activation_checkpointing(blocks)


# -- the pipeline's stage container ----------------------------------------------------------------------------


def test_a_forward_that_indexes_blocks_by_its_own_count_is_told_why():
    held = _StageBlocks([nn.Linear(2, 2), nn.Linear(2, 2)], "transformer.h", range(2, 4))
    assert isinstance(held[1], nn.Linear) and len(held) == 2  # by the list: the stage's own blocks
    with pytest.raises(IndexError, match=r"holds transformer\.h\[2:4\] only, .* asked for transformer\.h\[2\].*"
                                         r"'for block in self\.h'"):
        held[2]


# -- the resumable loader's class swap --------------------------------------------------------------------------


class DoublingLoader(DataLoader):
    """A user's DataLoader subclass with its own __iter__ and an attribute."""

    tag = "mine"

    def __iter__(self):
        return (batch * 2 for batch in super().__iter__())


def test_the_resumable_loader_keeps_a_users_loader_subclass_its_iteration_and_attributes():
    loader = resumable(DoublingLoader(torch.arange(8), batch_size=4))
    assert isinstance(loader, DoublingLoader) and loader.tag == "mine"
    assert [b.tolist() for b in loader] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert callable(loader.state_dict)


# -- the registry's class swap ----------------------------------------------------------------------------------


def test_a_strategy_the_user_registers_after_import_strategies_still_resolves(tmp_path):
    import strategies  # noqa: F401  (swaps the registry's class)

    StrategyRegistry.register("my_ddp_test", DDPStrategy, description="a user's", override=True,
                              find_unused_parameters=True)
    try:
        trainer = L.Trainer(strategy="my_ddp_test", accelerator="cpu", devices=2, logger=False,
                            default_root_dir=tmp_path)
        assert type(trainer.strategy) is DDPStrategy and trainer.strategy._ddp_kwargs["find_unused_parameters"]
    finally:
        StrategyRegistry.remove("my_ddp_test")
