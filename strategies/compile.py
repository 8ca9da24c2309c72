"""``torch.compile`` under every plan: each block's forward compiled, the techniques' hooks left outside it.

The plans hook into the model around each block: ZeRO-3 gathers a block's parameters in a forward pre-hook and
frees them after, tensor parallel's split layers call collectives (counted by `comm`), the pipeline swaps the list
of blocks and ends a stage with an exception from a hook, sequence parallel splits the first block's input.
Compiled as one graph, a model would have dynamo trace those hooks (ZeRO-3's placeholders then look like a change
of shape, "TODO: dynamic shapes"). Compiled per block, as torchtitan and FSDP2 do, each block's ``forward`` is one
graph while ``nn.Module.__call__`` still runs the hooks in Python, so every plan keeps working unchanged. The
forward that is compiled is whatever the block runs, activation checkpointing's wrapper included (the order
torchtitan uses); the collectives of tensor parallel's layers run eagerly (`comm` is kept out of graphs), so the
graph breaks there.

A user's own compile is moved to the blocks in the same way, keeping its settings: ``self.model =
torch.compile(net)`` (its ``OptimizedModule`` then runs ``net`` eagerly, so parameter names keep their
``_orig_mod.`` prefix) and ``net.compile()``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from strategies.technique import Technique


def user_compiled(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules (the root included) the user compiled: ``torch.compile(m)`` or ``m.compile()``."""
    from torch._dynamo.eval_frame import OptimizedModule

    return [(name, m) for name, m in module.named_modules()
            if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None]


def compiler(options: bool | dict | None, module: nn.Module) -> tuple[Callable[[Callable], Callable] | None, Callable]:
    """What compiles a block's forward, and what puts the user's own compile back (at teardown): the strategy's
    ``compile`` option (True, or torch.compile's keyword arguments), else the user's own compile found in
    ``module``, which is undone there (it moves to the blocks); None when nothing is to be compiled."""
    from torch._dynamo.eval_frame import OptimizedModule

    found = user_compiled(module)
    contexts = [m.dynamo_ctx if isinstance(m, OptimizedModule) else _context_of(m._compiled_call_impl)
                for _, m in found]
    contexts = [c for c in contexts if c is not None]
    saved = [(m, vars(m).get("forward") if isinstance(m, OptimizedModule) else m._compiled_call_impl)
             for _, m in found]
    for m, _ in saved:  # eager again at that level: the blocks are compiled instead
        if isinstance(m, OptimizedModule):
            m.forward = m._orig_mod.__call__
        else:
            m._compiled_call_impl = None

    def undo() -> None:
        for m, value in saved:
            if isinstance(m, OptimizedModule):
                m.forward = value
            else:
                m._compiled_call_impl = value

    if options:
        kwargs = options if isinstance(options, dict) else {}
        return (lambda fn: torch.compile(fn, **kwargs)), undo
    if contexts:
        return contexts[0], undo  # the user's backend and mode, as Lightning's `from_compiled` reuses them
    if found:
        warnings.warn("could not read the settings of the model's own compile (torch's internals moved): its blocks "
                      "are compiled with torch.compile's defaults; pass PlanStrategy(compile={...}) to choose",
                      stacklevel=2)
    return ((lambda fn: torch.compile(fn)) if found else None), undo


def _context_of(compiled: Callable) -> Callable | None:
    """The dynamo context (backend, mode, options) ``m.compile(...)`` wrapped ``m._call_impl`` in: found in the
    wrapper's closure (torch keeps no public handle on it), or None."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, _TorchDynamoContext):
            return value
    return None


class CompiledBlocks(Technique):
    """Every element of ``blocks`` runs a compiled ``forward``; the original comes back at teardown."""

    compiles_blocks = True

    def __init__(self, blocks: nn.Module, compile_fn: Callable[[Callable], Callable],
                 undo: Callable[[], None] = lambda: None) -> None:
        self.blocks, self._undo = list(blocks), undo
        self._previous: list[Any] = []
        for block in self.blocks:
            own = vars(block).get("forward")  # activation checkpointing's wrapper, if any
            self._previous.append(own)
            block.forward = compile_fn(own if own is not None else block.forward)

    def teardown(self, healthy: bool) -> None:
        for block, own in zip(self.blocks, self._previous, strict=True):
            if own is None:
                vars(block).pop("forward", None)
            else:
                block.forward = own
        self._undo()  # the user's own compile, where it was
        self.blocks, self._previous, self._undo = [], [], lambda: None  # a second teardown changes nothing


def compile_blocks(module: nn.Module, options: bool | dict | None, blocks_name: str | None = None,
                   ) -> CompiledBlocks | None:
    """Compile ``module``'s blocks (the list pipeline parallel cuts) as ``options`` or the user's own compile
    says; None when neither asks for it. Apply it after activation checkpointing."""
    from strategies.pipeline.stages import find_blocks

    if not options and not user_compiled(module):
        return None
    try:  # before anything changes: a model without a list of blocks keeps the user's own compile, whole
        blocks = module.get_submodule(find_blocks(module, blocks_name))
    except ValueError as err:
        if not options:
            return None
        raise ValueError(f"compile={options!r} compiles the model one block at a time, and found no list of blocks "
                         f"({err}); compile the model yourself instead (torch.compile(model) in the "
                         "LightningModule)") from err
    compile_fn, undo = compiler(options, module)
    return CompiledBlocks(blocks, compile_fn, undo) if compile_fn is not None else None
