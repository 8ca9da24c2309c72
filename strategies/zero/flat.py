"""ZeRO's flat buffers: parameters packed into one padded buffer per group, of which each rank owns a shard."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from strategies.comm import Axis
from strategies.data_parallel import DEFAULT_BUCKET_CAP_MB, plan_buckets
from strategies.tensors import host_memory

# Element-wise: a shard's update depends only on that shard's gradient and state.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop,
)


class FlatParam:
    """Parameters packed into one padded buffer ``full`` (N*S elements); this rank owns ``shard`` (S).

    ``master`` is what the optimizer steps: the shard itself, or with offload a host copy of it.
    """

    def __init__(self, params: list[nn.Parameter], names: list[str], axis: Axis, group_index: int, *,
                 own_shard: bool, offload: bool) -> None:
        self.params, self.names, self.axis, self.group_index = params, names, axis, group_index
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        total = sum(self.numels)
        self.shard_size = math.ceil(total / axis.size)
        self.padded = self.shard_size * axis.size
        dtype, device = params[0].dtype, params[0].device
        self.full = torch.zeros(self.padded, dtype=dtype, device=device)
        with torch.no_grad():
            for p, offset in zip(params, self.offsets):
                self.full[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.full[offset : offset + p.numel()].view_as(p)  # params become views of the flat
        start = axis.index * self.shard_size
        view = self.full[start : start + self.shard_size]
        # ZeRO-3 frees `full` between uses, so its shard needs storage of its own.
        self.shard = view.clone() if own_shard else view
        self.half: torch.Tensor | None = None  # ZeRO-3 under a half param_dtype: what its gather fills (`stage3.Unit`)
        self.grad_shard: torch.Tensor | None = None  # the reduce-scatter's output, from launch to `ZeroGradSync.finish`
        self.offload = offload
        host = "meta" if device.type == "meta" else "cpu"  # (a rehearsal's host copies are shapes too)
        with host_memory():
            master = self.shard.detach().to(host, copy=True) if offload else self.shard
        if offload and device.type == "cuda":
            master = master.pin_memory()  # async host<->device copies
        self.master = nn.Parameter(master)
        self.grad_full: torch.Tensor | None = None  # the bucket reduce-scatter reads
        self.grad_host: torch.Tensor | None = None  # with offload: the reduced shard on the host, until its `finish`
        self.ready = 0

    def slot(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        return buffer[self.offsets[i] : self.offsets[i] + self.numels[i]].view_as(self.params[i])

    def new_grad_buffer(self) -> torch.Tensor:
        buffer = torch.empty(self.padded, dtype=self.full.dtype, device=self.full.device)
        buffer[sum(self.numels) :].zero_()  # padding: zero gradient, so the padded shard never moves
        return buffer

    def push_master(self) -> None:
        """After the optimizer step, bring an offloaded master shard back to the device shard."""
        if self.offload:
            self.shard.copy_(self.master.detach(), non_blocking=True)



def to_host(tensor: torch.Tensor, host: torch.device) -> torch.Tensor:
    """A copy of ``tensor`` on ``host``. From a GPU: into pinned memory (torch's caching host allocator, so no
    pinning per call) and without blocking the CPU, overlapped with the rest of backward; `host_copies_done` waits
    for them before the optimizer reads one. On CPU a plain copy."""
    with host_memory():
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=host, pin_memory=tensor.is_cuda)
    return out.copy_(tensor, non_blocking=tensor.is_cuda)


def host_copies_done(flats: list[FlatParam]) -> None:
    """Wait for the asynchronous device-to-host copies of offloaded flats (issued on the current stream)."""
    devices = {flat.shard.device for flat in flats if flat.offload and flat.shard.is_cuda}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def build_flats(module: nn.Module, optimizer: torch.optim.Optimizer, axis: Axis, groups: Iterable[list[str]],
                *, own_shard: bool, offload: bool, axis_of: dict[str, Axis] | None = None) -> list[list[FlatParam]]:
    """For each group of names, one FlatParam per (optimizer param group, dtype, device, axis) in it: ``axis``, or
    ``axis_of[name]`` for a parameter sharded over an axis of its own (expert parallel's experts)."""
    axis_of = axis_of or {}
    check_optimizer(optimizer)
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    outside = sorted(n for n, p in module.named_parameters() if p.requires_grad and id(p) not in group_of)
    if outside:
        raise ValueError(
            f"ZeRO shards the optimizer, so every trainable parameter must be in it; not in any param group: "
            f"{', '.join(outside[:8])}. Add them to configure_optimizers or freeze them with requires_grad_(False)."
        )
    params = dict(module.named_parameters())
    out = []
    for group in groups:
        buckets: dict[tuple, list[str]] = {}
        for name in group:
            if name in trainable:
                p = params[name]
                over = axis_of.get(name, axis)
                buckets.setdefault((group_of[id(p)], p.dtype, p.device, over.name), (over, []))[1].append(name)
        out.append([FlatParam([params[n] for n in bucket], bucket, over, g, own_shard=own_shard, offload=offload)
                    for (g, _, _, _), (over, bucket) in buckets.items()])
    return out


def bucket_names(module: nn.Module, cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> list[list[str]]:
    """Trainable parameter names, cut into DDP's buckets (`plan_buckets`): each becomes a flat."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return [[named[i][0] for i in bucket] for bucket in plan_buckets([p for _, p in named], int(cap_mb * 2**20))]


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        names = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
        raise TypeError(
            f"ZeRO steps each rank's shard of a flat buffer, which gives the single-process result only for "
            f"element-wise optimizers ({names}); {type(optimizer).__name__} is not one of them. Use one of "
            f"those, or the 'dp' plan, which keeps full parameters."
        )


def shard_optimizer(optimizer: torch.optim.Optimizer, flats: list[FlatParam]) -> None:
    """Point the user's optimizer at the master shards (its hyperparameters and schedulers are unchanged)."""
    if optimizer.state:
        raise RuntimeError("ZeRO must shard the optimizer before its first step (its state is not empty)")
    for g, group in enumerate(optimizer.param_groups):
        group["params"] = [flat.master for flat in flats if flat.group_index == g]


def shard_slices(flat: FlatParam, shard: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``(i, piece)`` for each parameter ``i`` of ``flat`` that overlaps this rank's shard: ``piece`` is the
    part of ``shard`` (the shard's gradient, say) that belongs to it."""
    start = flat.axis.index * flat.shard_size
    out = []
    for i, (offset, n) in enumerate(zip(flat.offsets, flat.numels)):
        lo, hi = max(offset, start), min(offset + n, start + flat.shard_size)
        if lo < hi:
            out.append((i, shard[lo - start : hi - start]))
    return out
