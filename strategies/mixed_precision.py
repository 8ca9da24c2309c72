"""Mixed precision owned by the strategy: under Lightning's ``*-mixed`` precision, each weight is cast to the half
dtype once per training step, and that copy serves every microbatch and every recompute inside the step.

Lightning runs each training_step call inside ``torch.autocast(..., cache_enabled=False)`` (MEMORY-NOTES): each matmul
casts its float32 weight again and saves that copy for backward. Under pipeline parallel each microbatch is its own
call, so every microbatch in flight held a half copy of its chunk's weights (about 0.8 GiB per layer at 405B, tp8).
`share_casts` turns the plugin's autocast cache on, and `step_casts`, entered around the strategy's training step, holds
autocast's nesting from the step's start to its end: torch keeps each cast of a float32 leaf that requires grad (a
parameter: ZeRO-3's too, which stays one tensor while its storage is gathered and freed) until the outermost autocast
exits, here the step. The values are those of per-call casts (the same rounding of the same weight), so losses and
gradients are Lightning's bf16-mixed ones; each microbatch's backward returns its own gradient through the cast, and
gradients still accumulate in float32. (One difference: a weight that feeds two matmuls of one forward now has one
copy, so their two gradients meet in the half dtype before the cast back.)

Where a block is recomputed (activation checkpointing: `uncached`), its casts are not kept: its forward saves none, and
a kept copy would be held from the first microbatch to the step's end. Under the zero-bubble schedules the blocks'
linears cast their weights through `shared_cast` (`pipeline.weights`: the deferred ones, and those of a forward whose
W runs inside its B), so both kinds of microbatch share one copy; a rehearsal's meta tensors, which torch's autocast
leaves alone, through `tensors.MetaAutocast`, which asks `shared_cast` too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

_SHARING = [0]  # depth of `step_casts`
_CASTS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (weight, its half copy), this step


def share_casts(precision_plugin: Any) -> bool:
    """Have Lightning's mixed-precision plugin autocast with its cache on (an attribute of the instance shadows its
    method); False, and nothing changed, where the plugin autocasts nothing (true precisions, or another plugin)."""
    precision = getattr(precision_plugin, "precision", "")
    if not hasattr(type(precision_plugin), "autocast_context_manager") or precision not in ("bf16-mixed", "16-mixed"):
        return False
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16  # (as Lightning's own)

    def cached() -> torch.autocast:
        return torch.autocast(precision_plugin.device, dtype=dtype, cache_enabled=True)

    precision_plugin.autocast_context_manager = cached
    return True


def unshare_casts(precision_plugin: Any) -> None:
    vars(precision_plugin).pop("autocast_context_manager", None)


@contextlib.contextmanager
def step_casts() -> Iterator[None]:
    """One training step: the casts made inside it are kept to its end (autocast's nesting held, `shared_cast`)."""
    torch.autocast_increment_nesting()
    _SHARING[0] += 1
    try:
        yield
    finally:
        _SHARING[0] -= 1
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        if _SHARING[0] == 0:
            _CASTS.clear()


@contextlib.contextmanager
def uncached() -> Iterator[None]:
    """Casts made inside are not kept (a recomputed block's: see the module's docstring)."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


def shared_cast(weight: torch.Tensor, dtype: torch.dtype, param: torch.Tensor | None = None) -> torch.Tensor:
    """``weight`` in ``dtype``: inside `step_casts`, with autocast's cache on, made once per step, as torch's cache
    makes it for a float32 leaf that requires grad (not under no_grad, whose copy would have no graph), else made now.
    ``param``: ``weight`` is that parameter detached (a zero-bubble linear's, `pipeline.weights`), and gets the step's
    copy detached: one storage for both."""
    detached = param is not None
    param = weight if param is None else param
    keep = (_SHARING[0] > 0 and torch.is_autocast_cache_enabled() and (detached or torch.is_grad_enabled())
            and param.dtype == torch.float32 and param.is_leaf and param.requires_grad and dtype != torch.float32)
    if not keep:
        return weight.to(dtype)
    held = _CASTS.get(id(param))
    if held is None or held[0] is not param or held[1].dtype != dtype:
        with torch.enable_grad():  # (a custom function's forward runs without grad)
            held = _CASTS[id(param)] = (param, param.to(dtype))
    return held[1].detach() if detached else held[1]


def standing_for(weight: torch.Tensor) -> torch.Tensor:
    """The parameter ``weight`` computes for: itself, or the float32 parameter whose half copy another technique
    gathered and `ParamDtype` swapped in for the call (ZeRO-3's), which a zero-bubble linear defers the gradient of."""
    return getattr(weight, "stands_for", weight)


def _cast_by_autocast(module: nn.Module) -> tuple[str, ...]:
    """The parameters of ``module`` autocast casts at its matmul (once per step under `step_casts`): a linear layer's
    weight and bias (torch's, a ``transformers`` ``Conv1D``); what a layer of the pack's names in its class's
    ``autocast_casts`` (tensor parallel's: a row-parallel layer adds its bias after the reduction, outside the
    matmul)."""
    if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
        return ("weight", "bias")
    return getattr(type(module), "autocast_casts", ())


def _embeds(module: nn.Module) -> bool:
    """An embedding: torch's, or a layer of the pack's whose class says so (tensor parallel's vocabulary-split one)."""
    return isinstance(module, nn.Embedding) or getattr(type(module), "embeds", False)


class ParamDtype:
    """The strategy's ``param_dtype`` (FSDP2's, Megatron's half weights): under autocast every module computes with
    ``dtype`` copies of its float32 parameters, made once per step (`shared_cast`), while the float32 parameters stay
    what the optimizer steps and what gradients accumulate into (each copy's backward casts its gradient back). What
    autocast leaves in float32 then computes in ``dtype`` too: the embedding's output (cast itself: the same values),
    so the residual stream between the blocks and what each block keeps of it, and the norms' weights (the norms still
    compute in float32 where autocast or the model puts them, as do softmax and the loss). The linears' weights
    autocast casts anyway, to the same values, so they are left to it (a zero-bubble schedule's deferred linears keep
    finding their parameters).
    Swapped in a forward pre-hook, put back in a forward hook that runs on errors too; a recomputed block's forward
    swaps again."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype, self._model, self._saved = dtype, model, {}
        self.handles, self._names = [], {}
        self._halves: dict[int, Callable[[torch.Tensor], torch.Tensor | None]] = {}  # id(param) -> its maker
        for module in model.modules():
            if _embeds(module):
                # its output cast, not its weight: the same rows, rounded the same, without a half copy of a whole
                # vocabulary held for the step (3.9 GiB at 405B); its gradient's rows then summed in float32
                self.handles.append(module.register_forward_hook(self._half_output))
                continue
            left = _cast_by_autocast(module)
            self._hook(module, [n for n, p in module._parameters.items() if p is not None and p.dtype == torch.float32
                                and n not in left])

    def _hook(self, module: nn.Module, names: list[str]) -> None:
        if names and id(module) not in self._names:
            self.handles += [module.register_forward_pre_hook(self._swap),
                             module.register_forward_hook(self._back, always_call=True)]
        if names:
            self._names[id(module)] = list(dict.fromkeys(self._names.get(id(module), []) + names))

    def gathered(self, params: list[nn.Parameter], make: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """``params`` have their half copies made by another technique (ZeRO-3 gathers them in half, `make` gives the
        gathered copy): each module computes with those, its linears' and embeddings' too (their float32 storage
        is not gathered)."""
        self._halves.update(dict.fromkeys((id(p) for p in params), make))
        for module in self._model.modules():
            self._hook(module, [n for n, p in module._parameters.items() if p is not None and id(p) in self._halves])

    def _swap(self, module: nn.Module, args: Any) -> None:
        depth, saved = self._saved.setdefault(id(module), [0, {}])
        self._saved[id(module)][0] = depth + 1
        if depth:  # called inside its own forward: swapped already
            return
        for name in self._names[id(module)]:
            saved[name] = p = module._parameters[name]
            make = self._halves.get(id(p))
            half = make(p) if make is not None else None
            if half is not None:  # (the gathered copy names what it computes for: `standing_for`)
                half.stands_for = p
            # (a tensor, not a Parameter: for this call)
            module._parameters[name] = half if half is not None else shared_cast(p, self.dtype)

    def _half_output(self, module: nn.Module, args: Any, output: Any) -> Any:
        return output.to(self.dtype) if isinstance(output, torch.Tensor) and output.dtype == torch.float32 else None

    def _back(self, module: nn.Module, args: Any, output: Any) -> None:
        entry = self._saved.get(id(module))
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            module._parameters.update(self._saved.pop(id(module))[1])

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def check_param_dtype(options: Any, precision_plugin: Any) -> None:
    """``param_dtype`` is autocast's dtype under Lightning's matching ``*-mixed`` precision, on eager blocks."""
    precision = str(getattr(precision_plugin, "precision", ""))
    wanted = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}[options.param_dtype]
    if precision != wanted:
        raise ValueError(f"param_dtype={options.param_dtype} computes with half copies of the weights under autocast: "
                         f"it needs precision='{wanted}' (this Trainer's is '{precision}'); or leave param_dtype=None")
    if options.compile:
        raise ValueError("param_dtype swaps each module's weights for their half copies in forward hooks, which "
                         "torch.compile'd blocks do not run as eager modules do: use compile=False with param_dtype, "
                         "or param_dtype=None (autocast alone) with compile")
