"""Resuming mid-epoch: a training DataLoader that Lightning checkpoints with the run, position and random state.

Lightning 2.6 saves a loader's state only when the loader has ``state_dict`` / ``load_state_dict`` (its ``_Stateful``
protocol, as torchdata's StatefulDataLoader has); a plain DataLoader resumed from a checkpoint saved mid-epoch
starts that epoch again from its first batch (with a warning), so the resumed run trains on batches the interrupted
one already used. Lightning saves no random state either: a resumed run draws its dropout masks from the seed again.

``resumable(loader)`` gives the user's DataLoader (same object, same samplers) both:

- position: the batches yielded in the current epoch; on resume the sampler's first that many index lists are
  skipped (indices only: no sample is loaded), after Lightning has set the sampler's epoch, so the resumed epoch
  goes on with the batch the interrupted run would have taken next. With a dp degree changed by resharding the
  global batch is the same set of samples (rank r takes positions r, r+N, ... of one permutation), so skipping k
  per-rank batches skips the same k global batches.
- random state: Python's, NumPy's, torch's CPU and current-device generators, of every rank (gathered into the
  checkpoint), twice: as they were when this epoch's iterator was made (it draws the workers' base seed from the
  global generator) and as they are at the save. A mid-epoch resume replays the iterator's draw from the first and
  then continues from the second; a resume between epochs starts the next iterator from the second, as the
  uninterrupted run did. At the same world size each rank gets its own; after resharding, every rank gets rank 0's
  (a seeded run starts with the same state on every rank).

Not covered (said in README): datasets without a length or iterable-style (they cannot skip by index; Lightning's
warning stays), and random draws a dataset makes in the main process while a batch is prefetched.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

STATE_VERSION = 1


# -- random state as plain Python (bytes, lists): it travels in a sharded checkpoint's metadata and loads with
#    weights_only=True ------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's random state: Python's, NumPy's (if installed), torch's CPU and current CUDA device's."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": bytes(torch.get_rng_state().numpy())}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch's wheels
        np = None
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(gauss))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = bytes(torch.cuda.get_rng_state().numpy())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuples(state["python"]))
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8))


def _as_tuples(value: Any) -> Any:
    """``random.setstate`` wants the tuples back that a round trip through some serialisers turns into lists."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


# -- the loader ------------------------------------------------------------------------------------------------


class _Position:
    """One loader's resume bookkeeping: batches yielded in this epoch, the random state when its iterator was made,
    and what a loaded checkpoint asks of the next iterator."""

    def __init__(self, rank: int, world_size: int, gather: Callable[[Any], list[Any]],
                 epoch_batches: Callable[[], float] | None) -> None:
        self.rank, self.world_size, self.gather, self.epoch_batches = rank, world_size, gather, epoch_batches
        self.count = 0
        # rng_state() just before this epoch's iterator was made, and when it first asked its sampler for indices
        self.at_iter: dict[str, Any] | None = None
        self.at_sampler: dict[str, Any] | None = None
        self.resume: dict[str, Any] | None = None  # the saved states a mid-epoch resume replays (`_Skipping`)
        self.now: dict[str, Any] | None = None  # ... and the one it continues from at its first batch (`_Counted`)
        self.skip = 0  # index lists to drop at the start of the next pass over the sampler
        self.loaded: dict[str, Any] | None = None  # a checkpoint's state, for the next __iter__


def _position(loader: Any) -> _Position:
    """The loader's bookkeeping; a one-process default for a copy Lightning made of it (its DistributedSampler
    injection builds a new loader of the same class)."""
    pos = loader.__dict__.get("_stratpack_position")
    if pos is None:
        pos = loader._stratpack_position = _Position(0, 1, lambda obj: [obj], None)
    return pos


def _state_dict(loader: Any) -> dict[str, Any]:
    # Lightning calls this on every rank while it builds a checkpoint: the gather is a collective of all ranks.
    pos = _position(loader)
    length = pos.epoch_batches() if pos.epoch_batches is not None else len(loader)
    return {"version": STATE_VERSION, "batches": pos.count, "mid_epoch": 0 < pos.count < length,
            "rng": pos.gather({"iter": pos.at_iter, "sampler": pos.at_sampler, "now": rng_state()})}


