"""What comm.py counts: bytes and blocked seconds per (operation, mesh axis), and the axes themselves.

Collectives are counted with the ring cost model (what NCCL's "bus bandwidth" assumes): an all-reduce of B bytes
over N ranks moves 2(N-1)/N * B per rank each way, a reduce-scatter or all-gather of B bytes in total
(N-1)/N * B. Point-to-point messages are counted exactly.
"""

from __future__ import annotations

import contextlib
import enum
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch.distributed as dist


class Op(enum.Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"
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
        self.counting = True  # False inside `uncounted`

    def record(self, op: Op, axis: str, *, sent: float = 0.0, recv: float = 0.0, wait_s: float = 0.0, calls: int = 1):
        record = self.records[(op, axis)]  # in place: this runs for every call and message
        record.calls += calls
        record.bytes_sent += sent
        record.bytes_recv += recv
        record.wait_s += wait_s

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

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Leave out the traffic of what runs inside: set-up work done during a step (the pipeline's traced
        forward on the first batch), which is not a training step's."""
        saved = {key: replace(record) for key, record in self.records.items()}
        self.counting = False
        try:
            yield
        finally:
            self.records = defaultdict(CommRecord, saved)
            self.counting = True


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
