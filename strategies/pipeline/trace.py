"""What one forward of the user's model does, traced once before the model is cut into stages.

Registration order says nothing about when a module runs: a head registered before the blocks, an embedding after
them, or a weight used directly (``x @ self.wte.weight.T``) would put a parameter on a stage that never uses it,
and the stage that does would compute on a zero placeholder. So the first microbatch runs once through the whole
model (every rank still holds all of it) under a ``TorchFunctionMode`` that sees every torch call and the
parameters and buffers passed to it, with forward hooks on the elements of every ``nn.ModuleList`` /
``nn.Sequential``. The calls form one log; read against the list of blocks (`ForwardTrace.blocks`: the outermost
list whose elements ran once each, in order), it says for each parameter and buffer whether it was used before
the blocks, in them, between two of them, or after them. Block arguments other than the hidden states that were
computed from parameters (a timestep or condition embedding, an encoder's output), and block outputs beyond the
hidden states that the forward reads afterwards (an aux loss, a residual stream), are recorded too: the stages
could not reproduce them (`stages.check_trace`). Extra outputs nothing reads (attention weights) are harmless.
Whether the blocks form a plain chain is recorded too (`ForwardTrace.chained`): then a stage between the first and
the last can run its blocks by themselves, without the user's code around them (`stages.StageRunner.run_blocks`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

PRE, BLOCKS, BETWEEN, POST = "before the blocks", "in the blocks", "between two blocks", "after the blocks"


@dataclass
class ForwardTrace:
    """What a traced forward used, and where (phases `PRE`, `BLOCKS`, `BETWEEN`, `POST`)."""

    blocks: str
    uses: dict[str, set[str]] = field(default_factory=dict)  # parameter or buffer name -> phases it was used in
    computed_args: list[str] = field(default_factory=list)  # block arguments computed from parameters
    extra_outputs: list[str] = field(default_factory=list)  # blocks whose outputs beyond the hidden states are read
    # Every block was called with one tensor alone, the previous block's output itself (the first block's: whatever
    # the code before computed), and returned one tensor, under the autocast state and torch-function modes the
    # forward was called in: nothing the user's code does around a middle stage's blocks reaches them.
    chained: bool = False
    # Each block's output as (shape, dtype), in order (None: not one tensor): what a stage ending there sends. A
    # rehearsal's receiver reads it in place of the header it cannot read (`runner.PipelineRunner.traced`).
    outputs: list = field(default_factory=list)

    def phases(self, name: str) -> set[str]:
        return self.uses.get(name, set())


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor, or lists, tuples and dicts of them), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_of(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_of(item)]
    return []


class _Recorder(TorchFunctionMode):
    """Logs which named tensors each torch call reads, and keeps (weakly) the results computed from parameters."""

    def __init__(self, names: dict[int, list[str]], params: set[int], log: list) -> None:
        super().__init__()
        self.names, self.params, self.log = names, params, log
        self.derived: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.extras: dict[int, tuple[torch.Tensor, str, str]] = {}  # block outputs beyond the first: (t, list, index)

    def is_derived(self, value: Any) -> bool:
        return any(id(t) in self.params or id(t) in self.derived for t in tensors_of(value))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = tensors_of(args) + tensors_of(kwargs)
        for t in inputs:
            for name in self.names.get(id(t), ()):
                self.log.append(("use", name))
            if id(t) in self.extras and self.extras[id(t)][0] is t:  # a block's extra output, read later
                self.log.append(("extra", *self.extras[id(t)][1:]))
        if self.is_derived(inputs):
            for t in tensors_of(out):
                self.derived[id(t)] = t
        return out


def candidate_lists(module: nn.Module) -> dict[str, nn.Module]:
    """Every ModuleList / Sequential with at least two elements that hold parameters."""
    return {n: m for n, m in module.named_modules() if n and isinstance(m, (nn.ModuleList, nn.Sequential))
            and sum(1 for child in m if any(True for _ in child.parameters())) >= 2}


def trace_forward(module: nn.Module, run: Callable[[], Any], blocks_name: str | None = None) -> ForwardTrace:
    """Run ``run()`` (one forward of ``module``, e.g. the user's training step on a microbatch, without gradients)
    and read the log against the list of blocks (``blocks_name``, or found)."""
    names: dict[int, list[str]] = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    log: list[tuple] = []
    recorder = _Recorder(names, {id(p) for p in module.parameters()}, log)
    lists = candidate_lists(module) if blocks_name is None else {blocks_name: module.get_submodule(blocks_name)}
    hooks: list = []
    try:
        with torch.no_grad(), recorder:
            ambient = _ambient()  # as the forward is called: the blocks must run in the same (`ForwardTrace.chained`)
            hooks += [hook for name, container in lists.items()
                      for hook in _log_hooks(name, container, recorder, log, ambient)]
            run()
    finally:
        for hook in hooks:
            hook.remove()
    blocks = pick_blocks(log, lists, blocks_name)
    return read_log(log, blocks, len(lists[blocks]))


def _ambient() -> tuple:
    """What decides how torch runs a call besides its arguments: autocast, and the torch-function modes pushed."""
    return (*((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")),
            torch._C._len_torch_function_stack())


def _log_hooks(name: str, container: nn.Module, recorder: _Recorder, log: list, ambient: tuple) -> list:
    last: list = [None]  # the previous element's output (held for the chain check only while the forward runs)

    def enter(index: int):
        def hook(m, args, kwargs):
            extra = [(f"argument {k + 1}", a) for k, a in enumerate(args[1:])] + list(kwargs.items())
            computed = [key for key, value in extra if recorder.is_derived(value)]
            alone = len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)
            chained = alone and (index == 0 or args[0] is last[0]) and _ambient() == ambient
            log.append(("enter", name, index, computed, chained))
        return hook

    def leave(index: int):
        def hook(m, args, kwargs, output):
            if isinstance(output, (tuple, list)):  # what else a block returns matters only if something reads it
                for t in tensors_of(list(output[1:])):
                    recorder.extras[id(t)] = (t, name, index)
            last[0] = output if index < len(container) - 1 else None
            alone = isinstance(output, torch.Tensor)
            log.append(("leave", name, index, alone, (tuple(output.shape), output.dtype) if alone else None))
        return hook

    return [hook for index, child in enumerate(container)
            for hook in (child.register_forward_pre_hook(enter(index), with_kwargs=True),
                         child.register_forward_hook(leave(index), with_kwargs=True))]


def _outermost(log: list) -> list[tuple]:
    """The enter events not nested inside another list element's call."""
    out, open_calls = [], 0
    for event in log:
        if event[0] == "enter":
            if open_calls == 0:
                out.append(event)
            open_calls += 1
        elif event[0] == "leave":
            open_calls -= 1
    return out


def pick_blocks(log: list, lists: dict[str, nn.Module], given: str | None) -> str:
    """The list whose elements the forward ran once each, in order, not inside another list's element: the one
    with the most parameters when several did (``given``, when named, must be such a list)."""
    outer = _outermost(log)
    ran = [n for n, m in lists.items()
           if [e[2] for e in outer if e[1] == n] == list(range(len(m)))
           and [e[2] for e in log if e[0] == "enter" and e[1] == n] == list(range(len(m)))]
    if given is not None and given not in ran:
        raise ValueError(f"pipeline_blocks={given!r}: the forward did not run its elements once each, in order, "
                         f"outside any other list's element")
    if not ran:
        raise ValueError(
            "pipeline parallel cuts the model at its list of blocks, an nn.ModuleList or nn.Sequential whose "
            "elements the forward runs once each, in order; this model's forward ran none. Keep the blocks in "
            "such a list, or name it: PlanStrategy('pp2', pipeline_blocks='model.layers').")
    return given or max(ran, key=lambda n: sum(p.numel() for p in lists[n].parameters()))


def read_log(log: list, blocks: str, size: int) -> ForwardTrace:
    """Phases of every use, with ``blocks`` as the list of blocks."""
    trace, phase, open_calls = ForwardTrace(blocks), PRE, 0
    calls = [e for e in log if e[0] in ("enter", "leave") and e[1] == blocks]
    trace.chained = bool(calls) and all(e[4 if e[0] == "enter" else 3] is True for e in calls)
    trace.outputs = [e[4] for e in calls if e[0] == "leave"]
    for event in log:
        if event[0] == "use":
            trace.uses.setdefault(event[1], set()).add(BLOCKS if open_calls else phase)
        elif event[1] != blocks:
            continue
        elif event[0] == "extra":
            label = f"{blocks}[{event[2]}]"
            if label not in trace.extra_outputs:
                trace.extra_outputs.append(label)
        elif event[0] == "enter":
            open_calls += 1
            trace.computed_args += [f"{blocks}[{event[2]}] {key}" for key in event[3]]
        else:
            open_calls -= 1
            phase = POST if event[2] == size - 1 else BETWEEN
    return trace
