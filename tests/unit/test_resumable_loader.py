"""The resumable loader on its own (`strategies.lightning.resume`): a loader restored from a state taken mid-epoch
yields the rest of that epoch and then the next, with the random draws of the uninterrupted loop; one taken at an
epoch's end starts the next epoch as the uninterrupted loop did. Through the Trainer: tests/e2e/test_resume.py and
test_reshard.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from strategies.lightning.resume import resumable


def _loader(workers: int = 0) -> DataLoader:
    # RandomSampler without a generator draws its permutation from the global one when an epoch's first batch is asked
    # for; the iterator draws the workers' base seed when it is made: both draws must be replayed.
    return resumable(DataLoader(torch.arange(24), batch_size=4, shuffle=True, num_workers=workers))


def _take(iterator, n: int) -> list:
    return [(next(iterator).tolist(), torch.rand(()).item()) for _ in range(n)]  # a batch and a step's draw


@pytest.mark.parametrize("done,workers", [(2, 0), (6, 0), (4, 2)])  # mid-epoch, at its end; worker processes
def test_restored_loader_continues_with_the_batches_and_draws_of_the_uninterrupted_loop(done: int, workers: int):
    torch.manual_seed(0)
    loader = _loader(workers)
    iterator = iter(loader)
    torch.rand(())  # a hook between the iterator and its first batch (Lightning's on_train_epoch_start)
    _take(iterator, done)
    state = loader.state_dict()
    assert state["batches"] == done and state["mid_epoch"] == (done < 6)
    straight = _take(iterator, 6 - done) + _take(iter(loader), 3)

    torch.manual_seed(123)  # a new process: seeded again, then restored
    restored = _loader(workers)
    restored.load_state_dict(state)
    iterator, rest = iter(restored), []
    if done < 6:  # (at an epoch's end the restored iterator is the next epoch's)
        torch.rand(3)  # a resumed loop runs other hooks: the sampler's draw must not depend on them
        rest = _take(iterator, 6 - done)
        iterator = iter(restored)
    resumed = rest + _take(iterator, 3)
    assert resumed == straight
    assert restored.state_dict()["batches"] == 3


def test_every_rank_gets_its_own_state_at_the_same_world_size_and_rank_0s_after_resharding():
    saved = []
    for rank in range(2):  # two ranks' states, as the gather of a two-rank run puts them together
        torch.manual_seed(rank)
        loader = resumable(DataLoader(torch.arange(8), batch_size=2))
        next(iter(loader))
        saved.append(loader.state_dict())
    state = {**saved[1], "rng": saved[0]["rng"] + saved[1]["rng"]}
    draws = []
    for world in (2, 4):  # restored on rank 1 of two ranks, then of four
        loader = resumable(DataLoader(torch.arange(8), batch_size=2), rank=1, world_size=world)
        loader.load_state_dict(state)
        next(iter(loader))
        draws.append(torch.rand(()).item())
    expected = []
    for rank in (1, 0):
        torch.set_rng_state(torch.frombuffer(bytearray(saved[rank]["rng"][0]["now"]["torch"]), dtype=torch.uint8))
        expected.append(torch.rand(()).item())
    assert draws == expected and expected[0] != expected[1]


def test_what_cannot_skip_by_index_is_left_as_it_is_and_a_foreign_state_is_refused():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    plain = [1, 2, 3]
    stream = DataLoader(Stream())
    assert resumable(plain) is plain and type(resumable(stream)) is DataLoader
    with pytest.raises(ValueError, match="loader state has version"):
        _loader().load_state_dict({"version": 99})
