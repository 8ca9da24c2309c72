"""Save by slice (#59, first step: `checkpoint.slices`): ZeRO-3's shards written as they lie, in torch's Distributed
Checkpoint format, read back whole by plain `torch.distributed.checkpoint.load` in one process. The demo GPT at 3
ranks, after an AdamW step: its flats split mid-row (no shard a whole number of rows), so every parameter's part
of a shard is a few boxes; each rank's file holds its shard's bytes, not the model's. FSDP2 at 2 ranks reads it
with plain DCP too, and ZeRO-3 at 2 ranks loads it by slice (`load_by_slice`), weights and AdamW's state."""

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
TP_CONFIG = GPTConfig(vocab_size=100, n_layer=2, n_head=2, n_embd=44, seq_len=8)  # (tp2 splits the heads, the vocab)


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


def _batch(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, CONFIG.vocab_size, (6, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(1))
    return ids[rows, :-1], ids[rows, 1:]


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, rows: slice, sync=None) -> None:
    x, y = _batch(rows)
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    if sync is not None:
        sync.finish()
    opt.step()
    if sync is not None:
        sync.after_step()


def _zero3(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, shard_model(model, opt, Axis.of_group("dp", dist.group.WORLD, CommStats()), 3)


def _save(rank: int, world: int, path: str) -> tuple[dict, int, int]:
    model, opt, sync = _zero3(0)
    _step(model, opt, slice(rank * 2, rank * 2 + 2), sync)  # the six rows over three ranks
    save_by_slice(sync.flats, path, optimizer=opt)
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
    dcp.load({"model": loaded}, checkpoint_id=path, no_dist=True)  # one process, a plain state dict: DCP reshards
    assert all(torch.equal(loaded[k], whole[k]) for k in whole), [k for k in whole if not torch.equal(loaded[k],
                                                                                                     whole[k])]
    total = sum(v.numel() * v.element_size() for v in whole.values())
    for _, written, pieces in ranks:  # a third of the weights and of AdamW's two moments each (3 x 1/3), DCP's
        # record of each box (about 1.5 KiB) and of AdamW's steps (one a parameter: rank 0 writes the replicated)
        assert total <= written <= total + 3 * pieces * 2048 + 32 * 1536, (written, total, pieces)


def _load_into_fsdp2(rank: int, world: int, path: str, config: GPTConfig = CONFIG) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = GPT(config)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = model.state_dict()  # DTensors, each rank's dim-0 shard
    dcp.load({"model": state}, checkpoint_id=path)
    return {k: v.full_tensor() for k, v in state.items()}


def test_fsdp2_at_another_world_size_loads_the_packs_checkpoint(saved):
    """Saved by slice at 3 ranks, read with plain DCP into FSDP2's DTensors at 2: the same weights (DCP reads each
    rank's dim-0 shard from the boxes that overlap it)."""
    path, ranks = saved
    whole = ranks[0][0]
    loaded = run_ranks(_load_into_fsdp2, 2, path)[0]
    assert loaded.keys() == whole.keys() and all(torch.equal(loaded[k], whole[k]) for k in whole)


def _load_into_zero3(rank: int, world: int, path: str, again: str) -> dict:
    from strategies.checkpoint.slices import load_by_slice

    model, opt, sync = _zero3(1)  # other weights than the saved ones
    _step(model, opt, slice(rank, rank + 1), sync)  # (the optimizer's state exists after a step)
    load_by_slice(sync.flats, path, optimizer=opt)
    save_by_slice(sync.flats, again, optimizer=opt)  # what it holds now, to read whole in one process
    sync.gather_all()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _whole_optimizer_state(path: str, like: dict) -> dict:
    state = {k: {m: torch.full_like(v, float("nan")) for m in ("exp_avg", "exp_avg_sq")} | {"step": torch.tensor(0.0)}
             for k, v in like.items()}
    dcp.load({"optim": {"state": state}}, checkpoint_id=path, no_dist=True)
    return state


def test_zero3_at_another_world_size_loads_weights_and_adamw_by_slice(saved, tmp_path):
    """Saved at 3 ranks, loaded into ZeRO-3 at 2, each rank reading its own boxes: gathered, the saved weights; its
    AdamW moments, saved again at 2 and read whole, the saved ones, which are one process's after the same step."""
    path, ranks = saved
    whole = ranks[0][0]
    again = str(tmp_path / "again")
    loaded = run_ranks(_load_into_zero3, 2, path, again)[0]
    assert all(torch.equal(loaded[k], whole[k]) for k in whole)
    first, second = _whole_optimizer_state(path, whole), _whole_optimizer_state(again, whole)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, slice(0, 6))
    for name, param in model.named_parameters():
        assert all(torch.equal(first[name][m], second[name][m]) for m in first[name]), name
        assert first[name]["step"].item() == 1.0
        for m in ("exp_avg", "exp_avg_sq"):
            # (the order of the sums: the gradient a mean of the ranks' means; a box misplaced moves it by its size)
            torch.testing.assert_close(first[name][m], opt.state[param][m], rtol=1e-3, atol=1e-8)


