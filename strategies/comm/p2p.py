"""Point-to-point messages, sent the way NCCL matches them: in issue order per pair of ranks, never by tag.

NCCL has no tags (torch accepts ``tag=`` and ignores it on nccl): between two ranks of one communicator the k-th
send from A is received by B's k-th receive from A, and a rank's operations run one after the other in issue
order. So every message here goes with tag 0 (gloo then matches a pair's messages in issue order too, as NCCL
does), and every call is a *group*: the sends and receives a rank issues together go out as one
``batch_isend_irecv`` (``ncclGroupStart/End`` on nccl), so that a rank may send and receive with its peers in
one step without either side waiting on the other (NVIDIA/nccl#479). The caller is responsible for issuing
each pair's messages in the same order on both sides; `pipeline.messages.check` proves it for the pipeline.

Strict mode (``STRATPACK_STRICT_P2P=1``, or a number of seconds), for tests on CPU: the layer makes gloo follow
NCCL's rules and fails the moment a program breaks them.
- In order per rank: a group starts only once this rank's previous groups on the axis have completed, as on
  NCCL's stream; a rank that waits longer than the limit (30 s unless given) raises `P2POrderError` listing
  what it waits on (under NCCL that order would hang).
- Matched to the right buffer: each message carries its label (what the program calls it, e.g. ``a3.1``: the
  activation of stage 3, microbatch 1) and the receiver compares it with the label it expected, so a receive
  matched to another message raises `P2POrderError` instead of silently swapping tensors.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from strategies.comm.ops import rehearsing
from strategies.comm.recorder import RECORDER, CallRecord, CollectiveError, fail
from strategies.comm.stats import Axis, Op

STRICT_ENV = "STRATPACK_STRICT_P2P"
_LABEL_BYTES = 32


class P2POrderError(CollectiveError):
    """Strict mode: a receive was matched to another message, or a rank's in-order p2p calls cannot progress."""


@dataclass(frozen=True)
class P2P:
    """One message of a group: send ``tensor`` to (or receive into it from) axis index ``peer``. ``label`` names
    the message (for strict mode and errors); it never decides which receive gets it."""

    send: bool
    tensor: torch.Tensor
    peer: int
    label: str = ""


def strict_seconds() -> float | None:
    """Strict mode's wait limit in seconds, or None when it is off."""
    value = os.environ.get(STRICT_ENV, "").strip()
    if value in ("", "0"):
        return None
    return 30.0 if value == "1" else float(value)


class GroupHandle:
    """A group in flight; ``wait()`` completes every message of it (and, in strict mode, checks the labels)."""

    def __init__(self, works: list, records: list[CallRecord], checks: list[tuple[P2P, torch.Tensor]],
                 axis: Axis, kind: Op, limit: float | None = None) -> None:
        self._works, self._records, self._checks, self._axis, self._kind = works, records, checks, axis, kind
        self._limit = limit  # strict mode's, as it was when the group was issued

    def done(self) -> bool:
        """Whether every message of the group has completed (without waiting; `wait` still checks strict mode's
        labels)."""
        return all(work.is_completed() for work in self._works)

    def wait(self) -> None:
        if self._works:
            limit = self._limit
            start = time.perf_counter()
            try:
                for work in self._works:  # one deadline for the whole group
                    left = None if limit is None else max(limit - (time.perf_counter() - start), 0.001)
                    work.wait() if left is None else work.wait(datetime.timedelta(seconds=left))
            except Exception as err:  # noqa: BLE001 - a timeout, a peer gone: name the messages
                self._works = []  # failed: a later wait (teardown) must not wait again
                if limit is None:
                    raise fail(self._records[0], err) from err
                self._records[0].state = "failed"
                raise P2POrderError(
                    f"strict p2p mode: no progress in {limit:g} s. NCCL runs a rank's p2p calls in the order they are "
                    "issued, so under it this order would hang\n" + RECORDER.report(self._records[0], err)) from err
            self._axis.stats.record(self._kind, self._axis.name, wait_s=time.perf_counter() - start, calls=0)
            for record in self._records:
                record.state = "done"
            self._works = []
        checks, self._checks = self._checks, []
        for op, box in checks:
            got = bytes(box.tolist()).rstrip(b"\0").decode()
            if got != op.label:
                raise P2POrderError(
                    f"[rank {dist.get_rank()}] p2p on axis {self._axis.name}: the receive of {op.label!r} from "
                    f"axis rank {op.peer} got {got!r}. NCCL matches a pair's messages in the order they are "
                    "issued (it has no tags), so both sides must issue them in the same order")


_outstanding: dict[str, list[GroupHandle]] = {}  # strict mode: per axis, this rank's groups not yet completed


