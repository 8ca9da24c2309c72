"""The interface every technique a plan applies implements, so that the Lightning adapter is a loop over them.

A technique splits the model, its gradients or its optimizer state over one axis of the mesh (data parallel's
gradient sync, ZeRO, tensor parallel, the pipeline), or changes how the model runs (activation checkpointing).
The strategy applies them in one order, which is the order of its list:

    context parallel -> tensor parallel -> expert parallel -> activation checkpointing -> pipeline -> data parallel or
    ZeRO (which shards the optimizer)

Whatever goes towards the single-process layout walks the list backwards, each technique undoing its own split
of what the one after it handed over: saving the model and optimizer state, the gradients clipping sees, the
end of a backward, teardown. Whatever comes from the single-process layout (loading state) walks it forwards.
Every method has a default that leaves things as they are, so a technique states only what it changes.

States travel keyed by name: the model's as its ``state_dict`` keys, the optimizer's as `OptimizerState`, whose
entries are keyed by parameter name, not by index, so that stages, slices and shards of one parameter meet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from strategies.comm import Axis


class HeldGrad(NamedTuple):
    """A gradient this rank holds: all of parameter ``name``'s, or a piece of it (a ZeRO shard's slice, beginning at
    element ``start`` of the flattened parameter). ``split``: the axis whose ranks hold the other slices of it (tensor
    parallel), else None. ``counted``: False for a copy another rank holds too (a weight tied across pipeline
    stages): clipping scales it but counts it in the norm once, where it is True."""

    name: str
    param: nn.Parameter
    grad: Tensor
    split: Axis | None = None
    start: int = 0
    counted: bool = True


@dataclass
class OptimizerState:
    """One optimizer's state keyed by parameter name: what ``optimizer.state_dict()`` holds, with names for indices.

    ``names`` is the single-process optimizer's parameter order (its state_dict indices); ``per_param`` each
    parameter's entries (``exp_avg``, ``step``...); ``groups`` each param group's hyperparameters, with
    ``params`` as names."""

    names: list[str]
    per_param: dict[str, dict[str, Any]]
    groups: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, module: nn.Module, optimizer: Any) -> OptimizerState:
        """The state of an optimizer over ``module``'s own parameters (as Lightning made it)."""
        return cls.from_state_dict(optimizer.state_dict(), optimizer_names(module, optimizer))

    @classmethod
    def from_state_dict(cls, saved: dict[str, Any], names: list[str]) -> OptimizerState:
        """``saved`` (``optimizer.state_dict()``'s format, e.g. a checkpoint's) read with ``names`` for its indices."""
        states = {int(k): v for k, v in saved["state"].items()}
        if any(k >= len(names) for k in states):
            raise ValueError(f"the checkpoint's optimizer holds states for {max(states) + 1} parameters, this "
                             f"model's optimizer has {len(names)}: it was saved from a different model")
        groups = [{**group, "params": [names[i] for i in group["params"]]} for group in saved["param_groups"]]
        return cls(list(names), {names[k]: dict(v) for k, v in states.items()}, groups)

    def state_dict(self) -> dict[str, Any]:
        """``optimizer.state_dict()``'s format: entries by index in ``names``, in that order."""
        index = {name: k for k, name in enumerate(self.names)}
        state = {index[name]: self.per_param[name] for name in sorted(self.per_param, key=index.__getitem__)}
        groups = [{**group, "params": [index[n] for n in group["params"]]} for group in self.groups]
        return {"state": state, "param_groups": groups}

    def with_entries(self, per_param: dict[str, dict[str, Any]]) -> OptimizerState:
        return replace(self, per_param=per_param)


def optimizer_names(module: nn.Module, optimizer: Any) -> list[str]:
    """The name of each parameter of ``optimizer``, in the order of its state_dict's indices."""
    name_of = {id(p): n for n, p in module.named_parameters()}
    names = [name_of.get(id(p), f"<unnamed {i}>")
             for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])]
    # A tensor given to the optimizer twice keeps both of its indices apart.
    return [n if n not in names[:i] else f"{n} (index {i})" for i, n in enumerate(names)]


@contextlib.contextmanager
def outside_all(techniques: list[Technique]) -> Iterator[None]:
    """Inside, the process runs as without any of ``techniques`` (`Technique.outside`)."""
    with contextlib.ExitStack() as stack:
        for technique in techniques:
            stack.enter_context(technique.outside())
        yield


