"""ZeRO-3: each rank keeps 1/N of the parameters and gathers a unit's full parameters only around its use.

A unit is a module whose parameters are gathered and released together (the wrapping policy, by default
each element of an ``nn.ModuleList`` / ``nn.Sequential`` — the transformer blocks — and each other module
that owns parameters). Around a unit:

    forward:  pre-hook all-gathers it (and starts gathering the next unit: prefetch), post-hook frees it;
    backward: a hook on its outputs' gradients gathers it again; once all its parameters' gradients are
              in their buckets, it is freed and the buckets are reduce-scattered into the shards.

The units after the last block (the final norm, the head) are kept from their forward into their backward, which
follows at once, and embeddings are not gathered for backward, which needs no weights: the bytes FSDP2 moves.

Freeing resizes the flat's storage to zero and gathering resizes it back and fills it: the parameters are
views of that storage, and so are the tensors autograd saved for backward, which stay valid. Parameters
owned by the root module itself (used outside any child's forward) and parameters shared between units
are kept gathered: ZeRO-2 for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from strategies import comm
from strategies.comm import Axis
from strategies.zero.flat import FlatParam, build_flats
from strategies.zero.sync import ZeroGradSync


def default_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The wrapping policy: blocks (elements of ModuleList/Sequential) first, then the other modules that
    own parameters directly. The root module is never a unit."""
    units: list[tuple[str, nn.Module]] = []
    covered: set[int] = set()
    for name, child in module.named_modules():
        if id(child) in covered or child is module:
            continue
        parent_is_list = isinstance(_parent(module, name), (nn.ModuleList, nn.Sequential))
        if parent_is_list and any(True for _ in child.parameters()):
            units.append((name, child))
            covered.update(id(m) for m in child.modules())
    for name, child in module.named_modules():
        if id(child) in covered or child is module:
            continue
        if any(True for _ in child.parameters(recurse=False)):
            units.append((name, child))
            covered.add(id(child))
    return units


def _parent(root: nn.Module, name: str) -> nn.Module | None:
    if "." not in name:
        return root
    return root.get_submodule(name.rsplit(".", 1)[0])


class Unit:
    """The flats of one module, gathered and freed together. A pinned unit (the root's own and shared
    parameters) stays gathered and is refreshed after each optimizer step. Under a half ``param_dtype``
    (`Zero3GradSync.compute_in`) the gather that computes is of the shards cast to it, into each flat's ``half``
    (FSDP2's ``param_dtype``: half the bytes moved and held); the float32 ``full`` is gathered only for the whole
    state (``whole=True``)."""

    def __init__(self, name: str, module: nn.Module | None, flats: list[FlatParam], pinned: bool = False,
                 block: bool = False) -> None:
        self.name, self.module, self.flats, self.pinned, self.block = name, module, flats, pinned, block
        # Plain embeddings only: a lookup's backward needs the indices, not the weights (torch's embedding_backward
        # reads the weight's row count alone), so the unit is not gathered again for backward (FSDP2's
        # set_unshard_in_backward(False)). A subclass's own forward might use its weight otherwise: gathered.
        self.lookup = module is not None and all(
            isinstance(m, nn.Embedding) and type(m).forward is nn.Embedding.forward
            for m in module.modules() if any(True for _ in m.parameters(recurse=False)))
        self.gathered = True  # the copy forward and backward use (``half`` under a half dtype, else ``full``)
        self.whole = False  # under a half dtype: ``full`` gathered too
        self.half: torch.dtype | None = None
        self.pending: list[comm.Handle] = []
        self._sent: list[torch.Tensor] = []  # the half shards in flight (kept until their gather is done)
        self.params = {id(p) for flat in flats for p in flat.params}
        self.reduced: set[int] = set()

    def compute_in(self, dtype: torch.dtype) -> None:
        """Gather the shards cast to ``dtype`` to compute (their float32 only for the whole state)."""
        self.wait()
        for flat in self.flats:
            flat.half = torch.empty(flat.padded, dtype=dtype, device=flat.full.device)
            flat.half.untyped_storage().resize_(0)
        self.half, self.whole = dtype, self.gathered
        self.gathered = False

    def gather(self, async_op: bool = False, whole: bool = False) -> None:
        half = self.half is not None and not whole
        if (self.whole if self.half is not None and whole else self.gathered):
            if not async_op:
                self.wait()
            return
        for flat in self.flats:
            # (the half flat's ``.data``: a tensor of its own version, so that filling it again for backward is not
            # an in-place change of the views forward computed with and autograd saved, as for the float32 flat)
            into = flat.half.data if half else flat.full
            into.untyped_storage().resize_(flat.padded * into.element_size())
            shard = flat.shard.to(self.half) if half else flat.shard
            self._sent += [shard] if half else []
            self.pending.append(comm.all_gather(into, shard, flat.axis, async_op=True))
        if self.half is not None and whole:
            self.whole = True
        else:
            self.gathered = True
        if not async_op:
            self.wait()

    def wait(self) -> None:
        for handle in self.pending:
            handle.wait()
        self.pending.clear()
        self._sent.clear()

    def release(self) -> None:
        self.wait()
        for flat in self.flats:
            flat.full.untyped_storage().resize_(0)
            if flat.half is not None:
                flat.half.untyped_storage().resize_(0)
        self.gathered = self.whole = False

    @property
    def gathered_bytes(self) -> int:
        """The bytes of the unit gathered to compute (in the half dtype under `compute_in`)."""
        return sum(flat.padded * (flat.full if flat.half is None else flat.half).element_size() for flat in self.flats)

    @property
    def held_bytes(self) -> int:
        """The bytes the unit holds gathered now (the compute copy, and under a half dtype the float32 one too)."""
        # (``whole`` is set under a half dtype only)
        return self.gathered_bytes * self.gathered + sum(flat.padded * flat.full.element_size() for flat in
                                                         self.flats) * self.whole


