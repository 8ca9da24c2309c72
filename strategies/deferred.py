"""Models built on the meta device and materialised by slice: each rank makes only the parameters it keeps.

Under a PlanStrategy, ``configure_model()`` and ``trainer.init_module(empty_init=True)`` build the model's parameters
on the meta device: shapes and no memory (`meta_parameters`). Buffers stay real, since modules compute them in
``__init__`` (rotary frequencies, masks) and no init method makes them again. At set-up each technique materialises
only what its rank keeps (`Deferred`): tensor parallel one layer at a time before it slices it, ZeRO-3 one unit at a
time before it shards it; the pipeline cuts the meta model (its trace runs on meta tensors), so a stage makes its
own layers only; the strategy materialises whatever is left whole.

The same weights under every plan: a module is initialised whole and on its own, with torch's generator seeded by
the run's seed (``PL_GLOBAL_SEED``, set by ``L.seed_everything``) and the module's name under the LightningModule:
first its ``reset_parameters()`` if it has one (what its constructor ran), then the ``_init_weights(module)`` of the
nearest enclosing module that defines one (what ``self.apply(self._init_weights)`` ran: the demo GPT, nanoGPT, every
Hugging Face model). So whichever rank makes a module, and whatever slice it keeps, the values are those one process
under the pack makes. A parameter neither initialised is refused by name: each is filled with NaN before its init.
A weight tied under several names is made once, by its first owner in the model's order. What this rule does not
replay is code that changes weights after construction outside those two methods (nanoGPT's scaled ``c_proj``
init in ``GPT.__init__``): docs/larger-models.md says how to move it into ``_init_weights``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Every parameter a module's constructor registers inside goes to the meta device (a tied one registered again
    keeps its identity); buffers and other tensors are made as usual. Parameters registered outside a constructor
    stay as they are: weights loaded into the model (``from_pretrained``) are values, not shapes to make again."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta" and _in_constructor():
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _in_constructor() -> bool:
    """Whether a module's ``__init__`` registers the parameter: ``self.w = Parameter(...)`` reaches here through
    ``__setattr__`` (two frames up), ``self.register_parameter(...)`` directly (one frame up)."""
    frame = sys._getframe(2)
    for _ in range(2):
        if frame is None:
            return False
        if frame.f_code.co_name == "__init__":
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def shapes_only(module: nn.Module) -> Iterator[None]:
    """Inside, every parameter and buffer of ``module`` is a meta tensor of its shape (the same names, tied ones still
    one): a forward runs on shapes alone, as the pipeline's trace of a meta-built model does once tensor parallel
    made its slices real."""
    saved: list[tuple[dict, str, torch.Tensor]] = []
    twins: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for name, t in list(store.items()):
                if t is None or t.device.type == "meta":
                    continue
                if id(t) not in twins:
                    meta = t.detach().to("meta")
                    twins[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
                saved.append((store, name, t))
                store[name] = twins[id(t)]
    try:
        yield
    finally:
        for store, name, t in saved:
            store[name] = t


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in module.parameters())


LEFT = "_stratpack_left_in_slices"  # on a LightningModule that fit left in slices: the plan it trained under
KEPT = "_stratpack_kept_slices"  # ... and what this rank held of it (`KeptSlices`)


@dataclass
class KeptSlices:
    """What a rank held of a model a fit left in slices, copied to host memory (``boxes``: each name's boxes, as
    `checkpoint.slices.keep_boxes` keeps them), so that the next set-up under the same plan and ranks takes it up
    without a checkpoint: ``trainer.test(model)`` after ``trainer.fit(model)``. ``plan``: as resolved (the schedule
    chosen), so the stages are cut alike; ``groups``: the optimizer's param groups by name (ZeRO's flats follow
    them)."""

    plan: str
    world: int
    rank: int
    boxes: dict[str, list]
    groups: list[list[str]] | None = None


def take_kept(root: nn.Module, plan: Any, world: int, rank: int) -> KeptSlices | None:
    """The slices a fit left this rank of ``root`` (`KeptSlices`), taken off the module, where they were kept under
    ``plan`` (as the user wrote it) at ``world`` ranks; else None, and the module stays marked."""
    kept = getattr(root, KEPT, None)
    if kept is None or (str(getattr(root, LEFT, None)), kept.world, kept.rank) != (str(plan), world, rank):
        return None
    vars(root).pop(LEFT, None)
    vars(root).pop(KEPT, None)
    return kept


def holds_whole_weights(plan: Any) -> bool:
    """Whether each rank of ``plan`` (a resolved `ParallelPlan`) holds every weight whole through a fit: its data
    ranks replicate them (dp, naive, ZeRO-1/2, cp) and nothing splits them (no ZeRO-3, tp, pp or ep)."""
    return plan.data.stage < 3 and plan.tp == 1 and plan.pp == 1 and plan.ep == 1


def leave_in_slices(root: nn.Module, plan: str, kept: KeptSlices | None = None) -> None:
    """The end of a fit of a model built on meta: its weights stay in the slices the ranks held (gathering them
    would put the whole model on every rank, which need not fit), and the module keeps none: every parameter is
    put on meta, so that using it fails loudly instead of computing with a slice, and the module is marked, with
    this rank's slices where they could be ``kept`` (`take_kept`)."""
    made: dict[int, nn.Parameter] = {}
    for module in root.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in made:  # tied: one new parameter for one old
                    made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
                module._parameters[name] = made[id(p)]
    setattr(root, LEFT, plan)
    if kept is not None:
        setattr(root, KEPT, kept)