class Technique:
    """One technique of a plan, applied to the model when the strategy is set up. The defaults change nothing."""

    loads_own_entries = False
    """Model state: whether `local_model_state` loads some entries itself (or leaves them to other ranks), so the
    module loads the rest leniently; such a technique checks its own entries."""

    compiles_blocks = False
    """Whether the blocks run as compiled graphs, whose ``F.linear`` calls no Python patch reaches (the zero-bubble
    schedules split their backwards there)."""

    # -- state: local layout <-> single-process layout (every rank calls these; they may be collectives) ----------

    def full_model_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """``state`` (the techniques applied after this one already undone) in this technique's full layout."""
        return state

    def local_model_state(self, state: dict[str, Tensor], strict: bool) -> dict[str, Tensor]:
        """The part of a single-process ``state`` this rank's module loads, in this technique's layout; entries it
        loads itself are taken out (see `loads_own_entries`)."""
        return state

    def optimizer_names(self, names: list[str]) -> list[str]:
        """The single-process optimizer's parameter order, where this technique rebuilt the optimizer."""
        return names

    def full_optimizer_state(self, optimizer: Any, state: OptimizerState) -> OptimizerState:
        return state

    def named_groups(self, groups: list[list[str]]) -> list[list[str]]:
        """The single-process optimizer's param groups by parameter name, in its order, where this technique rebuilt
        the optimizer (ZeRO's flats); ``groups``: as the optimizer holds them now."""
        return groups

    # -- state by slice: what this rank holds, placed in the single-process layout (`checkpoint.slices`) ----------

    def sliced_flats(self) -> list:
        """The flats whose shards this rank holds (`zero.flat.FlatParam`; ZeRO's), each saved as its boxes."""
        return []

    def holds(self, name: str) -> bool:
        """Whether this rank holds parameter ``name`` (a pipeline stage holds its own only)."""
        return True

    def holds_buffer(self, name: str) -> bool:
        """Whether this rank's copy of buffer ``name`` is the one in use (a pipeline stage's: its blocks' own), which a
        save by slice writes."""
        return True

    def place_box(self, name: str, box: Any) -> Any:
        """``box`` (`slices.Boxed`, laid out as parameter ``name`` is on this rank, or its optimizer state) placed
        where this technique's split put it in the whole tensor (tensor parallel's slices)."""
        return box

    def after_slice_load(self) -> None:
        """After this rank's boxes were filled in place from a checkpoint (`slices.load_state`): remake what this
        technique derives from them (ZeRO's full parameters from the loaded shards)."""

    def local_optimizer_state(self, optimizer: Any, state: OptimizerState) -> OptimizerState | None:
        """This rank's part of ``state``; None once this technique has loaded it into ``optimizer`` itself."""
        return state

    # -- gradients and steps -----------------------------------------------------------------------------

    def local_batch(self, batch: Any) -> Any:
        """This rank's part of a step's ``batch`` (context parallel: its chunks of each sequence)."""
        return batch

    def step_output(self, output: Any) -> Any:
        """The training step's ``output`` as the strategy returns it to Lightning."""
        return output

    def held_grads(self, grads: list[HeldGrad]) -> list[HeldGrad]:
        """The gradients this rank holds, given those the techniques applied before it hold."""
        return grads

    def split_axes(self) -> list[Axis]:
        """Axes over which this technique splits some gradients (`HeldGrad.split`): their pieces are summed over
        it for the gradient's norm, the others counted once."""
        return []

    def disjoint_axes(self) -> list[Axis]:
        """Axes whose ranks hold disjoint parts of the whole gradient (summed over them for its norm)."""
        return []

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Inside, the process runs as without this technique: a whole copy of the model computes one process's
        loss (the first-batch check). Only a technique that changes the process, not just the model, acts here."""
        yield

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate locally: nothing is communicated until a backward outside."""
        yield

    def finish_backward(self, held_grads: Callable[[], list[HeldGrad]], sync: bool) -> None:
        """After every backward; ``sync``: outside `no_sync`, so the technique leaves its gradients complete (an
        accumulation micro-step's backward has ``sync`` False)."""

    def after_step(self) -> None:
        """After the optimizer step."""

    def memory_tensors(self) -> dict[str, list[Tensor]]:
        """Tensors this technique holds beside the module's, by memory category (`strategies.measure.memory`)."""
        return {}

    def parameter_buffers(self) -> list[Tensor]:
        """Buffers that hold parameters (not activations, though autograd saves them)."""
        return []

    def compute_in(self, dtype: torch.dtype) -> list[nn.Parameter]:
        """Under the strategy's half ``param_dtype``: the parameters whose copies in ``dtype`` this technique makes
        itself (ZeRO-3 gathers them in it), each given by `half_weight` while its module computes."""
        return []

    def half_weight(self, param: Tensor) -> Tensor | None:
        """``param``'s copy in the half dtype (`compute_in`), its gradient going to ``param``."""
        return None

    # -- the end ----------------------------------------------------------------------------------------------

    def teardown(self, healthy: bool) -> None:
        """Give the user back the module as written. ``healthy``: no rank failed, so this may talk to the others;
        after a failure only local undoing (hooks), since the other ranks may be gone or stuck elsewhere."""

    def leave_in_slices(self) -> None:
        """After ``teardown(False)`` of a fit that went well on a model built on meta, whose weights stay in the ranks'
        slices (`deferred.leave_in_slices`): give back the module's structure as written (the user's layers), no
        weights, nothing said to the other ranks."""
