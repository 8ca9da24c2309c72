"""DDP: bucketed all-reduce of the gradients, overlapped with backward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from strategies import comm
from strategies.comm import Axis
from strategies.data_parallel.sync import GradSync, assign_grads
from strategies.sizes import DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_BYTES
from strategies.tensors import address


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
        include: Callable[[str], bool] | None = None,
    ) -> None:
        super().__init__(module, axis, find_unused_parameters, include)
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.ring = ring  # explicit p2p ring (synchronous): shows the algorithm, tested equal to all_reduce
        # One replica (tp or pp using every rank): nothing to reduce, so no bucket buffers either (4 Psi saved).
        self.buckets = _make_buckets(self.params, int(bucket_cap_mb * 2**20)) if axis.size > 1 else []
        self._where = {id(p): (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)}
        self._index = {id(p): k for k, p in enumerate(self.params)}
        self._fired = [False] * len(self.params)  # which params produced a gradient in this backward
        self._next = 0
        # One replica: no hooks either (a Python call per parameter per backward, for nothing).
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for p in (self.params if axis.size > 1 else [])]

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        # Runs inside autograd, once per parameter per backward, right after its .grad is complete.
        if self.axis.size == 1:
            return
        b, i = self._where[id(param)]
        bucket = self.buckets[b]
        slot = bucket.slots[i]
        if address(param.grad) != address(slot):
            # The gradient moves into its bucket slot at once, and .grad becomes the slot: autograd's tensor is
            # freed now instead of at the end of backward (holding both cost 4 Psi more at the backward's peak),
            # and later backwards of the step (accumulation micro-steps, pipeline microbatches) add into the
            # slot in place, as torch DDP's gradient_as_bucket_view does.
            slot.copy_(param.grad)
            param.grad = slot
        self._fired[self._index[id(param)]] = True  # (in an earlier micro-step too: its slot holds what it got)
        if not self.require_sync:
            return
        bucket.ready += 1
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
            if not fired:  # what it accumulated in earlier micro-steps (in its slot already), else zeros, so
                b, i = self._where[id(p)]  # every rank still reduces the same buckets
                slot = self.buckets[b].slots[i]
                if p.grad is None:
                    slot.zero_()
                elif address(p.grad) != address(slot):
                    slot.copy_(p.grad)
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
        assign_grads(self.params, slots, used)
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
