"""Cutting models into pipeline stages, and microbatches, without processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from demos.gpt import GPT, GPTConfig
from strategies.pipeline.stages import StageDone, StageRunner, find_blocks, partition, plan_stages, split_microbatches


def test_partition_is_contiguous_non_empty_and_balanced():
    assert partition([1] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # The embeddings weigh on stage 0 and the head on the last: they get fewer blocks.
    assert partition([10] * 6, 3, first_extra=10, last_extra=10) == [range(0, 1), range(1, 4), range(4, 6)]  # 20 30 30
    assert partition([5, 1, 1, 1, 1, 5], 2) == [range(0, 3), range(3, 6)]
    # a heavy embedding binds the first stage (7); the rest spread evenly, not one block each and the remainder last
    # (planted, the min-max cut alone: [1, 1, 1, 7])
    assert [len(r) for r in partition([1] * 10, 4, first_extra=6)] == [1, 3, 3, 3]
    for weights, stages in [([3, 1, 4, 1, 5, 9, 2, 6], 3), ([1] * 5, 5), ([7, 1], 1)]:
        ranges = partition(weights, stages)
        assert [i for r in ranges for i in r] == list(range(len(weights)))
        assert all(len(r) >= 1 for r in ranges)


def test_more_stages_than_blocks_is_an_error():
    with pytest.raises(ValueError, match="cannot cut 2 blocks into 4 pipeline stages"):
        plan_stages(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16)), 4)


def test_demo_gpt_layout():
    layout = plan_stages(GPT(GPTConfig(n_layer=4, n_head=2, n_embd=16)), 2)
    assert layout.blocks_name == "blocks"
    assert layout.pre == ["tok_emb.weight", "pos_emb.weight"]
    assert layout.post == ["ln_f.weight", "ln_f.bias", "head.weight", "head.bias"]
    assert layout.describe().splitlines() == ["stage 0: embeddings + blocks[0:2]", "stage 1: blocks[2:4] + head"]


def test_model_without_a_list_of_blocks_is_told_what_to_provide():
    with pytest.raises(ValueError, match=r"no.*pipeline_blocks='model.layers'"):
        find_blocks(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="not an nn.ModuleList/Sequential"):
        find_blocks(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16)), "head")


def test_tied_weights_are_refused():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16))
    model.head.weight = model.tok_emb.weight
    with pytest.raises(ValueError, match="weight tying"):
        plan_stages(model, 2)


def test_stage_runner_runs_one_stage_and_frees_the_others():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, seq_len=8))
    ids = torch.randint(0, 32, (2, 8))
    full_hidden = model.blocks[0](model.tok_emb(ids) + model.pos_emb(torch.arange(8)))
    expected = model(ids)
    layout = plan_stages(model, 2)
    first = StageRunner(model, layout, [0])
    with first.stage(0, None), pytest.raises(StageDone) as done:
        model(ids)
    torch.testing.assert_close(done.value.output, full_hidden)
    assert model.head.weight.untyped_storage().nbytes() == 4  # another stage's: a placeholder
    assert not model.head.weight.requires_grad
    torch.manual_seed(0)
    other = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, seq_len=8))
    last = StageRunner(other, plan_stages(other, 2), [1])
    with last.stage(1, full_hidden.detach()):
        torch.testing.assert_close(other(ids), expected)


def test_a_stages_container_is_built_once_and_again_when_a_block_is_replaced():
    # The swap reuses the container it built for the stage (Python per forward), but never runs a block the model
    # no longer holds: a block replaced after the first step (a wrapper, a compiled copy) is the one that runs.
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, seq_len=8))
    ids = torch.randint(0, 32, (2, 8))
    runner = StageRunner(model, plan_stages(model, 2), [0])
    seen = []
    for _ in range(2):
        with runner.stage(0, None), pytest.raises(StageDone):
            model(ids)
        seen.append(runner._containers[0])
    assert seen[0] is seen[1]
    model.blocks[0] = nn.Sequential(model.blocks[0], nn.Identity())
    with runner.stage(0, None), pytest.raises(StageDone):
        model(ids)
    assert runner._containers[0] is not seen[0] and runner._containers[0][0] is model.blocks[0]


@pytest.mark.parametrize("batch", [torch.arange(12).view(6, 2), (torch.zeros(6, 3), torch.ones(6)),
                                   {"x": torch.zeros(6, 3), "y": [torch.ones(6)]}])
def test_split_microbatches(batch):
    parts = split_microbatches(batch, 3)
    assert len(parts) == 3
    first = parts[0] if isinstance(parts[0], torch.Tensor) else (parts[0][0] if isinstance(parts[0], tuple)
                                                                  else parts[0]["x"])
    assert first.shape[0] == 2


def test_batch_that_does_not_split_names_the_sizes():
    with pytest.raises(ValueError, match="a batch of 6 samples does not split into mb4"):
        split_microbatches((torch.zeros(6, 2), torch.zeros(6)), 4)


def test_a_middle_stage_of_a_chain_runs_its_blocks_alone_as_the_users_code_would():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=16, vocab_size=32, seq_len=8))
    ids, hidden = torch.randint(0, 32, (2, 8)), torch.randn(2, 8, 16)
    runner = StageRunner(model, plan_stages(model, 3), [0, 1, 2], chained=True)
    assert runner.direct_stages() == {1}  # the first and the last stage need the code before and after the blocks
    with runner.stage(1, hidden), pytest.raises(StageDone) as done:
        model(ids)
    torch.testing.assert_close(runner.run_blocks(1, hidden), done.value.output, rtol=0, atol=0)
    handle = model.tok_emb.register_forward_hook(lambda *a: None)  # a hook the user's code would run: not alone
    assert runner.direct_stages() == frozenset()
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: None)
    assert runner.direct_stages() == frozenset()
    handle.remove()
    assert StageRunner(model, plan_stages(model, 3), [1]).direct_stages() == frozenset()  # not traced as a chain


def test_the_last_stage_refuses_blocks_called_with_more_than_the_traced_chain():
    # The trace saw the hidden states alone; a later batch's mask would be left out by the middle stages.
    class Masked(GPT):
        def forward(self, idx):
            x = self.tok_emb(idx)
            for block in self.blocks:
                x = block(x, idx > 0)
            return x

    torch.manual_seed(0)
    model = Masked(GPTConfig(n_layer=3, n_head=2, n_embd=16, vocab_size=32, seq_len=8))
    runner = StageRunner(model, plan_stages(model, 3), [2], chained=True)
    with runner.stage(2, torch.randn(2, 8, 16)), pytest.raises(ValueError, match="called with more than the hidden"):
        model(torch.randint(0, 32, (2, 8)))


def test_two_stages_have_no_middle_so_nothing_is_checked_or_run_alone():
    # With no stage between the first and the last every stage runs the user's code: a mask on some batches is fine.
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, seq_len=8))
    runner = StageRunner(model, plan_stages(model, 2), [0, 1], chained=True)
    assert not runner.chained and runner.direct_stages() == frozenset()
