"""Save by slice (#59, first step: `checkpoint.slices`): ZeRO-3's shards written as they lie, in torch's Distributed
Checkpoint format, read back whole by plain `torch.distributed.checkpoint.load` in one process. The demo GPT at 3
ranks, after an AdamW step: its flats split mid-row (no shard a whole number of rows), so every parameter's part
of a shard is a few boxes; each rank's file holds its shard's bytes, not the model's. FSDP2 at 2 ranks reads it
with plain DCP too, and ZeRO-3 at 2 ranks loads it by slice (`load_by_slice`)."""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from demos.gpt import GPT, GPTConfig
from strategies.checkpoint.slices import boxes, flat_pieces, save_by_slice
from strategies.comm import Axis, CommStats
from strategies.testing import run_ranks
from strategies.zero import shard_model

CONFIG = GPTConfig(vocab_size=101, n_layer=2, n_head=2, n_embd=46, seq_len=8)


def test_a_flat_range_is_boxes_whose_data_is_contiguous_in_it():
    random.seed(0)
    for shape in [(7,), (3, 5), (4, 3, 5), (2, 3, 4, 5), (1, 9), (6, 1)]:
        n, ids = math.prod(shape), torch.arange(math.prod(shape)).view(shape)
        for _ in range(100):
            start = random.randrange(n + 1)
            stop = random.randrange(start, n + 1)
            got = []
            for offsets, sizes, at in boxes(shape, start, stop):
                piece = ids[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1).tolist()
                assert piece == list(range(at, at + len(piece)))  # a slice of the range, in the box's own order
                got += piece
            assert got == list(range(start, stop))
            assert len(boxes(shape, start, stop)) <= 2 * len(shape) - 1


def _save(rank: int, world: int, path: str) -> tuple[dict, int, int]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = shard_model(model, opt, Axis.of_group("dp", dist.group.WORLD, CommStats()), 3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (world * 2, CONFIG.seq_len + 1), generator=g)
    x, y = ids[rank * 2 : rank * 2 + 2, :-1], ids[rank * 2 : rank * 2 + 2, 1:]
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    sync.finish()
    opt.step()
    sync.after_step()
    save_by_slice(sync.flats, path)
    written = os.path.getsize(os.path.join(path, f"__{rank}_0.distcp"))
    pieces = sum(1 for flat in sync.flats for _ in flat_pieces(flat))
    sync.gather_all()  # the whole weights, to compare with (after the save: it gathered nothing)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, written, pieces


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list]:
    """The checkpoint ZeRO-3 at 3 ranks saved by slice, and what each rank returned (its whole weights, the bytes it
    wrote, its boxes)."""
    path = str(tmp_path_factory.mktemp("slices") / "step-1")
    return path, run_ranks(_save, 3, path)


def test_zero3_saves_each_ranks_shard_and_plain_dcp_loads_it_whole(saved):
    path, ranks = saved
    whole = ranks[0][0]
    assert all(torch.equal(whole[k], r[0][k]) for r in ranks for k in whole)  # every rank's gather agrees
    loaded = {k: torch.full_like(v, float("nan")) for k, v in whole.items()}
    dcp.load(loaded, checkpoint_id=path, no_dist=True)  # one process, a plain state dict: DCP reshards
    assert all(torch.equal(loaded[k], whole[k]) for k in whole), [k for k in whole if not torch.equal(loaded[k],
                                                                                                     whole[k])]
    total = sum(v.numel() * v.element_size() for v in whole.values())
    for _, written, pieces in ranks:  # a third of the weights each, and DCP's record of each box (about 1.5 KiB)
        assert total / 3 <= written <= total / 3 + pieces * 2048, (written, total, pieces)


def _load_into_fsdp2(rank: int, world: int, path: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = GPT(CONFIG)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = model.state_dict()  # DTensors, each rank's dim-0 shard
    dcp.load(state, checkpoint_id=path)
    return {k: v.full_tensor() for k, v in state.items()}


def test_fsdp2_at_another_world_size_loads_the_packs_checkpoint(saved):
    """Saved by slice at 3 ranks, read with plain DCP into FSDP2's DTensors at 2: the same weights (DCP reads each
    rank's dim-0 shard from the boxes that overlap it)."""
    path, ranks = saved
    whole = ranks[0][0]
    loaded = run_ranks(_load_into_fsdp2, 2, path)[0]
    assert loaded.keys() == whole.keys() and all(torch.equal(loaded[k], whole[k]) for k in whole)


def _load_into_zero3(rank: int, world: int, path: str) -> dict:
    from strategies.checkpoint.slices import load_by_slice

    torch.manual_seed(1)  # other weights than the saved ones
    model = GPT(CONFIG)
    sync = shard_model(model, torch.optim.AdamW(model.parameters()), Axis.of_group("dp", dist.group.WORLD,
                                                                                   CommStats()), 3)
    load_by_slice(sync.flats, path)
    sync.gather_all()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_zero3_at_another_world_size_loads_by_slice(saved):
    """Saved at 3 ranks, loaded into ZeRO-3 at 2, each rank reading its own boxes: gathered, the saved weights."""
    path, ranks = saved
    whole = ranks[0][0]
    loaded = run_ranks(_load_into_zero3, 2, path)[0]
    assert all(torch.equal(loaded[k], whole[k]) for k in whole)
