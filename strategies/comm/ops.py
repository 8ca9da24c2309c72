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

import contextlib
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from strategies.comm.recorder import DEBUG_ENV, RECORDER, CallRecord, CollectiveMismatch, fail
from strategies.comm.stats import Axis, Op


def _check_same(record: CallRecord, axis: Axis) -> None:
    """Debug mode: every rank of ``axis`` must be issuing the same collective (kind and shapes) as its n-th
    collective on that axis (numbered in the message)."""
    RECORDER.collectives[axis.name] += 1
    # an all-to-all's row counts differ by rank by design: its rows' shape is what must agree
    shapes = tuple(s[1:] for s in record.shapes) if record.op == Op.ALL_TO_ALL.value else record.shapes
    mine = (RECORDER.collectives[axis.name], record.op, shapes, record.dtype, record.peer)
    theirs: list[Any] = [None] * axis.size
    try:  # directly, not through all_gather_object: the check is not a call of its own in the recorder
        dist.all_gather_object(theirs, mine, group=axis.group)
    except Exception as err:  # noqa: BLE001
        raise fail(record, err) from err
    if any(t != mine for t in theirs):
        calls = "; ".join(f"rank {axis.ranks[i]}: #{t[0]} {t[1]} {' '.join(str(tuple(s)) for s in t[2])} "
                          f"{str(t[3]).removeprefix('torch.')}"
                          + (f" peer {t[4]}" if t[4] is not None else "") for i, t in enumerate(theirs))
        record.state = "mismatch"
        raise CollectiveMismatch(f"[rank {dist.get_rank()}] mismatched collectives on axis {axis.name}: {calls}")


class Handle:
    """An in-flight async call; ``wait()`` adds the seconds blocked to the counters."""

    def __init__(self, work: Any, axis: Axis, op: Op, record: CallRecord | None = None, held: Any = None) -> None:
        self._work, self._axis, self._op, self._record = work, axis, op, record
        self._held = held  # a rehearsal's: the backend's buffers while the call is in flight (`_backend_buffers`)

    def wait(self) -> None:
        self._held = None
        if self._work is None:
            return
        start = time.perf_counter()
        try:
            self._work.wait()
        except Exception as err:  # noqa: BLE001 - gloo / nccl raise RuntimeError subclasses; name the call
            raise fail(self._record, err) from err
        self._axis.stats.record(self._op, self._axis.name, wait_s=time.perf_counter() - start, calls=0)
        if self._record is not None:
            self._record.state = "done"
        self._work = None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# -- rehearsal --------------------------------------------------------------------------------------------

_rehearsing = [False]  # set for the length of a rehearsal (`strategies.lightning.rehearsal`)
_backend = ["nccl"]  # the backend a rehearsal stands in for


def set_rehearsal(on: bool, backend: str = "nccl") -> None:
    """Rehearsal mode: one rank of a job runs alone (over torch's fake process group). Every call is counted as in a
    real run, and none is sent: every call holds the buffers ``backend`` would hold meanwhile (`_backend_buffers`);
    meta tensors (the model's compute) need nothing more, and a real tensor (Lightning's control values, the
    monitor's figures, the compute of a real-tensor rehearsal) gets what every rank alike would give (`_alike`)."""
    _rehearsing[0], _backend[0] = on, backend