def test_an_optimizer_before_its_first_step_is_refused_saying_why():
    from types import SimpleNamespace

    from strategies.checkpoint.slices import sharded_optimizer_state

    flat = SimpleNamespace(master=torch.nn.Parameter(torch.zeros(3)), names=["w"])
    with pytest.raises(ValueError, match="no state for these shards yet"):
        sharded_optimizer_state([flat], torch.optim.AdamW([flat.master]))


def test_a_tensor_parallel_slices_boxes_land_where_the_slice_lies_in_the_whole_tensor():
    """A fused weight of three blocks (q, k, v) cut along rows or columns over 2 or 3 ranks: random ranges of a
    rank's slice, boxed and placed (`split_boxes`), each hold the whole tensor's values at their offsets."""
    from strategies.checkpoint.slices import split_boxes
    from strategies.tensor_parallel.layers import block_rows

    random.seed(1)
    for dim, blocks, other, size in [(0, (6, 6, 6), 5, 2), (1, (6, 3, 3), 4, 3), (0, (8,), 3, 2)]:
        shape = [other, other]
        shape[dim] = sum(blocks)
        whole = torch.arange(math.prod(shape)).view(shape)
        for index in range(size):
            rows = block_rows(blocks, Axis("tp", None, list(range(size)), index))
            local = whole.index_select(dim, rows)
            for _ in range(30):
                start = random.randrange(local.numel())
                stop = random.randrange(start + 1, local.numel() + 1)
                pieces = [(o, s, local[tuple(slice(a, a + b) for a, b in zip(o, s))])
                          for o, s, _ in boxes(tuple(local.shape), start, stop)]
                placed = split_boxes(pieces, dim, blocks, index, size)
                assert sum(d.numel() for _, _, d in placed) == stop - start
                for offsets, sizes, data in placed:
                    assert torch.equal(data, whole[tuple(slice(a, a + b) for a, b in zip(offsets, sizes))])


