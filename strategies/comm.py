"""The one place that calls torch.distributed: every collective and p2p message, counted.

Each call records, per (operation, axis), the bytes this rank sent and received and the seconds it spent
blocked. Collectives are counted with the ring cost model (what NCCL's "bus bandwidth" assumes): an
all-reduce of B bytes over N ranks moves 2(N-1)/N * B per rank each way, a reduce-scatter or all-gather of
B bytes in total (N-1)/N * B. Point-to-point messages are counted exactly. Async calls are timed when
waited on, so ``wait_s`` is communication the computation did *not* hide.

A call over an axis of size 1 is a no-op and records nothing, so pieces compose when a degree is 1.

Every call is also logged in this process's `FlightRecorder` (the last few, with kind, axis, per-axis
sequence number and shapes). When a call fails, a timeout or a peer that died, the error becomes a
`CollectiveError` that names the call, lists the recorder's calls and any rank on this host that has
exited, so each rank says where it stopped. With ``STRATPACK_DEBUG_COLLECTIVES=1`` the ranks of an axis
also compare each collective's kind and shapes before running it, and a mismatch (the usual cause of a
hang or of silently wrong sums) raises `CollectiveMismatch` naming every rank's call.
"""

from __future__ import annotations

import enum
import os
import socket
import time
from collections import defaultdict, deque
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


# -- what each rank was doing: the flight recorder ------------------------------------------------------------

DEBUG_ENV = "STRATPACK_DEBUG_COLLECTIVES"


@dataclass
class CallRecord:
    seq: int  # this call's number among the calls on its axis, counted on this rank
    op: str
    axis: str
    shapes: tuple
    dtype: str
    peer: int | None = None  # src / dst on the axis (broadcast, p2p)
    state: str = "running"

    def describe(self) -> str:
        shapes = " ".join(str(tuple(s)) for s in self.shapes)
        peer = f" peer {self.peer}" if self.peer is not None else ""
        return f"#{self.seq} {self.op} on {self.axis}{peer} {shapes} {self.dtype}"


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
        record = CallRecord(self.seq[axis.name], op.value, axis.name, tuple(tuple(t.shape) for t in tensors),
                            str(tensors[0].dtype).removeprefix("torch.") if tensors else "-", peer)
        self.calls.append(record)
        return record

    def register_peers(self, world: Axis) -> None:
        """Learn every rank's host and pid (a collective over ``world``), to name ranks that die later."""
        me = (socket.gethostname(), os.getpid())
        self.peers = all_gather_object(me, world) if world.size > 1 else [me]

    def gone(self) -> list[int]:
        """Ranks on this host whose process has exited."""
        host = socket.gethostname()
        return [rank for rank, (h, pid) in enumerate(self.peers) if h == host and not _alive(pid)]

    def report(self, failed: CallRecord, err: BaseException) -> str:
        rank = dist.get_rank() if dist.is_initialized() else 0
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        lines = [f"[rank {rank}] {failed.describe()} failed: {first}"]
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


def _fail(record: CallRecord, err: BaseException) -> CollectiveError:
    record.state = "failed"
    return CollectiveError(RECORDER.report(record, err))


def _check_same(record: CallRecord, axis: Axis) -> None:
    """Debug mode: every rank of ``axis`` must be issuing the same collective (kind and shapes) as its n-th
    collective on that axis (numbered in the message)."""
    RECORDER.collectives[axis.name] += 1
    mine = (RECORDER.collectives[axis.name], record.op, record.shapes, record.dtype, record.peer)
    theirs: list[Any] = [None] * axis.size
    try:  # directly, not through all_gather_object: the check is not a call of its own in the recorder
        dist.all_gather_object(theirs, mine, group=axis.group)
    except Exception as err:  # noqa: BLE001
        raise _fail(record, err) from err
    if any(t != mine for t in theirs):
        calls = "; ".join(f"rank {axis.ranks[i]}: #{t[0]} {t[1]} {' '.join(map(str, t[2]))} {t[3]}"
                          + (f" peer {t[4]}" if t[4] is not None else "") for i, t in enumerate(theirs))
        record.state = "mismatch"
        raise CollectiveMismatch(f"[rank {dist.get_rank()}] mismatched collectives on axis {axis.name}: {calls}")


class Handle:
    """An in-flight async call; ``wait()`` adds the seconds blocked to the counters."""

    def __init__(self, work: Any, axis: Axis, op: Op, record: CallRecord | None = None) -> None:
        self._work, self._axis, self._op, self._record = work, axis, op, record

    def wait(self) -> None:
        if self._work is None:
            return
        start = time.perf_counter()
        try:
            self._work.wait()
        except Exception as err:  # noqa: BLE001 - gloo / nccl raise RuntimeError subclasses; name the call
            raise _fail(self._record, err) from err
        self._axis.stats.record(self._op, self._axis.name, wait_s=time.perf_counter() - start, calls=0)
        if self._record is not None:
            self._record.state = "done"
        self._work = None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _run(op: Op, axis: Axis, call: Callable[[], Any], sent: float, recv: float, async_op: bool,
         tensors: tuple[torch.Tensor, ...] = (), peer: int | None = None) -> Handle | None:
    """Issue ``call``, count it, log it, and time it now (sync) or at ``wait()`` (async)."""
    axis.stats.record(op, axis.name, sent=sent, recv=recv)
    record = RECORDER.start(op, axis, tensors, peer)
    if op not in (Op.SEND, Op.RECV) and os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        _check_same(record, axis)
    start = time.perf_counter()
    try:
        work = call()
    except Exception as err:  # noqa: BLE001
        raise _fail(record, err) from err
    if not async_op:
        axis.stats.record(op, axis.name, wait_s=time.perf_counter() - start, calls=0)
        record.state = "done"
        return None
    return Handle(work, axis, op, record)