def _backend_buffers(op: Op, axis: Axis, tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Stand-ins, on the tensors' device, for what the backend holds during ``op`` beyond its tensors, as measured on
    gloo (the estimator's model, `measure.estimate._chunk`): a reduce-scatter copies its input and holds 1/N more,
    an all-gather works through a buffer the size of its output, an all-reduce holds 1/N. NCCL works in place."""
    if _backend[0] != "gloo" or not tensors:
        return []
    n, first = axis.size, tensors[0]
    size = {Op.REDUCE_SCATTER: tensors[-1].numel() * (n + 1) // n, Op.ALL_GATHER: first.numel(),
            Op.ALL_REDUCE: first.numel() // n}.get(op, 0)
    return [torch.empty(size, dtype=first.dtype, device=first.device)] if size else []


def rehearsing() -> bool:
    return _rehearsing[0]


def backend_of(axis: Axis) -> str:
    """The backend ``axis`` talks over ("gloo", "nccl"): in a rehearsal, the one it stands in for."""
    return _backend[0] if _rehearsing[0] else dist.get_backend(axis.group)


def _alike(op: Op, axis: Axis, tensors: tuple[torch.Tensor, ...], reduce: ReduceOp | None) -> None:
    """What ``op`` leaves in real ``tensors`` when every rank of ``axis`` holds the same values: a sum is N times
    the value (max, min and average the value itself), a gather N copies, a reduce-scatter this rank's chunk. In
    place, with no temporary: a real-tensor rehearsal measures the memory of the rank's compute around these."""
    n = axis.size
    with torch.no_grad():
        if op is Op.ALL_REDUCE and reduce == ReduceOp.SUM:
            tensors[0].mul_(n)
        elif op is Op.REDUCE_SCATTER:
            out, whole = tensors
            out.copy_(whole.reshape(n, -1)[axis.index].view_as(out))
            if reduce == ReduceOp.SUM:
                out.mul_(n)
        elif op is Op.ALL_GATHER:
            out, part = tensors  # (the collectives' outputs are contiguous)
            out.view(n, -1).copy_(part.reshape(1, -1).expand(n, -1))


@torch.compiler.disable  # under torch.compile: a clean graph break here, every call counted and logged eagerly
def _run(op: Op, axis: Axis, call: Callable[[], Any], sent: float, recv: float, async_op: bool,
         tensors: tuple[torch.Tensor, ...] = (), peer: int | None = None,
         reduce: ReduceOp | None = None) -> Handle | None:
    """Issue ``call``, count it, log it, and time it now (sync) or at ``wait()`` (async). On meta tensors (a pipeline
    traced on a model built on meta, every rank alike) nothing is sent: the outputs' shapes are all there is."""
    axis.stats.record(op, axis.name, sent=sent, recv=recv)
    meta = any(t.device.type == "meta" for t in tensors)
    if _rehearsing[0] or meta:
        held = None
        if _rehearsing[0]:
            held = _backend_buffers(op, axis, tensors)
            if not meta:
                _alike(op, axis, tensors, reduce)
        return Handle(None, axis, op, held=held) if async_op else None
    record = RECORDER.start(op, axis, tensors, peer)
    if op not in (Op.SEND, Op.RECV) and os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        _check_same(record, axis)
    start = time.perf_counter()
    try:
        work = call()
    except Exception as err:  # noqa: BLE001
        raise fail(record, err) from err
    if not async_op:
        axis.stats.record(op, axis.name, wait_s=time.perf_counter() - start, calls=0)
        record.state = "done"
        return None
    return Handle(work, axis, op, record)


# -- collectives --------------------------------------------------------------------------------------------


# torch 2.13 renamed the flat-tensor forms (and deprecates the old names); pyproject accepts torch >= 2.6, whose
# CUDA builds users keep, so take whichever this torch has (seen: 2.11 on an H100 has only the old names).
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# -- deterministic sums -------------------------------------------------------------------------------------

DETERMINISTIC_ENV = "STRATPACK_DETERMINISTIC"
_ordered = [False]  # set by the strategy's ``deterministic`` option for the length of a run


def set_ordered_sums(on: bool) -> None:
    """Sum every SUM all-reduce and reduce-scatter in axis order (see `ordered_sums`)."""
    _ordered[0] = on


def ordered_sums() -> bool:
    """Deterministic mode (``deterministic=True``, or ``STRATPACK_DETERMINISTIC=1``): a backend sums a reduction
    in an order that depends on where an element lies in the buffer (gloo's and NCCL's rings cut it into per-rank
    chunks), so the same gradients reduced in DDP's buckets and in ZeRO's flats can differ in the last bit. Here
    every element is summed rank 0 + rank 1 + ... in axis order, whatever the layout, so `dp` and ZeRO-1/2/3 give
    bit-identical results at one world size. It moves N-1 times the bytes (all-gather / all-to-all, then a local
    sum) and is synchronous: a mode for proving and debugging, not for speed."""
    return _ordered[0] or os.environ.get(DETERMINISTIC_ENV, "") not in ("", "0")


def _in_order(parts: torch.Tensor) -> torch.Tensor:
    """parts[0] + parts[1] + ..., in that order."""
    out = parts[0].clone()
    for part in parts[1:]:
        out += part
    return out


def _ordered_all_reduce(tensor: torch.Tensor, axis: Axis, async_op: bool):
    n = axis.size
    flat = tensor.detach().reshape(-1).contiguous()
    gathered = torch.empty((n, flat.numel()), dtype=flat.dtype, device=flat.device)

    def call() -> None:
        _ALL_GATHER(gathered.view(-1), flat, group=axis.group)
        tensor.copy_(_in_order(gathered).view_as(tensor))
    moved = (n - 1) * _nbytes(tensor)
    _run(Op.ALL_REDUCE, axis, call, moved, moved, False, (tensor,))
    return Handle(None, axis, Op.ALL_REDUCE) if async_op else None


def _ordered_reduce_scatter(output: torch.Tensor, input: torch.Tensor, axis: Axis, async_op: bool):
    n = axis.size
    received = torch.empty((n, output.numel()), dtype=input.dtype, device=input.device)

    def call() -> None:  # chunk r of every rank to rank r, then summed in rank order
        dist.all_to_all_single(received.view(-1), input.reshape(-1).contiguous(), group=axis.group)
        output.copy_(_in_order(received).view_as(output))
    moved = (n - 1) / n * _nbytes(input)
    _run(Op.REDUCE_SCATTER, axis, call, moved, moved, False, (output, input))
    return Handle(None, axis, Op.REDUCE_SCATTER) if async_op else None


def all_reduce(tensor: torch.Tensor, axis: Axis, op: ReduceOp = ReduceOp.SUM, async_op: bool = False):
    """In-place reduction of ``tensor`` over the axis: ring cost 2(N-1)/N * bytes each way."""
    if axis.size == 1:
        return Handle(None, axis, Op.ALL_REDUCE) if async_op else None
    if op == ReduceOp.SUM and ordered_sums():
        return _ordered_all_reduce(tensor, axis, async_op)
    moved = 2 * (axis.size - 1) / axis.size * _nbytes(tensor)
    return _run(
        Op.ALL_REDUCE, axis, lambda: dist.all_reduce(tensor, op=op, group=axis.group, async_op=async_op),
        moved, moved, async_op, (tensor,), reduce=op,
    )


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, axis: Axis, op: ReduceOp = ReduceOp.SUM,
                   async_op: bool = False):
    """``output`` (1/N of ``input``) gets this rank's reduced shard: (N-1)/N * bytes(input) each way."""
    if axis.size == 1:
        output.copy_(input)
        return Handle(None, axis, Op.REDUCE_SCATTER) if async_op else None
    if op == ReduceOp.SUM and ordered_sums():
        return _ordered_reduce_scatter(output, input, axis, async_op)
    moved = (axis.size - 1) / axis.size * _nbytes(input)
    return _run(
        Op.REDUCE_SCATTER, axis,
        lambda: _REDUCE_SCATTER(output, input, op=op, group=axis.group, async_op=async_op),
        moved, moved, async_op, (output, input), reduce=op,
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


def all_to_all(output: torch.Tensor, input: torch.Tensor, axis: Axis, output_splits: list[int],
               input_splits: list[int]) -> None:
    """Rows ``input[sum(input_splits[:j]) : ...]`` go to axis rank j; ``output`` gets rank j's rows for this one in
    axis order (``output_splits[j]`` of them). Counted exactly, as p2p is: the rows sent to and received from the
    other ranks (a rank's rows to itself are a local copy)."""
    if axis.size == 1:
        output.copy_(input)
        return
    row = math.prod(input.shape[1:]) * input.element_size()  # (of an empty input too)
    me = axis.index
    sent = row * (sum(input_splits) - input_splits[me])
    recv = row * (sum(output_splits) - output_splits[me])
    _run(Op.ALL_TO_ALL, axis,
         lambda: dist.all_to_all_single(output, input, output_splits, input_splits, group=axis.group),
         sent, recv, False, (output, input))


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


_OWN = object()


def broadcast_object(obj: Any, axis: Axis, src: int = 0, rehearsed: Any = _OWN) -> Any:
    """Pickle ``obj`` from axis index ``src`` to every rank (not counted: control messages, not training data). In a
    rehearsal (`set_rehearsal`) another rank's object is not known: a rank not ``src`` gets ``rehearsed``, by default
    its own ``obj`` (every rank alike)."""
    if axis.size == 1:
        return obj
    if _rehearsing[0]:
        return obj if axis.index == src or rehearsed is _OWN else rehearsed
    box = [obj]
    _guarded("broadcast_object", axis, lambda: dist.broadcast_object_list(box, group=axis.group, group_src=src), src)
    return box[0]


def all_gather_object(obj: Any, axis: Axis) -> list[Any]:
    """Every rank's ``obj`` in axis order (pickled; not counted: control messages)."""
    if axis.size == 1 or _rehearsing[0]:  # a rehearsal: every rank alike
        return [obj] * axis.size
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
        raise fail(record, err) from err
    record.state = "done"


def register_peers(world: Axis) -> None:
    """Learn every rank's host and pid (a collective over ``world``), so that a rank that dies later is named."""
    me = RECORDER.identity()
    RECORDER.peers = all_gather_object(me, world) if world.size > 1 else [me]


def barrier(axis: Axis) -> None:
    if axis.size > 1:
        _run(Op.BARRIER, axis, lambda: dist.barrier(group=axis.group), 0, 0, False)


_LEAVING = [False]  # `leave_group_at_exit` registered in this process


def leave_groups(groups: list[Any]) -> None:
    """Destroy these gloo sub-groups now (the world group and NCCL's stay to the exit: a peer may still be reading
    an NCCL buffer), each once. Local, no collective: for a rank that has nothing in flight on them; a gloo send has
    completed once written to its socket, which a close still delivers."""
    for group in {id(g): g for g in groups}.values():
        if group is not None and group != dist.group.WORLD and dist.is_initialized() and \
                dist.get_backend(group) == "gloo":
            with contextlib.suppress(ValueError):  # (already destroyed: "Invalid process group specified")
                dist.destroy_process_group(group)


def leave_group_at_exit() -> None:
    """Destroy this process's default process group when the interpreter exits, if nothing did before (a user's
    script ends after ``trainer.fit`` as Lightning's docs show, without ``destroy_process_group``). Left to the
    interpreter's own teardown, gloo's and NCCL's threads can be destroyed while still joinable, and the process
    aborts ("terminate called without an active exception", exit code -6) after a run that succeeded. Local: no
    barrier (another rank may be gone)."""
    import atexit

    if _LEAVING[0]:
        return
    _LEAVING[0] = True

    def leave() -> None:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - exiting anyway; an error here must not replace the run's status
                pass

    atexit.register(leave)