def refill_left_in_slices(root: nn.Module) -> None:
    """A whole checkpoint loaded strictly into a module a fit left in slices (`leave_in_slices`) refills every weight:
    Lightning's ``test(ckpt_path="best")`` after ``fit``. The module is then as one built on meta and given that
    checkpoint: made whole to take it (before set-up, Lightning's order), and split by the plan at set-up."""
    vars(root).pop(LEFT, None)
    vars(root).pop(KEPT, None)


def refuse_left_in_slices(root: nn.Module) -> None:
    """A clear error for a module whose fit left it in slices (`leave_in_slices`), whatever is asked of it next."""
    plan = getattr(root, LEFT, None)
    if plan is not None:
        raise RuntimeError(
            f"this {type(root).__name__} was trained under '{plan}' from a model built in configure_model: after "
            "fit its weights stay in the slices each rank held (the whole model need not fit on one), and the module "
            "holds none; a set-up under the same plan and ranks takes them up again (each rank kept a host copy), "
            "another cannot. "
            "Save them while fit runs (ModelCheckpoint, or strategies.ExportPretrained for a Hugging Face "
            "directory); to go on, pass ckpt_path=... or use strategies.load_pretrained")


def to_device(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for what is real; parameters still on meta stay there (materialised later)."""
    module._apply(lambda t: t if t.device.type == "meta" else t.to(device))


@contextlib.contextmanager
def meta_safe_cpu(module: nn.Module | None) -> Iterator[None]:
    """Inside, ``module.cpu()`` (Lightning's teardown calls it) moves what is real and leaves what is still on meta,
    where torch would raise "Cannot copy out of meta tensor": after a failure at set-up or in the first step, a model
    built on meta is partly made, and that error would become the last one the user reads."""
    if module is None or not has_meta_parameters(module):
        yield
        return
    module.cpu = lambda: to_device(module, torch.device("cpu")) or module  # (an instance attribute: this call only)
    try:
        yield
    finally:
        del module.cpu


def seed_of(seed: int, name: str) -> int:
    """A stable 63-bit seed for module ``name`` (Python's ``hash`` of a string changes with each process)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


class Deferred:
    """Materialises the meta parameters of a model built by `meta_parameters`, module by module (see the module's
    docstring for the rule). ``root``: the LightningModule, whose names seed each module; ``device``: where the
    parameters are made."""

    def __init__(self, root: nn.Module, device: torch.device, seed: int | None = None) -> None:
        if any(b.device.type == "meta" for b in root.buffers()):
            names = [n for n, b in root.named_buffers() if b.device.type == "meta"]
            raise ValueError(
                f"the model has buffers on the meta device ({', '.join(names[:4])}): nothing can make their values "
                "again. Build it in configure_model() or under trainer.init_module(empty_init=True), where the pack "
                "puts only the parameters on meta and the buffers are computed as usual")
        self.root, self.device = root, device
        self.seed = int(os.environ.get("PL_GLOBAL_SEED", "0")) if seed is None else seed
        self.names = {id(m): name for name, m in root.named_modules()}
        self._init_of = {id(m): _nearest_init(root, name) for name, m in root.named_modules()}
        # Made already (by id: made in place, the same Parameter object): on a meta device (a rehearsal) a made
        # parameter is on meta too, so being on meta does not say it is still to make
        self._made: set[int] = set()
        self._later: dict[int, Callable[[], None]] = {}  # id(module) -> how it is made (`later`)

    def _unmade(self, p: nn.Parameter) -> bool:
        return p.device.type == "meta" and id(p) not in self._made

    def __call__(self, module: nn.Module) -> None:
        """Make every meta parameter under ``module`` (a layer, a block, a unit): each module whole, initialised; a
        module registered by `later` by its own way, unless this rank keeps none of it (another stage's)."""
        self._each(module, _owners(self.root))

    def _each(self, module: nn.Module, owners: dict[int, list[tuple[nn.Module, str]]]) -> None:
        for sub in list(module.modules()):
            unmade = [p for p in sub.parameters(recurse=False) if self._unmade(p)]
            if not unmade:
                continue
            make = self._later.pop(id(sub), None)
            if make is not None and not any(_placeholder(p) for p in unmade):
                make()
            else:
                self._make(sub, owners)

    def unmade(self, module: nn.Module) -> bool:
        """Whether each of ``module``'s own parameters is still to make (and it has some)."""
        params = list(module.parameters(recurse=False))
        return bool(params) and all(self._unmade(p) for p in params)

    def later(self, module: nn.Module, make: Callable[[], None]) -> None:
        """``module``, which a technique built on meta from the model's own modules (tensor parallel's slice of a
        layer), is made by ``make()`` when this rank makes it: under pp only on the stage that keeps it."""
        self._later[id(module)] = make

    def apart(self, module: nn.Module) -> None:
        """Make ``module`` whole and initialised as `__call__` would, where a technique took it out of the model (the
        user's layer behind a tp slice: its name is still the one it had in the model)."""
        self._each(module, _owners(module))

    def fill(self, module: nn.Module, values: dict[str, torch.Tensor]) -> None:
        """``module``'s meta parameters take ``values`` (by attribute), in place, and count as made."""
        for attr, value in values.items():
            p = module._parameters[attr]
            torch.utils.swap_tensors(p, nn.Parameter(value.detach(), p.requires_grad))
            self._made.add(id(p))

    def rest(self) -> None:
        """Make whatever is still on meta: the parameters of this rank's part that no technique sliced."""
        self(self.root)

    def tied(self) -> None:
        """Make the weights tied under several names (before the pipeline cut, which sends the first stage's copy
        of such a weight to the last stage)."""
        owners = _owners(self.root)
        for group in list(owners.values()):
            if len(group) > 1 and any(self._unmade(m._parameters[a]) for m, a in group):
                self._make(group[0][0], owners)

    def _make(self, module: nn.Module, owners: dict[int, list[tuple[nn.Module, str]]]) -> None:
        mine: list[tuple[str, nn.Parameter]] = []  # the parameters this module initialises: those it owns first
        for attr, p in list(module._parameters.items()):
            if p is None:
                continue
            first = owners[id(p)][0][0]
            if first is not module and self._unmade(p):
                self._make(first, owners)  # a tied weight: its first owner makes it, for every name of it
            if _placeholder(p):  # another pipeline stage's: its one-element stand-in, made here, no init
                if self._unmade(p):
                    torch.utils.swap_tensors(p, nn.Parameter(
                        torch.zeros((), dtype=p.dtype, device=self.device).expand(p.shape), requires_grad=False))
                    self._made.add(id(p))
                continue
            if self._unmade(p):
                # In place (the same Parameter object): the optimizer Lightning built and every tied name keep it.
                fill = float("nan") if p.is_floating_point() else 0
                made = nn.Parameter(torch.full(p.shape, fill, dtype=p.dtype, device=self.device), p.requires_grad)
                torch.utils.swap_tensors(p, made)
                self._made.add(id(p))
            if first is module:
                mine.append((attr, p))
        if mine:
            self._initialise(module, mine)

    def _initialise(self, module: nn.Module, mine: list[tuple[str, nn.Parameter]]) -> None:
        """Run ``module``'s init on its own parameters, seeded by its name; parameters another module owns first (a
        tied weight) are swapped for scratch copies meanwhile, so that only their owner's init counts."""
        name = self.names.get(id(module), type(module).__name__)
        kept = {attr for attr, _ in mine}
        swapped = {attr: p for attr, p in module._parameters.items() if p is not None and attr not in kept}
        for attr, p in swapped.items():
            module._parameters[attr] = nn.Parameter(torch.empty_like(p, device=self.device), p.requires_grad)
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                torch.manual_seed(seed_of(self.seed, name))
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
                init = self._init_of.get(id(module))
                if init is not None:
                    init(module)
        finally:
            module._parameters.update(swapped)
        if self.device.type == "meta":  # a rehearsal (`strategies.rehearse`): shapes only, no values to check
            return
        missed = [attr for attr, p in mine if p.is_floating_point() and bool(torch.isnan(p).any())]
        if missed:
            raise ValueError(
                f"{name} ({type(module).__name__}): parameter(s) {', '.join(missed)} were built on the meta device and "
                "neither its reset_parameters() nor an enclosing module's _init_weights(module) gives them values. "
                "Give the module a reset_parameters() that initialises them (torch's layers have one), or handle "
                "its type in your model's _init_weights; or build the model outside configure_model")


def _placeholder(p: nn.Parameter) -> bool:
    """A pipeline placeholder made on meta (`pipeline.stages`): one element expanded to the parameter's shape."""
    return p.device.type == "meta" and p.numel() > 1 and all(stride == 0 for stride in p.stride())


def _nearest_init(root: nn.Module, name: str):
    """The ``_init_weights`` of the nearest module enclosing ``name`` (itself included) that defines one, bound."""
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):
        owner = root.get_submodule(".".join(parts[:depth]))
        init = getattr(owner, "_init_weights", None)
        if callable(init):
            return init
    return None


def _owners(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (module, attribute) that holds each parameter, the first in the model's order first. (The walk is
    ``named_modules(remove_duplicate=False)``'s order without its nested generators: it runs once per module made,
    and at Llama 3 405B's 2,000 modules the generators took 2.7 of a rehearsal's 20 s.)"""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    stack = [root]
    while stack:
        module = stack.pop()
        for attr, p in module._parameters.items():
            if p is not None and not any(m is module and a == attr for m, a in owners.setdefault(id(p), [])):
                owners[id(p)].append((module, attr))
        stack.extend(child for child in reversed(module._modules.values()) if child is not None)
    return owners
