"""The one place that calls torch.distributed: every collective and p2p message, counted.

Each call records, per (operation, axis), the bytes this rank sent and received and the seconds it spent
blocked. Collectives are counted with the ring cost model (what NCCL's "bus bandwidth" assumes): an
all-reduce of B bytes over N ranks moves 2(N-1)/N * B per rank each way, a reduce-scatter or all-gather of
B bytes in total (N-1)/N * B. Point-to-point messages are counted exactly. Async calls are timed when
waited on, so ``wait_s`` is communication the computation did *not* hide.

A call over an axis of size 1 is a no-op and records nothing, so pieces compose when a degree is 1.
"""

from __future__ import annotations

import enum
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp


class Op(enum.Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    SEND = "send"
    RECV = "recv"
    BARRIER = "barrier"


@dataclass
class CommRecord:
    calls: int = 0
    bytes_sent: float = 0.0
    bytes_recv: float = 0.0
    wait_s: float = 0.0

    def add(self, other: CommRecord) -> None:
        self.calls += other.calls
        self.bytes_sent += other.bytes_sent
        self.bytes_recv += other.bytes_recv
        self.wait_s += other.wait_s


class CommStats:
    """Counters of one process: bytes and blocked seconds by (operation, axis)."""

    def __init__(self) -> None:
        self.records: dict[tuple[Op, str], CommRecord] = defaultdict(CommRecord)

    def record(self, op: Op, axis: str, *, sent: float = 0.0, recv: float = 0.0, wait_s: float = 0.0, calls: int = 1):
        self.records[(op, axis)].add(CommRecord(calls, sent, recv, wait_s))

    def total(self, op: Op | None = None, axis: str | None = None) -> CommRecord:
        """Sum of the records that match ``op`` and ``axis`` (None matches all)."""
        out = CommRecord()
        for (rec_op, rec_axis), rec in self.records.items():
            if (op is None or rec_op is op) and (axis is None or rec_axis == axis):
                out.add(rec)
        return out

    def snapshot(self) -> dict[str, dict[str, float]]:
        """JSON-friendly copy: ``{"all_reduce/dp": {"calls": .., "bytes_sent": .., ...}}``."""
        return {f"{op.value}/{axis}": asdict(rec) for (op, axis), rec in sorted(self.records.items(), key=str)}

    def reset(self) -> None:
        self.records.clear()


@dataclass(frozen=True)
class Axis:
    """One axis of the mesh as seen by this rank: its process group, its members and where counts go."""

    name: str
    group: Any  # dist.ProcessGroup; Any so that tests can build single-rank axes without one
    ranks: tuple[int, ...]  # global ranks, in axis order
    index: int  # this rank's position on the axis
    stats: CommStats = field(default_factory=CommStats, compare=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @classmethod
    def solo(cls, name: str, stats: CommStats | None = None) -> Axis:
        """An axis of one rank: every call over it is a no-op."""
        return cls(name, None, (dist.get_rank() if dist.is_initialized() else 0,), 0, stats or CommStats())

    @classmethod
    def of_group(cls, name: str, group: Any, stats: CommStats) -> Axis:
        ranks = tuple(dist.get_process_group_ranks(group))
        return cls(name, group, ranks, ranks.index(dist.get_rank()), stats)


class Handle:
    """An in-flight async call; ``wait()`` adds the seconds blocked to the counters."""

    def __init__(self, work: Any, axis: Axis, op: Op) -> None:
        self._work, self._axis, self._op = work, axis, op

    def wait(self) -> None:
        if self._work is None:
            return
        start = time.perf_counter()
        self._work.wait()
        self._axis.stats.record(self._op, self._axis.name, wait_s=time.perf_counter() - start, calls=0)
        self._work = None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _run(op: Op, axis: Axis, call: Callable[[], Any], sent: float, recv: float, async_op: bool) -> Handle | None:
    """Issue ``call``, count it, and time it now (sync) or at ``wait()`` (async)."""
    axis.stats.record(op, axis.name, sent=sent, recv=recv)
    if not async_op:
        start = time.perf_counter()
        call()
        axis.stats.record(op, axis.name, wait_s=time.perf_counter() - start, calls=0)
        return None
    return Handle(call(), axis, op)


# -- collectives --------------------------------------------------------------------------------------------


def all_reduce(tensor: torch.Tensor, axis: Axis, op: ReduceOp = ReduceOp.SUM, async_op: bool = False):
    """In-place reduction of ``tensor`` over the axis: ring cost 2(N-1)/N * bytes each way."""
    if axis.size == 1:
        return Handle(None, axis, Op.ALL_REDUCE) if async_op else None
    moved = 2 * (axis.size - 1) / axis.size * _nbytes(tensor)
    return _run(
        Op.ALL_REDUCE, axis, lambda: dist.all_reduce(tensor, op=op, group=axis.group, async_op=async_op),
        moved, moved, async_op,
    )


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, axis: Axis, op: ReduceOp = ReduceOp.SUM,
                   async_op: bool = False):
    """``output`` (1/N of ``input``) gets this rank's reduced shard: (N-1)/N * bytes(input) each way."""
    if axis.size == 1:
        output.copy_(input)
        return Handle(None, axis, Op.REDUCE_SCATTER) if async_op else None
    moved = (axis.size - 1) / axis.size * _nbytes(input)
    return _run(
        Op.REDUCE_SCATTER, axis,
        lambda: dist.reduce_scatter_single(output, input, op=op, group=axis.group, async_op=async_op),
        moved, moved, async_op,
    )


def all_gather(output: torch.Tensor, input: torch.Tensor, axis: Axis, async_op: bool = False):
    """``output`` (N times ``input``) gets every rank's shard in axis order: (N-1)/N * bytes(output)."""
    if axis.size == 1:
        output.copy_(input)
        return Handle(None, axis, Op.ALL_GATHER) if async_op else None
    moved = (axis.size - 1) / axis.size * _nbytes(output)
    return _run(
        Op.ALL_GATHER, axis,
        lambda: dist.all_gather_single(output, input, group=axis.group, async_op=async_op),
        moved, moved, async_op,
    )


def broadcast(tensor: torch.Tensor, axis: Axis, src: int = 0, async_op: bool = False):
    """Copy ``tensor`` from axis index ``src`` to every rank (counted as root sends once, others receive)."""
    if axis.size == 1:
        return Handle(None, axis, Op.BROADCAST) if async_op else None
    size = _nbytes(tensor)
    sent, recv = (size, 0) if axis.index == src else (0, size)
    return _run(
        Op.BROADCAST, axis,
        lambda: dist.broadcast(tensor, group=axis.group, group_src=src, async_op=async_op),
        sent, recv, async_op,
    )


def broadcast_object(obj: Any, axis: Axis, src: int = 0) -> Any:
    """Pickle ``obj`` from axis index ``src`` to every rank (not counted: control messages, not training data)."""
    if axis.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=axis.group, group_src=src)
    return box[0]


