"""ZeRO-1 and 2's gradient path: each flat's gradients reduce-scattered into this rank's shard as backward fills it,
and the technique's hooks for all three stages (state in the single-process layout, the gradient shards held)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from strategies import comm
from strategies.comm import Axis
from strategies.data_parallel import GradSync
from strategies.sizes import IN_FLIGHT
from strategies.technique import HeldGrad, OptimizerState
from strategies.tensors import address
from strategies.zero import state as zero_state
from strategies.zero.flat import FlatParam, host_copies_done, shard_slices, to_host


class ZeroGradSync(GradSync):
    """Reduce-scatters each flat's gradients into this rank's shard, as soon as backward fills the flat."""

    def __init__(self, module: nn.Module, axis: Axis, flats: list[FlatParam], stage: int,
                 find_unused_parameters: bool = False) -> None:
        super().__init__(module, axis, find_unused_parameters)
        self.flats, self.stage = flats, stage
        self.original_groups: list[list[str]] = []  # the user's param groups by name (`shard_model` sets them)
        self._module_params = {name for name, _ in module.named_parameters()}
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

    def sliced_flats(self) -> list[FlatParam]:
        return self.flats

    def after_slice_load(self) -> None:
        self.after_step()  # the loaded masters to the shards and, gathered, the full parameters (as after a step)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        f, i = self._where[id(param)]
        flat = self.flats[f]
        if not self.require_sync:  # accumulation micro-step: the gradient stays local
            if self.stage == 1:  # in its slot of the persistent full gradient (no second copy), as `dp` does
                slot = flat.slot(flat.grad_full, i)
                if address(param.grad) != address(slot):
                    slot.copy_(param.grad)
                    param.grad = slot
            self.on_param_reduced(param)  # ZeRO-2/3: in param.grad (their full gradient exists only in flight)
            return
        if flat.grad_full is None:
            flat.grad_full = flat.new_grad_buffer()
        slot = flat.slot(flat.grad_full, i)
        if address(param.grad) != address(slot):
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
            flat.grad_full.div_(flat.axis.size)  # pre-divide: the reduced sum is the mean (over the flat's axis)
            if flat.grad_shard is None:  # ZeRO-1: a temporary, the result moves into grad_full's own shard
                flat.grad_shard = torch.empty(flat.shard_size, dtype=flat.full.dtype, device=flat.full.device)
            self._handles[self._next] = comm.reduce_scatter(flat.grad_shard, flat.grad_full, flat.axis,
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
                flat.grad_host = to_host(flat.grad_shard, flat.master.device)  # asynchronous from a GPU
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
                start = flat.axis.index * flat.shard_size
                grad = flat.grad_full[start : start + flat.shard_size].copy_(grad)
                flat.grad_shard = None
            else:
                flat.grad_full = None
            flat.master.grad = to_host(grad, flat.master.device) if flat.offload else grad
            flat.grad_shard = None  # the optimizer's .grad holds it now (or its host copy, with offload)
        host_copies_done(self.flats)  # the host optimizer reads the copies next
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
                comm.all_gather(flat.full, flat.shard.clone(), flat.axis)  # input must not alias output
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
            "params": [f.full for f in flats] + [f.shard for f in flats]
                      + [f.half for f in flats if f.half is not None],
            "grads": [f.grad_shard for f in flats] + [f.grad_full for f in flats]
                     + [f.master.grad for f in flats if not f.offload],
            "host": offloaded,
        }

    # -- the technique's hooks: ZeRO's state and gradients in the single-process layout ---------------------------

    loads_own_entries = True  # the parameters go into the flats' shards

    def local_model_state(self, state: dict[str, Tensor], strict: bool) -> dict[str, Tensor]:
        zero_state.load_params(self.flats, state, strict)
        return {k: v for k, v in state.items() if k not in self._module_params}  # buffers load as they are

    def optimizer_names(self, names: list[str]) -> list[str]:
        return [name for group in self.original_groups for name in group]

    def named_groups(self, groups: list[list[str]]) -> list[list[str]]:
        return [list(group) for group in self.original_groups]

    def full_optimizer_state(self, optimizer: Any, state: OptimizerState) -> OptimizerState:
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(self.original_groups[g])}
                  for g, group in enumerate(optimizer.param_groups)]
        return OptimizerState(self.optimizer_names([]), zero_state.gather_optimizer_state(self.flats, optimizer),
                              groups)

    def local_optimizer_state(self, optimizer: Any, state: OptimizerState) -> None:
        if len(state.groups) != len(optimizer.param_groups) or any(
                len(saved["params"]) != len(ours) for saved, ours in zip(state.groups, self.original_groups)):
            raise ValueError(
                "the checkpoint's optimizer has a different set of param groups or parameters than this model's: "
                f"saved {[len(g['params']) for g in state.groups]}, here {[len(g) for g in self.original_groups]}")
        for group, saved in zip(optimizer.param_groups, state.groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        zero_state.load_optimizer_state(self.flats, optimizer, state.per_param)
        return None

    def held_grads(self, grads: list[HeldGrad]) -> list[HeldGrad]:
        """This rank's shard of each flat's gradient, cut at parameter boundaries (a piece of each parameter's)."""
        return [HeldGrad(flat.names[i], flat.params[i], piece,  # (start: where this rank's shard begins in the flat)
                         start=max(flat.offsets[i], flat.axis.index * flat.shard_size) - flat.offsets[i])
                for flat in self.flats if flat.master.grad is not None
                for i, piece in shard_slices(flat, flat.master.grad)]

    def disjoint_axes(self) -> list[Axis]:
        return [self.axis]

    def parameter_buffers(self) -> list[Tensor]:
        return [flat.full for flat in self.flats] + [flat.half for flat in self.flats if flat.half is not None]