def _zero3_tp2(rank: int, world: int, path: str) -> dict:
    """The demo GPT under `zero3_tp2` at 4 ranks (dp2 x tp2), an AdamW step, saved by slice: each rank writes its
    ZeRO shard's boxes of its tp slices, placed in the whole tensors; returns the whole state the strategy's gather
    makes (to compare with), and this rank's bytes written."""
    from strategies.checkpoint.slices import TensorSlices
    from strategies.lightning.assemble import gradient_sync, model_techniques
    from strategies.lightning.options import PlanOptions
    from strategies.mesh import ParallelMesh
    from strategies.plan import ParallelPlan

    config = TP_CONFIG
    torch.manual_seed(0)
    model = GPT(config)
    plan = ParallelPlan.parse("zero3_tp2").resolve(world)
    mesh = ParallelMesh(plan, "cpu")
    techniques = model_techniques(model, plan, mesh, PlanOptions())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = gradient_sync(model, [opt], plan, mesh, PlanOptions(), False)
    ids = torch.randint(0, config.vocab_size, (4, config.seq_len + 1), generator=torch.Generator().manual_seed(1))
    rows = slice(mesh.data.index * 2, mesh.data.index * 2 + 2)
    x, y = ids[rows, :-1], ids[rows, 1:]
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    sync.finish()
    opt.step()
    sync.after_step()
    tp = next(t for t in techniques if hasattr(t, "splits"))
    save_by_slice(sync.flats, path, optimizer=opt, tp=TensorSlices(tp.splits, mesh.tp.index, mesh.tp.size))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for technique in reversed([*techniques, sync]):
        state = technique.full_model_state(state)
    return {k: v.clone() for k, v in state.items()}, os.path.getsize(os.path.join(path, f"__{rank}_0.distcp"))


def test_zero3_tp2_saves_its_shards_of_tp_slices_and_plain_dcp_loads_them_whole(tmp_path):
    """#59's acceptance: saved by the pack under `zero3_tp2` at 4 ranks, read whole in one process and into FSDP2 at
    2 ranks with plain DCP: the strategy's gathered weights exactly; each rank wrote about a quarter of the weights
    and moments (a tp slice's dp shard), not the model."""
    path = str(tmp_path / "step-1")
    ranks = run_ranks(_zero3_tp2, 4, path)
    whole = ranks[0][0]
    loaded = {k: torch.full_like(v, float("nan")) for k, v in whole.items()}
    dcp.load({"model": loaded}, checkpoint_id=path, no_dist=True)
    assert all(torch.equal(loaded[k], whole[k]) for k in whole), [k for k in whole if not torch.equal(loaded[k],
                                                                                                     whole[k])]
    fsdp2 = run_ranks(_load_into_fsdp2, 2, path, TP_CONFIG)[0]
    assert all(torch.equal(fsdp2[k], whole[k]) for k in whole)
    total = sum(v.numel() * v.element_size() for v in whole.values())
    assert all(written < 0.5 * 3 * total for _, written in ranks), ([w for _, w in ranks], total)



def test_each_box_several_ranks_hold_alike_is_written_by_one_of_them_and_the_rest_by_their_own():
    """`share_replicas`: three ranks hold a replicated weight and bias whole (dp's) and each its own shard of another
    (ZeRO's): each replicated box kept by exactly one of its holders, the largest first to the least loaded (the
    weight to rank 0, the bias to rank 1), every shard by its own rank; all ranks assign alike from the same lists."""
    from strategies.checkpoint.slices import Boxed, share_replicas

    def state(rank: int) -> dict:
        weight, bias, flat = torch.zeros(4, 4), torch.zeros(4), torch.zeros(3)
        return {"state_dict": {"w": Boxed((4, 4), [((0, 0), (4, 4), weight)]), "b": Boxed((4,), [((0,), (4,), bias)]),
                               "z": Boxed((9,), [((3 * rank,), (3,), flat)])}}

    everyone = []  # what each rank gives the gather: every box's name, offsets, sizes and bytes
    for r in range(3):
        share_replicas(state(r), r, lambda obj: everyone.append(obj) or [obj])
    assert sorted(key[0] for key, _ in everyone[0]) == ["state_dict.b", "state_dict.w", "state_dict.z"]
    kept = [share_replicas(state(r), r, lambda obj: everyone)["state_dict"] for r in range(3)]
    assert [len(k["w"].pieces) for k in kept] == [1, 0, 0] and [len(k["b"].pieces) for k in kept] == [0, 1, 0]
    assert [k["z"].pieces[0][0] for k in kept] == [(0,), (3,), (6,)]