def exchange(ops: list[P2P], axis: Axis) -> GroupHandle:
    """Issue ``ops`` as one group on ``axis`` (one ``batch_isend_irecv``); wait on the handle before reading a
    received tensor or changing a sent one. Each message is counted (send, recv) and logged like every call."""
    if ops and axis.size > 1 and rehearsing():  # counted, not sent: a real receive reads zeros (finite), meta shapes
        for op in ops:
            if not op.send and op.tensor.device.type != "meta":
                op.tensor.zero_()
        return GroupHandle([], _count(ops, axis), [], axis, Op.RECV if any(not op.send for op in ops) else Op.SEND)
    limit = strict_seconds()
    strict = limit is not None
    if strict:  # in order per rank, as NCCL's stream runs them
        for earlier in _outstanding.pop(axis.name, []):
            earlier.wait()
    if axis.size == 1 or not ops:
        return GroupHandle([], [], [], axis, Op.RECV)
    checks: list[tuple[P2P, torch.Tensor]] = []
    wire: list[P2P] = []
    for op in ops:
        if strict:  # the label travels just before its message, in the same group
            box = _label_tensor(op.label if op.send else "", op.tensor.device)
            wire.append(P2P(op.send, box, op.peer))
            if not op.send:
                checks.append((op, box))
        wire.append(op)
    records = _count(ops, axis)
    try:
        works = _issue(wire, axis)
    except Exception as err:  # noqa: BLE001
        raise fail(records[0], err) from err
    group = GroupHandle(list(works or []), records, checks, axis,
                        Op.RECV if any(not op.send for op in ops) else Op.SEND, limit)
    if strict:
        _outstanding.setdefault(axis.name, []).append(group)
    return group


def _count(ops: list[P2P], axis: Axis) -> list[CallRecord]:
    """Count the group's messages (one record per direction: a pipeline issues a few dozen groups a step, and
    each counter update is Python on the step's critical path) and log each in the flight recorder."""
    sent = [op.tensor.nbytes for op in ops if op.send]
    if sent:
        axis.stats.record(Op.SEND, axis.name, sent=sum(sent), calls=len(sent))
    if len(sent) < len(ops):
        axis.stats.record(Op.RECV, axis.name, recv=sum(op.tensor.nbytes for op in ops if not op.send),
                          calls=len(ops) - len(sent))
    return [RECORDER.start(Op.SEND if op.send else Op.RECV, axis, (op.tensor,), op.peer) for op in ops]


_COALESCES: dict[int, bool] = {}  # per process group: whether its backend groups p2p calls (nccl) or not (gloo)


def _issue(wire: list[P2P], axis: Axis) -> list:
    """One ``batch_isend_irecv`` where the backend groups p2p calls (nccl: ``ncclGroupStart/End``); elsewhere
    (gloo) the same calls it would make, one by one, without its per-call checks (a third of a small message's
    cost here, and of the Python a pipeline spends posting its messages). Tag 0 always: NCCL ignores tags, and gloo
    matches a pair's same-tag messages in issue order."""
    key = id(axis.group)
    if key not in _COALESCES:
        _COALESCES[key] = dist.get_backend(axis.group) != "gloo"
    if _COALESCES[key]:
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, group=axis.group,
                                                  group_peer=op.peer) for op in wire]) or []
    # The process group's own send/recv, which ``dist.isend``/``irecv`` end in after checks that hold here by
    # construction (a member of the group, a group rank, one dense tensor): a pipeline posts a few dozen a step.
    # (isend's view of a complex tensor as real is not needed: gloo moves its bytes as they are; tested.)
    group = axis.group
    return [group.send([op.tensor], op.peer, 0) if op.send else group.recv([op.tensor], op.peer, 0) for op in wire]


def _label_tensor(label: str, device: torch.device) -> torch.Tensor:
    data = label.encode()[:_LABEL_BYTES]
    box = torch.zeros(_LABEL_BYTES, dtype=torch.uint8, device=device)
    if data:
        box[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return box


def send(tensor: torch.Tensor, axis: Axis, dst: int, label: str = "") -> None:
    """Blocking send to axis index ``dst`` (a group of one)."""
    exchange([P2P(True, tensor, dst, label)], axis).wait()


def recv(tensor: torch.Tensor, axis: Axis, src: int, label: str = "") -> None:
    """Blocking receive from axis index ``src`` into ``tensor`` (a group of one)."""
    exchange([P2P(False, tensor, src, label)], axis).wait()


def ring_all_reduce(tensor: torch.Tensor, axis: Axis) -> None:
    """Sum ``tensor`` (contiguous) over the axis with an explicit ring of p2p messages, in place.

    The flat tensor is cut into N chunks. Reduce-scatter: in step s (0..N-2) rank r sends chunk (r - s) to
    its right neighbour and adds the chunk (r - s - 1) it receives from its left one; afterwards rank r holds
    the full sum of chunk (r + 1). All-gather: in step s rank r passes on chunk (r + 1 - s) and stores chunk
    (r - s). 2(N-1) steps, each moving ~1/N of the tensor: 2(N-1)/N * bytes per rank, the same as the model
    that `all_reduce` is counted with. Each step's send and receive go out as one group: issued one after the
    other, every rank's first call would wait on its neighbour's second under NCCL.
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
        exchange([P2P(True, out_chunk.contiguous(), right, f"rs{step}"), P2P(False, incoming, left, f"rs{step}")],
                 axis).wait()
        in_chunk.add_(incoming)
    for step in range(n - 1):
        exchange([P2P(True, chunks[(r + 1 - step) % n].contiguous(), right, f"ag{step}"),
                  P2P(False, chunks[(r - step) % n], left, f"ag{step}")], axis).wait()