# -- collectives --------------------------------------------------------------------------------------------


def all_reduce(tensor: torch.Tensor, axis: Axis, op: ReduceOp = ReduceOp.SUM, async_op: bool = False):
    """In-place reduction of ``tensor`` over the axis: ring cost 2(N-1)/N * bytes each way."""
    if axis.size == 1:
        return Handle(None, axis, Op.ALL_REDUCE) if async_op else None
    moved = 2 * (axis.size - 1) / axis.size * _nbytes(tensor)
    return _run(
        Op.ALL_REDUCE, axis, lambda: dist.all_reduce(tensor, op=op, group=axis.group, async_op=async_op),
        moved, moved, async_op, (tensor,),
    )


# torch 2.13 renamed the flat-tensor forms (and deprecates the old names); pyproject accepts torch >= 2.6, whose
# CUDA builds users keep, so take whichever this torch has (seen: 2.11 on an H100 has only the old names).
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, axis: Axis, op: ReduceOp = ReduceOp.SUM,
                   async_op: bool = False):
    """``output`` (1/N of ``input``) gets this rank's reduced shard: (N-1)/N * bytes(input) each way."""
    if axis.size == 1:
        output.copy_(input)
        return Handle(None, axis, Op.REDUCE_SCATTER) if async_op else None
    moved = (axis.size - 1) / axis.size * _nbytes(input)
    return _run(
        Op.REDUCE_SCATTER, axis,
        lambda: _REDUCE_SCATTER(output, input, op=op, group=axis.group, async_op=async_op),
        moved, moved, async_op, (output, input),
    )


def all_gather(output: torch.Tensor, input: torch.Tensor, axis: Axis, async_op: bool = False):
    """``output`` (N times ``input``) gets every rank's shard in axis order: (N-1)/N * bytes(output)."""
    if axis.size == 1:
        output.copy_(input)
        return Handle(None, axis, Op.ALL_GATHER) if async_op else None
    moved = (axis.size - 1) / axis.size * _nbytes(output)
    return _run(
        Op.ALL_GATHER, axis,
        lambda: _ALL_GATHER(output, input, group=axis.group, async_op=async_op),
        moved, moved, async_op, (output, input),
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
        sent, recv, async_op, (tensor,), src,
    )


def broadcast_object(obj: Any, axis: Axis, src: int = 0) -> Any:
    """Pickle ``obj`` from axis index ``src`` to every rank (not counted: control messages, not training data)."""
    if axis.size == 1:
        return obj
    box = [obj]
    _guarded("broadcast_object", axis, lambda: dist.broadcast_object_list(box, group=axis.group, group_src=src), src)
    return box[0]


def all_gather_object(obj: Any, axis: Axis) -> list[Any]:
    """Every rank's ``obj`` in axis order (pickled; not counted: control messages)."""
    if axis.size == 1:
        return [obj]
    out: list[Any] = [None] * axis.size
    _guarded("all_gather_object", axis, lambda: dist.all_gather_object(out, obj, group=axis.group))
    return out


def _guarded(name: str, axis: Axis, call: Callable[[], Any], peer: int | None = None) -> None:
    # Object collectives are control messages: logged in the recorder (not counted, not checked in debug mode,
    # which itself runs on them), and named when they fail.
    RECORDER.seq[axis.name] += 1
    record = CallRecord(RECORDER.seq[axis.name], name, axis.name, (), "object", peer)
    RECORDER.calls.append(record)
    try:
        call()
    except Exception as err:  # noqa: BLE001
        raise _fail(record, err) from err
    record.state = "done"


def barrier(axis: Axis) -> None:
    if axis.size > 1:
        _run(Op.BARRIER, axis, lambda: dist.barrier(group=axis.group), 0, 0, False)


# -- point to point -----------------------------------------------------------------------------------------


def send(tensor: torch.Tensor, axis: Axis, dst: int, tag: int = 0) -> None:
    """Blocking send to axis index ``dst``. ``tag`` tells apart messages between the same two ranks."""
    _run(Op.SEND, axis, lambda: dist.send(tensor, group=axis.group, group_dst=dst, tag=tag), _nbytes(tensor), 0,
         False, (tensor,), dst)


def recv(tensor: torch.Tensor, axis: Axis, src: int, tag: int = 0) -> None:
    """Blocking receive from axis index ``src`` into ``tensor``."""
    _run(Op.RECV, axis, lambda: dist.recv(tensor, group=axis.group, group_src=src, tag=tag), 0, _nbytes(tensor),
         False, (tensor,), src)


def isend(tensor: torch.Tensor, axis: Axis, dst: int, tag: int = 0) -> Handle:
    return _run(Op.SEND, axis, lambda: dist.isend(tensor, group=axis.group, group_dst=dst, tag=tag),
                _nbytes(tensor), 0, True, (tensor,), dst)


def irecv(tensor: torch.Tensor, axis: Axis, src: int, tag: int = 0) -> Handle:
    return _run(Op.RECV, axis, lambda: dist.irecv(tensor, group=axis.group, group_src=src, tag=tag), 0,
                _nbytes(tensor), True, (tensor,), src)


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
