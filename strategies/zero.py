"""ZeRO stages 1, 2 and 3 over flat, padded shards, and CPU offload of the optimizer step.

Parameters are packed into `FlatParam`s: one contiguous buffer per group of parameters that share a dtype,
a device and an optimizer param group, padded to a multiple of N so that rank r owns elements
[r*S, (r+1)*S). Every collective is then one contiguous call, and sizes that do not divide by N cost at
most N-1 padding elements per flat. The user's optimizer is kept (its schedulers and hyperparameters
keep working) but steps only this rank's shards:

- ZeRO-1: optimizer states partitioned. Full gradients are kept (4 Psi), reduce-scattered into this rank's
  shard (each bucket as soon as backward fills it); after the step the updated shards are all-gathered.
- ZeRO-2: also gradients partitioned: a bucket's full gradient lives only until its reduce-scatter.
- ZeRO-3: also parameters partitioned: see `zero3.py`, which gathers them around each unit's use.

Per step each stage moves 2(N-1)/N * Psi elements per rank for 1 and 2 (reduce-scatter + all-gather),
and 3(N-1)/N * Psi for 3 (gather in forward, again in backward, reduce-scatter).

Only element-wise optimizers give the same update on a shard as on the whole tensor; others are refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from strategies import comm
from strategies.comm import Axis
from strategies.data_parallel import DEFAULT_BUCKET_CAP_MB, GradSync, plan_buckets

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
        self.grad_shard: torch.Tensor | None = None  # the reduce-scatter's output, from launch to `finish`
        self.offload = offload
        master = self.shard.detach().to("cpu", copy=True) if offload else self.shard
        if offload and device.type == "cuda":
            master = master.pin_memory()  # async host<->device copies
        self.master = nn.Parameter(master)
        self.grad_full: torch.Tensor | None = None  # the bucket reduce-scatter reads
        self.grad_host: torch.Tensor | None = None  # with offload: the reduced shard on the host, until `finish`
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


IN_FLIGHT = 2  # ZeRO-2/3: reduce-scatters in flight during backward, each holding its flat's full gradient


class ZeroGradSync(GradSync):
    """Reduce-scatters each flat's gradients into this rank's shard, as soon as backward fills the flat."""

    def __init__(self, module: nn.Module, axis: Axis, flats: list[FlatParam], stage: int,
                 find_unused_parameters: bool = False) -> None:
        super().__init__(module, axis, find_unused_parameters)
        self.flats, self.stage = flats, stage
        self.original_groups: list[list[str]] = []
        # With fp16 loss scaling each rank's GradScaler inspects only its shard; an overflow on one rank must
        # make every rank skip the step, or the replicas part ways. The strategy turns this on with a scaler.
        self.sync_nonfinite = False
        self._where = {id(p): (f, i) for f, flat in enumerate(flats) for i, p in enumerate(flat.params)}
        self._fired: set[int] = set()
        self._next = 0
        self._handles: list[comm.Handle | None] = [None] * len(flats)
        for flat in flats:
            if stage == 1:  # gradients stay full and persistent: params' .grad are views into one buffer
                flat.grad_full = flat.new_grad_buffer()
                flat.grad_full.zero_()
            # ZeRO-2/3: the partitioned gradient (1/N) is allocated when its reduce-scatter starts and handed to
            # the optimizer as the master's .grad, so zero_grad(set_to_none=True) frees it between steps, as
            # torch's FSDP does (kept from the start, it cost 4 Psi / N more than FSDP2 at the backward peak).
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.require_sync:  # accumulation micro-step: the gradient stays in param.grad
            self.on_param_reduced(param)
            return
        f, i = self._where[id(param)]
        flat = self.flats[f]
        if flat.grad_full is None:
            flat.grad_full = flat.new_grad_buffer()
        slot = flat.slot(flat.grad_full, i)
        if param.grad.data_ptr() != slot.data_ptr():
            slot.copy_(param.grad)
        # ZeRO-1 keeps the full gradient (as a view); 2 and 3 drop it: only the bucket holds it until reduced.
        param.grad = slot if self.stage == 1 else None
        flat.ready += 1
        self._fired.add(id(param))
        self._launch_ready()
        self.on_param_reduced(param)

    def on_param_reduced(self, param: nn.Parameter) -> None:
        """Hook for ZeRO-3: called once the param's gradient is complete (and bucketed, when syncing)."""

    def _launch_ready(self, force: bool = False) -> None:
        # Flats go out strictly in index order on every rank: collectives on a group must match in order.
        while self._next < len(self.flats):
            flat = self.flats[self._next]
            if not force and flat.ready < len(flat.params):
                return
            if flat.grad_full is None:
                flat.grad_full = flat.new_grad_buffer()
            flat.grad_full.div_(self.axis.size)  # pre-divide: the reduced sum is the mean
            if flat.grad_shard is None:  # ZeRO-1: a temporary, the result moves into grad_full's own shard
                flat.grad_shard = torch.empty(flat.shard_size, dtype=flat.full.dtype, device=flat.full.device)
            self._handles[self._next] = comm.reduce_scatter(flat.grad_shard, flat.grad_full, self.axis,
                                                            async_op=True)
            self._next += 1
            if self.stage >= 2 and self._next > IN_FLIGHT:
                # ZeRO-2/3 hold a flat's full gradient only until its reduce-scatter is done: with every bucket
                # kept to the end of backward, a step would hold all of them (4 Psi), as if not partitioned.
                self._release_full_grad(self._next - 1 - IN_FLIGHT)

    def _release_full_grad(self, index: int) -> None:
        handle = self._handles[index]
        if handle is not None:
            handle.wait()
            flat = self.flats[index]
            flat.grad_full = None
            if flat.offload:  # to the host now: the device holds a few shards in flight, not all of them
                # Held aside until `finish`: under pp this runs inside training_step, and Lightning's zero_grad
                # between training_step and backward would drop a .grad set now.
                flat.grad_host = flat.grad_shard.to(flat.master.device, copy=True)
                flat.grad_shard = None

    def finish(self) -> None:
        if not self.require_sync:
            return
        missing = [name for name, p in self.named_params if id(p) not in self._fired]
        if missing and not self.find_unused_parameters:
            self._reset()
            raise self._unused_error(missing)
        for name, p in self.named_params:
            if id(p) not in self._fired:  # reduced as zeros; ZeRO then steps them with a zero gradient
                f, i = self._where[id(p)]
                flat = self.flats[f]
                if flat.grad_full is None:
                    flat.grad_full = flat.new_grad_buffer()
                flat.slot(flat.grad_full, i).copy_(p.grad if p.grad is not None else torch.zeros_like(p))
                p.grad = None
        self._launch_ready(force=True)
        for flat, handle in zip(self.flats, self._handles):
            handle.wait()
            if flat.grad_shard is None:  # offloaded during backward (`_release_full_grad`)
                flat.master.grad, flat.grad_host = flat.grad_host, None
                continue
            grad = flat.grad_shard
            if self.stage == 1:  # keep the reduced shard inside the full gradient buffer: no extra 4 Psi / N
                start = self.axis.index * flat.shard_size
                grad = flat.grad_full[start : start + flat.shard_size].copy_(grad)
                flat.grad_shard = None
            else:
                flat.grad_full = None
            flat.master.grad = grad.to(flat.master.device, copy=True) if flat.offload else grad
            flat.grad_shard = None  # the optimizer's .grad holds it now (or its host copy, with offload)
        self._reset()
        if self.sync_nonfinite:
            self._share_overflow()

    def _share_overflow(self) -> None:
        """If any rank's shard has an inf/nan gradient, poison every rank's, so all GradScalers skip."""
        grads = [flat.master.grad for flat in self.flats]
        device = self.flats[0].full.device
        overflow = torch.stack([(~torch.isfinite(g)).any().to(device) for g in grads]).any().float().reshape(1)
        comm.all_reduce(overflow, self.axis, op=torch.distributed.ReduceOp.MAX)
        if overflow.item():
            for g in grads:
                g.fill_(float("nan"))

    def _reset(self) -> None:
        for flat in self.flats:
            flat.ready = 0
        self._handles = [None] * len(self.flats)
        self._fired.clear()
        self._next = 0

    def after_step(self) -> None:
        """All-gather the updated shards so every rank holds the new full parameters (stages 1 and 2)."""
        for flat in self.flats:
            flat.push_master()
            if self.stage < 3:
                comm.all_gather(flat.full, flat.shard.clone(), self.axis)  # input must not alias output
            if self.stage == 1:
                flat.grad_full.zero_()  # the next step accumulates into the same views

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        flats = self.flats
        offloaded = [t for f in flats if f.offload for t in (f.master, f.master.grad, f.grad_host)]
        return {
            "params": [f.full for f in flats] + [f.shard for f in flats],
            "grads": [f.grad_shard for f in flats] + [f.grad_full for f in flats]
                     + [f.master.grad for f in flats if not f.offload],
            "host": offloaded,
        }