def all_gather_object(obj: Any, axis: Axis) -> list[Any]:
    """Every rank's ``obj`` in axis order (pickled; not counted: control messages)."""
    if axis.size == 1:
        return [obj]
    out: list[Any] = [None] * axis.size
    dist.all_gather_object(out, obj, group=axis.group)
    return out


def barrier(axis: Axis) -> None:
    if axis.size > 1:
        _run(Op.BARRIER, axis, lambda: dist.barrier(group=axis.group), 0, 0, False)


# -- point to point -----------------------------------------------------------------------------------------


def send(tensor: torch.Tensor, axis: Axis, dst: int, tag: int = 0) -> None:
    """Blocking send to axis index ``dst``. ``tag`` tells apart messages between the same two ranks."""
    _run(Op.SEND, axis, lambda: dist.send(tensor, group=axis.group, group_dst=dst, tag=tag), _nbytes(tensor), 0,
         False)


def recv(tensor: torch.Tensor, axis: Axis, src: int, tag: int = 0) -> None:
    """Blocking receive from axis index ``src`` into ``tensor``."""
    _run(Op.RECV, axis, lambda: dist.recv(tensor, group=axis.group, group_src=src, tag=tag), 0, _nbytes(tensor),
         False)


def isend(tensor: torch.Tensor, axis: Axis, dst: int, tag: int = 0) -> Handle:
    return _run(Op.SEND, axis, lambda: dist.isend(tensor, group=axis.group, group_dst=dst, tag=tag),
                _nbytes(tensor), 0, True)


def irecv(tensor: torch.Tensor, axis: Axis, src: int, tag: int = 0) -> Handle:
    return _run(Op.RECV, axis, lambda: dist.irecv(tensor, group=axis.group, group_src=src, tag=tag), 0,
                _nbytes(tensor), True)


def ring_all_reduce(tensor: torch.Tensor, axis: Axis) -> None:
    """Sum ``tensor`` (contiguous) over the axis with an explicit ring of p2p messages, in place.

    The flat tensor is cut into N chunks. Reduce-scatter: in step s (0..N-2) rank r sends chunk (r - s) to
    its right neighbour and adds the chunk (r - s - 1) it receives from its left one; afterwards rank r holds
    the full sum of chunk (r + 1). All-gather: in step s rank r passes on chunk (r + 1 - s) and stores chunk
    (r - s). 2(N-1) steps, each moving ~1/N of the tensor: 2(N-1)/N * bytes per rank, the same as the model
    that `all_reduce` is counted with.
    """
    n, r = axis.size, axis.index
    if n == 1:
        return
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce works in place on a contiguous tensor")
    chunks = torch.tensor_split(tensor.view(-1), n)
    right, left = (r + 1) % n, (r - 1) % n
    scratch = torch.empty_like(chunks[0])
    for step in range(n - 1):
        out_chunk, in_chunk = chunks[(r - step) % n], chunks[(r - step - 1) % n]
        incoming = scratch[: in_chunk.numel()]
        _exchange(out_chunk, incoming, axis, right, left)
        in_chunk.add_(incoming)
    for step in range(n - 1):
        _exchange(chunks[(r + 1 - step) % n], chunks[(r - step) % n], axis, right, left)


def _exchange(out: torch.Tensor, into: torch.Tensor, axis: Axis, right: int, left: int) -> None:
    # Post the receive before the send so neither neighbour can block the other.
    pending = [irecv(into, axis, left), isend(out.contiguous(), axis, right)]
    for handle in pending:
        handle.wait()
