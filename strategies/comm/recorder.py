"""What each rank was doing: the flight recorder, and the errors that name a failed collective.

Every call through comm.py is logged here (the last few, with kind, axis, per-axis sequence number and shapes).
When a call fails, a timeout or a peer that died, the error becomes a `CollectiveError` that names the call,
lists the recorder's calls and any rank on this host that has exited, so each rank says where it stopped.
"""

from __future__ import annotations

import os
import socket
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from strategies.comm.stats import Axis, Op

DEBUG_ENV = "STRATPACK_DEBUG_COLLECTIVES"


@dataclass
class CallRecord:
    seq: int  # this call's number among the calls on its axis, counted on this rank
    op: str
    axis: str
    shapes: tuple
    dtype: str | torch.dtype
    peer: int | None = None  # src / dst on the axis (broadcast, p2p)
    state: str = "running"

    def describe(self) -> str:
        shapes = " ".join(str(tuple(s)) for s in self.shapes)
        peer = f" peer {self.peer}" if self.peer is not None else ""
        return f"#{self.seq} {self.op} on {self.axis}{peer} {shapes} {str(self.dtype).removeprefix('torch.')}"


class CollectiveError(RuntimeError):
    """A collective or p2p call that failed (timed out, or a peer is gone), with this rank's recent calls."""


class CollectiveMismatch(CollectiveError):
    """Ranks of one axis issued different collectives at the same sequence number (debug mode)."""


class FlightRecorder:
    """The last ``size`` calls of this process, and the ranks' (host, pid) to tell who has exited."""

    def __init__(self, size: int = 12) -> None:
        self.calls: deque[CallRecord] = deque(maxlen=size)
        self.seq: dict[str, int] = defaultdict(int)
        # Collectives only, per axis: what debug mode compares (ranks of an axis issue the same collectives,
        # but not the same number of p2p messages: a pipeline's middle stage sends more than its ends).
        self.collectives: dict[str, int] = defaultdict(int)
        self.peers: list[tuple[str, int]] = []  # (hostname, pid) by global rank
        self.timeout: Any = None  # the process group's, for the message

    def start(self, op: Op, axis: Axis, tensors: tuple[torch.Tensor, ...], peer: int | None = None) -> CallRecord:
        self.seq[axis.name] += 1
        # shapes and dtype as torch gives them (written out only in `describe`: this runs for every call)
        record = CallRecord(self.seq[axis.name], op.value, axis.name, tuple(t.shape for t in tensors),
                            tensors[0].dtype if tensors else "-", peer)
        self.calls.append(record)
        return record

    @staticmethod
    def identity() -> tuple[str, int]:
        """This process as `peers` lists it: (hostname, pid)."""
        return socket.gethostname(), os.getpid()

    def gone(self) -> list[int]:
        """Ranks on this host whose process has exited."""
        host = socket.gethostname()
        return [rank for rank, (h, pid) in enumerate(self.peers) if h == host and not _alive(pid)]

    def report(self, failed: CallRecord, err: BaseException) -> str:
        rank = dist.get_rank() if dist.is_initialized() else 0
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        lines = [f"[rank {rank}] {failed.describe()} failed: {first}"]
        gone, deadline = self.gone(), time.monotonic() + 1.0
        while not gone and self.peers and time.monotonic() < deadline:  # a peer killed a moment ago closes its
            time.sleep(0.05)  # sockets (our read error) before it is a zombie: give it a moment to show as gone
            gone = self.gone()
        if gone:
            lines.append(f"rank(s) {', '.join(map(str, gone))} on this host have exited (look for their own error "
                         "first: this rank was waiting for them)")
        lines.append(f"last calls on rank {rank}, oldest first:")
        lines += [f"  {c.describe()}  [{c.state}]" for c in self.calls]
        value = self.timeout if self.timeout is not None else "the process group's"
        lines.append(f"collective timeout: {value} (change it with PlanStrategy(timeout=...) or {_TIMEOUT_HINT})")
        return "\n".join(lines)


_TIMEOUT_HINT = "STRATPACK_TIMEOUT=<seconds>"
RECORDER = FlightRecorder()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child that its parent has not reaped yet still answers kill(0): a zombie
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


def nccl_environment(debug: bool) -> dict[str, str]:
    """The NCCL settings that let a hang be diagnosed, set before the process group starts (where the user has
    not set them). On nccl a collective returns to the CPU as soon as it is queued, so a rank that stops
    calling one is seen by the others only in NCCL's watchdog:

    - ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (torch's default, written down here): on a timeout the watchdog ends
      the process, so a stuck rank cannot hold the job;
    - torch's own NCCL flight recorder, dumped on a timeout to ``$TMPDIR/stratpack_nccl_trace_rank_<N>``
      (``python -m torch.distributed.flight_recorder.fr_trace`` reads the ranks' dumps and names the rank
      whose collective is missing);
    - with ``STRATPACK_DEBUG_COLLECTIVES=1``, ``TORCH_NCCL_BLOCKING_WAIT=1`` as well: each collective
      completes on the CPU, so a timeout raises in the call itself and this recorder names it on every
      waiting rank, as on gloo (slow: no overlap; torch then runs no watchdog, so no dump).
    The strategy also turns on `faulthandler`, so a rank the watchdog aborts prints its Python stack.
    """
    import tempfile

    dump = os.path.join(tempfile.gettempdir(), "stratpack_nccl_trace_rank_")
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
           # torch >= 2.7 names them TORCH_FR_*, older releases (which pyproject accepts) TORCH_NCCL_*
           "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
           "TORCH_FR_DUMP_TEMP_FILE": dump, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump}
    if debug:
        env["TORCH_NCCL_BLOCKING_WAIT"] = "1"
    return env


def fail(record: CallRecord, err: BaseException) -> CollectiveError:
    """``err`` as a CollectiveError naming ``record`` and this rank's recent calls."""
    record.state = "failed"
    return CollectiveError(RECORDER.report(record, err))