def build_flats(module: nn.Module, optimizer: torch.optim.Optimizer, axis: Axis, groups: Iterable[list[str]],
                *, own_shard: bool, offload: bool) -> list[list[FlatParam]]:
    """For each group of names, one FlatParam per (optimizer param group, dtype, device) in it."""
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
                buckets.setdefault((group_of[id(p)], p.dtype, p.device), []).append(name)
        out.append([FlatParam([params[n] for n in bucket], bucket, axis, g, own_shard=own_shard, offload=offload)
                    for (g, _, _), bucket in buckets.items()])
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


def clip_grad_norm(flats: list[FlatParam], max_norm: float, axis: Axis, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the master gradients by the norm of the *whole* gradient: every shard's partial sum, reduced
    over the data-parallel axis (padding is zero and adds nothing). Returns the total norm."""
    from strategies.clipping import clip_pieces

    grads = [(flat.master.grad, False) for flat in flats if flat.master.grad is not None]
    device = flats[0].full.device if flats else None
    return clip_pieces(grads, max_norm, disjoint=[axis], norm_type=norm_type, device=device)


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


def shard_model(module: nn.Module, optimizer: torch.optim.Optimizer, axis: Axis, stage: int, *,
                offload: bool = False, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                find_unused_parameters: bool = False, units=None) -> ZeroGradSync:
    """Apply ZeRO-``stage`` to ``module`` over ``axis`` and point ``optimizer`` at the shards.

    ``units`` (ZeRO-3): the wrapping policy, a function from the module to the ``(name, submodule)`` pairs
    gathered as one; by default `zero3.default_units` (the blocks, then every other parameter owner)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    name_of = {id(p): n for n, p in module.named_parameters()}
    original_groups = [[name_of[id(p)] for p in group["params"] if id(p) in name_of] for group in optimizer.param_groups]
    if stage == 3:
        from strategies.zero3 import Zero3GradSync, build_units

        chosen = units(module) if units is not None else None
        flats, built = build_units(module, optimizer, axis, offload, chosen)
        sync: ZeroGradSync = Zero3GradSync(module, axis, flats, built, find_unused_parameters=find_unused_parameters)
    else:
        groups = bucket_names(module, bucket_cap_mb)
        built = build_flats(module, optimizer, axis, groups, own_shard=False, offload=offload)
        flats = [flat for per_group in built for flat in per_group]
        sync = ZeroGradSync(module, axis, flats, stage, find_unused_parameters=find_unused_parameters)
    shard_optimizer(optimizer, flats)
    sync.original_groups = original_groups  # the user's param groups by name: checkpoints use this order
    return sync