class _HalfView(torch.autograd.Function):
    """A parameter's view of its unit's gathered half flat, computed with in its place: the gradient goes back to the
    float32 parameter cast up (its storage freed meanwhile: only its shape and dtype are read)."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
        ctx.dtype = param.dtype
        return half.view_as(half)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


class Zero3GradSync(ZeroGradSync):
    """ZeRO-2's gradient path plus the gather/free hooks of the units, with one-unit prefetch."""

    def __init__(self, module: nn.Module, axis: Axis, flats: list[FlatParam], units: list[Unit],
                 find_unused_parameters: bool = False, prefetch: bool = True) -> None:
        super().__init__(module, axis, flats, stage=3, find_unused_parameters=find_unused_parameters)
        self.units, self.prefetch = units, prefetch
        self._unit_of = {pid: unit for unit in units for pid in unit.params}
        self._order: list[Unit] = []  # forward order, recorded on the first forward
        self._recorded = False
        self._kept: set[int] | None = None  # the units kept gathered from forward into backward (`_keeps`)
        self.peak_gathered_bytes = 0
        self._half_of: dict[int, tuple[Unit, FlatParam, int]] = {}  # under `compute_in`
        self._module_hooks = []
        for unit in units:
            if unit.pinned:
                continue
            # first: the gather precedes every other hook on the unit (`ParamDtype` casts the gathered weights)
            self._module_hooks.append(unit.module.register_forward_pre_hook(self._pre_forward(unit), prepend=True))
            self._module_hooks.append(unit.module.register_forward_hook(self._post_forward(unit)))
            unit.release()

    # -- forward ---------------------------------------------------------------------------------------

    def _pre_forward(self, unit: Unit) -> Callable:
        def hook(module, args):
            unit.gather()
            if not self._recorded and unit not in self._order:
                self._order.append(unit)
            self._prefetch(unit, +1)
            self._track_peak()
        return hook

    def _post_forward(self, unit: Unit) -> Callable:
        def hook(module, args, output):
            if not self._keeps(unit):
                unit.release()
            if torch.is_grad_enabled():
                outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                for t in outputs:
                    t.register_hook(self._pre_backward(unit))
            return None
        return hook

    # -- backward --------------------------------------------------------------------------------------

    def _pre_backward(self, unit: Unit) -> Callable:
        def hook(grad):
            self._recorded = True  # a backward means the first forward is over
            # A new backward through this unit (under pipeline parallel, one per microbatch before the step):
            # its parameters' gradients are counted afresh, so it is freed only once this backward is done.
            unit.reduced.clear()
            if not unit.lookup:
                unit.gather()
            self._prefetch(unit, -1)
            self._track_peak()
            return None
        return hook

    def on_param_reduced(self, param: nn.Parameter) -> None:
        unit = self._unit_of.get(id(param))
        if unit is None:
            return
        unit.reduced.add(id(param))
        if unit.reduced >= unit.params and not unit.pinned:  # all its gradients are bucketed: its full params are done
            unit.release()

    def _keeps(self, unit: Unit) -> bool:
        """Whether ``unit`` stays gathered from its forward into its backward, which comes next: the units after the
        last block in forward order (the final norm and the head: torchtitan's [norm, output] group, not resharded
        after forward, and FSDP2's root), or the last unit where no unit follows a block. Known once a forward is
        recorded (the first step frees them all). A model without blocks keeps its last unit only."""
        if not self._recorded or not self._order:
            return False
        if self._kept is None:
            blocks = [i for i, u in enumerate(self._order) if u.block]
            after = blocks[-1] + 1 if blocks else len(self._order)
            self._kept = {id(u) for u in self._order[min(after, len(self._order) - 1):]}
        return id(unit) in self._kept

    def _prefetch(self, unit: Unit, direction: int) -> None:
        if not self.prefetch or unit not in self._order:
            return
        index = self._order.index(unit) + direction
        if 0 <= index < len(self._order) and not (direction < 0 and self._order[index].lookup):
            self._order[index].gather(async_op=True)

    def _track_peak(self) -> None:
        live = sum(u.held_bytes for u in self.units)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, live)

    # -- a half param_dtype (`mixed_precision.ParamDtype`) ------------------------------------------------

    def compute_in(self, dtype: torch.dtype) -> list[nn.Parameter]:
        """Forward and backward compute with the units' parameters gathered in ``dtype`` (`half_weight`): the
        parameters that are, for `ParamDtype.gathered`. The pinned stay float32 (cast where they are used)."""
        halved = [unit for unit in self.units if not unit.pinned and unit.half is None]
        for unit in halved:
            unit.compute_in(dtype)
            self._half_of.update({id(p): (unit, flat, i) for flat in unit.flats for i, p in enumerate(flat.params)})
        return [p for unit in halved for flat in unit.flats for p in flat.params]

    def half_weight(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param`` as its unit's gathered half flat holds it (gradient to ``param``), or None where it is not one."""
        where = self._half_of.get(id(param))
        if where is None:
            return None
        unit, flat, i = where
        if not unit.gathered:  # (used outside its unit's forward: gathered now, as the unit's own hook would)
            unit.gather()
        return _HalfView.apply(param, flat.slot(flat.half, i))

    # -- step ------------------------------------------------------------------------------------------

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.release_all()

    def after_step(self) -> None:
        super().after_step()
        for unit in self.units:
            if unit.pinned:  # kept gathered: refresh from the updated shards
                unit.gathered = False
                unit.gather()

    def release_all(self, units: list[Unit] | None = None) -> None:
        """Every unit (of ``units``) freed but the pinned (after a step, or once the state has been read)."""
        for unit in self.units if units is None else units:
            unit.reduced.clear()
            if (unit.gathered or unit.whole) and not unit.pinned:
                unit.release()

    def gather_all(self) -> None:
        """Every unit gathered (state_dict, the end of training): a normal module again."""
        for unit in self.units:
            unit.gather(whole=True)

    def remove(self) -> None:
        super().remove()
        for hook in self._module_hooks:
            hook.remove()
        self._module_hooks.clear()

    def full_model_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # ``state`` holds views of the flats' storage: gathered, copied out, and freed again. Only the units that
        # hold its entries: a part of the state (`save_pretrained`, one block at a time) gathers that part.
        held = {self._unit_of[id(p)] for n, p in self.named_params if n in state and id(p) in self._unit_of}
        wanted = [unit for unit in self.units if unit in held]
        for unit in wanted:
            unit.gather(whole=True)
        try:
            return {k: v.clone() for k, v in state.items()}
        finally:
            self.release_all(wanted)

    def teardown(self, healthy: bool) -> None:
        if healthy:
            self.gather_all()  # leave a normal module behind: every parameter full again
        self.remove()


def build_units(module: nn.Module, optimizer: torch.optim.Optimizer, axis: Axis, offload: bool,
                units: list[tuple[str, nn.Module]] | None = None, materialise: Callable[[nn.Module], None] | None=None,
                axis_of: dict[str, Axis] | None = None) -> tuple[list[FlatParam], list[Unit]]:
    """Flats and units for ZeRO-3. Flats are returned in reverse registration order, about the order in
    which backward finishes them, since they are reduce-scattered strictly in that order. ``materialise``: for a
    model built on meta (`deferred.Deferred`), each unit is made, flattened, sharded and freed before the next,
    so that set-up holds one whole unit at a time."""
    units = units if units is not None else default_units(module)
    # In the order of the model's parameters, so that reversed (the launch order of the reduce-scatters, strictly
    # kept) it is about backward's: the policy lists the blocks first, and a unit that backward finishes last (the
    # embedding) placed early in the launch order held back every later one, all their full gradients with it.
    position = {id(p): i for i, p in enumerate(module.parameters())}
    units = sorted(units, key=lambda unit: min((position[id(p)] for p in unit[1].parameters()), default=len(position)))
    owner: dict[int, int] = {}
    shared: set[int] = set()
    for u, (_, m) in enumerate(units):
        for p in m.parameters():
            if owner.setdefault(id(p), u) != u:
                shared.add(id(p))  # used by two units: freeing it after one would break the other
    names = {id(p): n for n, p in module.named_parameters()}
    groups = [[names[id(p)] for p in m.parameters() if owner[id(p)] == u and id(p) not in shared]
              for u, (_, m) in enumerate(units)]
    root = [n for n, p in module.named_parameters() if id(p) not in owner or id(p) in shared]
    built = []
    for (name, m), group in zip(units, groups):
        if materialise is not None:
            materialise(m)
        flats = build_flats(module, optimizer, axis, [group], own_shard=True, offload=offload, axis_of=axis_of)[0]
        if flats:
            built.append(Unit(name, m, flats, block=isinstance(_parent(module, name), (nn.ModuleList, nn.Sequential))))
            if materialise is not None:
                built[-1].release()
    if materialise is not None:
        materialise(module)  # what is left on meta: the root's own parameters and those units share
    pinned = build_flats(module, optimizer, axis, [root], own_shard=True, offload=offload, axis_of=axis_of)[0]
    if pinned:
        built.append(Unit("<root>", None, pinned, pinned=True))
    flats = [flat for unit in reversed(built[:-1] if built and built[-1].pinned else built) for flat in unit.flats]
    flats += [flat for unit in built if unit.pinned for flat in unit.flats]
    return flats, built