def _load_state_dict(loader: Any, state: dict[str, Any]) -> None:
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"this loader state has version {state.get('version')}, this pack reads {STATE_VERSION}: "
                         "resume from an epoch-end checkpoint or with the pack that saved it")
    _position(loader).loaded = state


def _iterate(loader: Any, make_iterator: Callable[[], Iterator[Any]]) -> _Counted:
    """``make_iterator()`` (the DataLoader's own ``__iter__``) with the position and random state a loaded
    checkpoint asks for, counting what it yields."""
    pos = _position(loader)
    loaded = pos.loaded
    pos.loaded, pos.count, pos.resume = None, 0, None
    if loaded is not None:
        states = loaded["rng"]
        saved = states[pos.rank] if len(states) == pos.world_size else states[0]
        if loaded["mid_epoch"]:  # replay this epoch's draws from their own starting states (`_Skipping`)
            pos.skip = pos.count = loaded["batches"]
            pos.resume, pos.now = saved, saved["now"]
            set_rng_state(saved["iter"])
        else:  # between epochs: the next epoch starts where the interrupted run stood
            set_rng_state(saved["now"])
    pos.at_iter = rng_state()
    return _Counted(make_iterator(), pos)  # the iterator draws the workers' base seed from the global generator


@functools.cache
def _resumable_class(cls: type) -> type:
    """``cls`` with Lightning's ``_Stateful`` protocol (a subclass without a layout of its own, so that an existing
    loader's ``__class__`` can become it)."""

    class Resumable(cls):  # type: ignore[valid-type, misc]
        state_dict = _state_dict
        load_state_dict = _load_state_dict

        def __iter__(self) -> Iterator[Any]:
            return _iterate(self, super().__iter__)

        @property
        def _index_sampler(self) -> Any:
            return _Skipping(super()._index_sampler, _position(self))

    Resumable.__name__ = Resumable.__qualname__ = f"Resumable{cls.__name__}"
    return Resumable


class _Skipping:
    """The loader's index sampler, dropping the index lists a resumed epoch has already trained on. Lazy: the
    skip happens at the first batch, after Lightning has set the sampler's epoch."""

    def __init__(self, inner: Any, pos: _Position) -> None:
        self.inner, self.pos = inner, pos

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        pos = self.pos
        skip, resume, pos.skip, pos.resume = pos.skip, pos.resume, 0, None
        if resume is not None:
            set_rng_state(resume["sampler"])  # a sampler may draw its permutation from the global generator here
        pos.at_sampler = rng_state()
        it = iter(self.inner)
        for _ in range(skip):
            next(it, None)
        yield from it


class _Counted:
    """The DataLoader's iterator, counting the batches it yields (what a checkpoint saved now has trained on:
    with a known length Lightning fetches each batch just before its step)."""

    def __init__(self, iterator: Any, pos: _Position) -> None:
        self._iterator, self._pos = iterator, pos

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        batch = next(self._iterator)
        self._pos.count += 1
        if self._pos.now is not None:  # a mid-epoch resume's first batch: from here on as at the save
            set_rng_state(self._pos.now)
            self._pos.now = None
        return batch

    def __len__(self) -> int:
        return len(self._iterator)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)


def resumable(loader: Any, *, rank: int = 0, world_size: int = 1, gather: Callable[[Any], list[Any]] | None = None,
              epoch_batches: Callable[[], float] | None = None) -> Any:
    """``loader`` made resumable mid-epoch (see the module's docstring), or returned as it is when it cannot be or
    already is (not a DataLoader, an iterable-style dataset, already ``state_dict``-capable).

    ``gather(obj)``: every rank's ``obj`` in rank order (a collective; default: this process only).
    ``epoch_batches()``: batches in an epoch as the loop counts them (default ``len(loader)``; the Trainer's
    ``num_training_batches`` under ``limit_train_batches``)."""
    if (not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset)
            or callable(getattr(loader, "state_dict", None))):
        return loader
    loader.__class__ = _resumable_class(type(loader))
    loader._stratpack_position = _Position(rank, world_size, gather or (lambda obj: [obj]), epoch_batches)
    return loader
