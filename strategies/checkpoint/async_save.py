"""Saving without stopping: a sharded save whose files are written while training goes on.

Training waits only while each rank copies its part of the checkpoint to host memory (`sharded.prepare`: pinned
memory on a GPU). From the second save on the copies go into the previous save's buffers: the host keeps 1/world
of the state. A background thread then writes the part, and rank 0 the manifest last and the folder in place, exactly
as a synchronous save does (`sharded.write_prepared`), so a crash during the write leaves the previous checkpoint
whole. One save is in flight at a time: the next waits for it.

The thread's collectives (the folder's name, every rank's result) run over a process group of the save's own, never
the training's. NCCL requires every rank to issue a communicator's calls in one order, and a thread interleaving its
calls with training's on the same group could not keep it (NCCL-NOTES). It is a gloo group over host memory, so it
takes no GPU stream either.

A checkpoint that Lightning removes (ModelCheckpoint's ``save_top_k``) while a save is in flight is removed only
once that save is complete: until then it may be the newest whole one. A save that fails raises, on every rank, at
the next save or when the fit ends (`wait`).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

from strategies import comm
from strategies.checkpoint.dcp_dir import save_dcp, stage
from strategies.checkpoint.sharded import CheckpointError, prepare, refuse_non_checkpoint, write_prepared


class AsyncSaver:
    """One rank's asynchronous saves over ``axis`` (the save's own process group, every rank of the job)."""

    def __init__(self, axis: Any) -> None:
        self.axis = axis
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._path: str | None = None
        self._lock = threading.Lock()
        self._state = "none"  # of the last save: "none", "writing", "written" or "failed"
        self._after: list[Callable[[], None]] = []  # what waits for the save in flight: removals of older ones
        self.writes_s: list[float] = []  # each completed save's time in the background
        self._staging: dict[str, Any] | None = None  # the host copies, kept for the next save (1/world of the state)

    def save(self, checkpoint: dict[str, Any], path: str, *, rank: int, world_size: int,
             info: dict[str, Any] | None = None) -> None:
        """Wait for the save in flight, copy this rank's part out, and start writing it in the background."""
        refuse_non_checkpoint(path)
        self.wait()
        prepared = prepare(checkpoint, rank, world_size, self._staging)
        prepared.skeleton = copy.deepcopy(prepared.skeleton)  # (Lightning's loop state goes on changing)
        self._staging = prepared.mine  # written over by the next save, once this one is written
        axis = self.axis
        self._start(path, lambda: write_prepared(prepared, path, rank=rank, world_size=world_size,
                                                 broadcast=lambda obj: comm.broadcast_object(obj, axis, src=0),
                                                 gather=lambda obj: comm.all_gather_object(obj, axis),
                                                 barrier=lambda: comm.barrier(axis), info=info))

    @property
    def staged(self) -> bool:
        """Whether the host copies of a save by slice are made (`stage_ahead`, or a first save)."""
        return self._staging is not None

    def stage_ahead(self, state: dict[str, Any]) -> None:
        """Make the host copies a save of ``state`` (by slice) fills, now, outside any save's stall."""
        self._staging = stage(state, self._staging)[1]

    def save_by_slice(self, state: dict[str, Any], rest: dict[str, Any], path: str, *, rank: int) -> None:
        """`save`, for a checkpoint by slice (`dcp_dir.save_dcp`): the stall is this rank's copy of what it holds to
        host memory (into the previous save's copies where they fit)."""
        refuse_non_checkpoint(path)
        self.wait()
        staged, self._staging = stage(state, self._staging)
        rest, axis = copy.deepcopy(rest), self.axis
        self._start(path, lambda: save_dcp(staged, rest, path, rank=rank, group=axis.group,
                                           broadcast=lambda obj: comm.broadcast_object(obj, axis, src=0),
                                           barrier=lambda: comm.barrier(axis)))

    def _start(self, path: str, save: Callable[[], None]) -> None:
        """``save()`` in a thread of its own; its outcome kept for `wait`."""

        def write() -> None:
            start, error = time.perf_counter(), None
            try:
                save()
            except BaseException as err:  # noqa: BLE001 - raised in the training thread by `wait`
                error = err
            self._ended(error, time.perf_counter() - start)

        self._path, self._state, self._after = str(path), "writing", []
        self._thread = threading.Thread(target=write, name="stratpack-async-save", daemon=True)
        self._thread.start()

    def _ended(self, error: BaseException | None, seconds: float) -> None:
        with self._lock:
            self._error, self._state = error, "failed" if error is not None else "written"
            after, self._after = ([] if error is not None else self._after), []
        try:
            for then in after:
                then()
        except BaseException as err:  # noqa: BLE001
            self._error = err
        self.writes_s.append(seconds)

    def after_save(self, then: Callable[[], None]) -> None:
        """Run ``then`` once the save in flight is complete (now if none is in flight); never if it failed: what
        it would have replaced is then the newest whole checkpoint."""
        with self._lock:
            if self._state == "writing":
                self._after.append(then)
                return
            if self._state == "failed":
                return
        then()

    def wait(self) -> None:
        """Until the save in flight is written; its failure raised here."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"the asynchronous save of {self._path} failed: {error}") from error


class SaveStalls:
    """How long training waited on each save (``stalls``, seconds): from the start of Lightning's dump of the
    checkpoint (the state gathered into the single-process layout, `PlanStrategy.lightning_module_state_dict`) to
    the end of the barrier after the save: the whole save when synchronous, the gather and the host copy when not."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.stalls: list[float] = []

    def start(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def end(self) -> None:
        if self.started is not None:
            self.stalls.append(time.perf_counter() - self.started)
            self.started = None


def save_axis(timeout: Any) -> Any:
    """The save's own process group (gloo, every rank of the job) as an axis; every rank must call this, in the same
    order relative to its other groups."""
    import torch.distributed as dist

    from strategies.comm.stats import Axis, CommStats

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return Axis.solo("checkpoint")
    return Axis.of_group("checkpoint", dist.new_group(backend="gloo", timeout=timeout), CommStats())
