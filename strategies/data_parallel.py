"""Data parallel gradient synchronisation: the naive parameter server and bucketed, overlapped DDP.

Both leave the module itself untouched (no forward wrapper): they hook the parameters' gradients and,
after the backward of a step that syncs, make every ``param.grad`` hold the average over the data-parallel
axis. Each rank then steps its own full optimizer, so the replicas stay identical.

Gradient accumulation: inside ``no_sync()`` nothing is communicated and gradients accumulate locally, as
nanoGPT puts it: "we only need to sync gradients at the last micro step".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from strategies import comm
from strategies.comm import Axis

DEFAULT_BUCKET_CAP_MB = 25.0  # torch DDP's default
FIRST_BUCKET_BYTES = 2**20  # torch DDP's dist._DEFAULT_FIRST_BUCKET_BYTES


def broadcast_module(module: nn.Module, axis: Axis) -> None:
    """Make every replica start from axis index 0's parameters and buffers (what torch DDP does)."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            comm.broadcast(tensor.data, axis, src=0)


class GradSync:
    """What the strategy needs from a gradient synchroniser: ``no_sync()`` and ``finish()``."""

    def __init__(self, module: nn.Module, axis: Axis, find_unused_parameters: bool = False) -> None:
        self.axis = axis
        self.find_unused_parameters = find_unused_parameters
        self.named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        self.require_sync = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside this context syncs the sum."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def finish(self) -> None:
        """Called after backward: on a syncing step, leave dp-averaged gradients in ``param.grad``."""
        raise NotImplementedError

    def remove(self) -> None:
        """Undo any hooks (strategy teardown)."""

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors this synchroniser holds, by category, for `strategies.memory`."""
        return {}

    def _unused_error(self, missing: list[str]) -> RuntimeError:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        return RuntimeError(
            f"{len(missing)} parameter(s) got no gradient in this step: {shown}. Data parallel needs every "
            "rank to reduce the same tensors. If parameters are unused on purpose, pass "
            "find_unused_parameters=True to the strategy (e.g. DataParallelStrategy(find_unused_parameters=True)),"
            " or freeze them with requires_grad_(False)."
        )


class NaiveDataParallel(GradSync):
    """The textbook parameter server: workers send full gradients to one server rank, which averages them.

    Per step the server receives (N-1)*Psi elements and sends (N-1)*Psi back: 2(N-1)*Psi in all, which is
    why it does not scale and why DDP replaces it with an all-reduce that spreads the traffic evenly.
    """

    def __init__(self, module: nn.Module, axis: Axis, server: int = 0, find_unused_parameters: bool = False):
        super().__init__(module, axis, find_unused_parameters)
        if not 0 <= server < axis.size:
            raise ValueError(f"server rank {server} is not on the data-parallel axis of size {axis.size}")
        self.server = server

    def finish(self) -> None:
        if not self.require_sync or self.axis.size == 1 or not self.params:
            return
        missing = [name for name, p in self.named_params if p.grad is None]
        if missing and not self.find_unused_parameters:
            raise self._unused_error(missing)
        # One flat message each way. With find_unused_parameters, "used" flags ride at its end so that a
        # parameter no rank used keeps grad None; without, the message is exactly Psi elements.
        parts = [_flat_grad(p) for p in self.params]
        flags = len(self.params) if self.find_unused_parameters else 0
        flat = torch.cat(parts + ([_used_flags(self.params)] if flags else []))
        if self.axis.index == self.server:
            incoming = torch.empty_like(flat)
            for worker in range(self.axis.size):
                if worker != self.server:
                    comm.recv(incoming, self.axis, src=worker)
                    flat += incoming
            flat[: flat.numel() - flags] /= self.axis.size
            for worker in range(self.axis.size):
                if worker != self.server:
                    comm.send(flat, self.axis, dst=worker)
        else:
            comm.send(flat, self.axis, dst=self.server)
            comm.recv(flat, self.axis, src=self.server)
        grads = torch.split(flat[: flat.numel() - flags], [p.numel() for p in self.params])
        _assign_grads(self.params, list(grads), flat[flat.numel() - flags :] if flags else None)


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    ready: int = 0
    grads_ready_at_launch: int = -1  # how many of the model's grads existed when this bucket went out
    handle: comm.Handle | None = None
    slots: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.slots = [self.buffer[o : o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]


class BucketedDataParallel(GradSync):
    """DDP: gradients grouped into buckets, each all-reduced asynchronously as soon as it is full.

    Buckets are filled in reverse registration order, roughly the order backward produces gradients, so
    the first bucket's all-reduce runs while backward is still computing the earlier layers (overlap).
    Buckets are launched strictly in index order on every rank, since collectives on one group must be
    issued in the same order everywhere. Gradients are pre-divided by N so the sum is the mean.
    """

    def __init__(
        self,
        module: nn.Module,
        axis: Axis,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        find_unused_parameters: bool = False,
        ring: bool = False,
    ) -> None:
        super().__init__(module, axis, find_unused_parameters)
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.ring = ring  # explicit p2p ring (synchronous): shows the algorithm, tested equal to all_reduce
        # One replica (tp or pp using every rank): nothing to reduce, so no bucket buffers either (4 Psi saved).
        self.buckets = _make_buckets(self.params, int(bucket_cap_mb * 2**20)) if axis.size > 1 else []
        self._where = {id(p): (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)}
        self._index = {id(p): k for k, p in enumerate(self.params)}
        self._fired = [False] * len(self.params)  # which params produced a gradient in this backward
        self._next = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        # Runs inside autograd, once per parameter per backward, right after its .grad is complete.
        if not self.require_sync or self.axis.size == 1:
            return
        b, i = self._where[id(param)]
        bucket = self.buckets[b]
        slot = bucket.slots[i]
        if param.grad.data_ptr() != slot.data_ptr():
            slot.copy_(param.grad)
        bucket.ready += 1
        self._fired[self._index[id(param)]] = True
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if not force and bucket.ready < len(bucket.params):
                return
            bucket.grads_ready_at_launch = sum(self._fired)
            bucket.buffer.div_(self.axis.size)
            if self.ring:
                comm.ring_all_reduce(bucket.buffer, self.axis)
            else:
                bucket.handle = comm.all_reduce(bucket.buffer, self.axis, async_op=True)
            self._next += 1

    def finish(self) -> None:
        if not self.require_sync or self.axis.size == 1:
            return
        missing = [name for (name, _), fired in zip(self.named_params, self._fired) if not fired]
        if missing and not self.find_unused_parameters:
            self._reset()
            raise self._unused_error(missing)
        for p, fired in zip(self.params, self._fired):
            if not fired:  # contributes zeros, so every rank still reduces the same buckets
                b, i = self._where[id(p)]
                self.buckets[b].slots[i].zero_()
        self._launch_ready(force=True)
        used = None
        if self.find_unused_parameters:
            used = torch.tensor(self._fired, dtype=self.params[0].dtype, device=self.params[0].device)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
        if used is not None:
            comm.all_reduce(used, self.axis)  # a parameter unused on every rank keeps grad None
        slots = [self.buckets[b].slots[i] for b, i in (self._where[id(p)] for p in self.params)]
        _assign_grads(self.params, slots, used)
        self._reset()

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready, bucket.handle = 0, None
        self._fired = [False] * len(self.params)
        self._next = 0

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"grads": [bucket.buffer for bucket in self.buckets]}


def plan_buckets(params: list[torch.Tensor], cap_bytes: int, first_cap_bytes: int | None = None) -> list[list[int]]:
    """Indices of ``params`` grouped into buckets, in reverse order (about the order backward produces the
    gradients), one dtype/device per bucket, at most ``cap_bytes`` each. As in torch DDP, the first bucket
    is small (``first_cap_bytes``, 1 MiB by default): the last layers' gradients go out while backward is
    still busy with the rest, instead of waiting for a 25 MB bucket to fill."""
    first_cap = min(cap_bytes, FIRST_BUCKET_BYTES if first_cap_bytes is None else first_cap_bytes)
    buckets: list[list[int]] = []
    size = 0
    for index in reversed(range(len(params))):
        p = params[index]
        nbytes = p.numel() * p.element_size()
        cap = first_cap if len(buckets) <= 1 else cap_bytes
        same_kind = buckets and (params[buckets[-1][0]].dtype, params[buckets[-1][0]].device) == (p.dtype, p.device)
        if not same_kind or size + nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += nbytes
    return buckets


def _make_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
    """Flat buffers for the buckets of `plan_buckets`."""
    groups = [[params[i] for i in bucket] for bucket in plan_buckets(params, cap_bytes)]
    buckets = []
    for group in groups:
        offsets = [0]
        for p in group[:-1]:
            offsets.append(offsets[-1] + p.numel())
        total = offsets[-1] + group[-1].numel()
        buckets.append(_Bucket(group, offsets, torch.zeros(total, dtype=group[0].dtype, device=group[0].device)))
    return buckets


def _flat_grad(p: nn.Parameter) -> torch.Tensor:
    return p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)


def _used_flags(params: list[nn.Parameter]) -> torch.Tensor:
    dtype, device = params[0].dtype, params[0].device
    return torch.tensor([float(p.grad is not None) for p in params], dtype=dtype, device=device)


def _assign_grads(params: list[nn.Parameter], grads: list[torch.Tensor], used: torch.Tensor | None) -> None:
    """Point each ``param.grad`` at its reduced gradient (a view, no copy); None where no rank used it."""
    for k, (p, grad) in enumerate(zip(params, grads)):
        if used is not None and used[k] == 0:
            p.grad = None
        elif p.grad is None or p.grad.data_ptr() != grad.data_ptr():
            p.grad = grad.view_as(p)
