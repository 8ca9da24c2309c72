"""Sequence parallel over the blocks of a tensor-parallel model.

The region is the list of blocks that holds the tensor-parallel layers (``blocks`` of a GPT, ``layers`` of
a Llama). Its input is split along the sequence when the first block runs (`enter_sequence_parallel`)
and gathered again when the last one returns (`leave_sequence_parallel`); embeddings before it and the
final norm and head after it stay replicated, as without sequence parallel. Inside it, every split layer
switches its all-reduce for an all-gather / reduce-scatter pair (`tensor_parallel`).

What changes for the replicated parameters inside the region (norms, a row-parallel bias): each rank
now sees only its slice of the sequence, so its gradient is a partial sum over that slice. The full
gradient is their sum over the tensor-parallel ranks: `reduce_partial_grads`, once per optimizer step
(after data-parallel sync: both are sums, so the order does not matter).

With ``overlap`` (the plan's ``async``) each gather and reduce-scatter runs by pieces beside the matmuls it feeds
(`overlap`): a module that gathers for its column layers computes their outputs beside its gather and leaves each
layer its output (``ready``), which the layer returns when the module's forward calls it on the gathered input; a
layer the forward calls on anything else computes as without async (the outputs made beside the gather then unused).
"""

from __future__ import annotations

import torch
from torch import nn

from strategies import comm
from strategies.comm import Axis
from strategies.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    enter_sequence_parallel,
    gather_sequence,
    leave_sequence_parallel,
)
from strategies.tensor_parallel.overlap import gather_project


def find_region(module: nn.Module, layer_names: list[str]) -> tuple[str, nn.ModuleList | nn.Sequential]:
    """The one ModuleList/Sequential whose elements hold every split layer; a clear error otherwise."""
    found: dict[str, nn.Module] = {}
    for name in layer_names:
        parts = name.split(".")
        for i, part in enumerate(parts):
            prefix = ".".join(parts[:i])
            container = module.get_submodule(prefix) if prefix else module
            if part.isdigit() and isinstance(container, (nn.ModuleList, nn.Sequential)):
                found.setdefault(prefix, container)
                break
        else:
            found.setdefault(f"<{name} is in no list of blocks>", module)
    if len(found) != 1 or next(iter(found)).startswith("<"):
        raise ValueError(
            "sequence parallel splits the sequence over one list of blocks (an nn.ModuleList or nn.Sequential "
            f"whose elements hold every tensor-parallel layer); the split layers {layer_names[:6]} sit in "
            f"{sorted(found)}. Drop 'sp', or keep the blocks in one ModuleList."
        )
    return next(iter(found.items()))


def _gathering_modules(module: nn.Module, found: dict, region_name: str) -> set[str]:
    """The modules that gather the sequence for the column layers they hold: each module that holds a split layer
    and sits inside a block (an attention or MLP module). A split layer held by the block itself gathers its own
    input."""
    out = set()
    for name in found:
        parent = name.rpartition(".")[0]
        inside = parent.removeprefix(f"{region_name}.") if region_name else parent
        if "." in inside and any(isinstance(module.get_submodule(n), ColumnParallelLinear)
                                 for n in found if n.rpartition(".")[0] == parent):
            out.add(parent)
    return out


class SequenceParallel:
    """Turns sequence parallel on for the tensor-parallel layers ``found`` (name -> style) of ``module``."""

    def __init__(self, module: nn.Module, found: dict, split_param_ids: set[int], axis: Axis, dim: int = 1,
                 overlap: bool = False):
        self.axis, self.dim, self.overlap = axis, dim, overlap
        self.region_name, region = find_region(module, list(found))
        self.layers = [module.get_submodule(n) for n in found]
        blocks = list(region)
        gathering = _gathering_modules(module, found, self.region_name)
        for name in found:
            layer = module.get_submodule(name)
            if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                layer.sequence_parallel = "async" if overlap else True
            if isinstance(layer, ColumnParallelLinear) and name.rpartition(".")[0] in gathering:
                layer.sequence_parallel = "gathered"
        # each gathering module's column layers, which compute beside its gather under overlap
        self.columns = {id(module.get_submodule(g)): [module.get_submodule(n) for n in found
                                                      if n.rpartition(".")[0] == g
                                                      and isinstance(module.get_submodule(n), ColumnParallelLinear)]
                        for g in gathering}
        # Replicated parameters inside the region: their gradients are partial sums over the sequence.
        self.partial = [p for block in blocks for p in block.parameters()
                        if p.requires_grad and id(p) not in split_param_ids]
        self._hooks = [
            blocks[0].register_forward_pre_hook(self._enter),
            blocks[-1].register_forward_hook(self._leave),
            *(module.get_submodule(name).register_forward_pre_hook(self._gather, with_kwargs=True)
              for name in gathering),
            *(module.get_submodule(name).register_forward_hook(self._unready, always_call=True)
              for name in (gathering if overlap else ())),
        ]

    def _enter(self, block: nn.Module, args: tuple) -> tuple:
        if not args or not isinstance(args[0], torch.Tensor):
            raise TypeError("sequence parallel needs the first block's hidden states as its first positional argument")
        return (enter_sequence_parallel(args[0], self.axis, self.dim), *args[1:])

    def _gather(self, m: nn.Module, args: tuple, kwargs: dict):
        # The attention (or MLP) module gets the whole sequence, as without sequence parallel: its forward may read
        # the sequence length from its input (Llama's does), and its column layers share one all-gather.
        if args and isinstance(args[0], torch.Tensor):
            return (self._gathered(m, args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": self._gathered(m, kwargs["hidden_states"])}
        raise TypeError(f"sequence parallel needs the hidden states as the first argument (or hidden_states=) of "
                        f"{type(m).__name__}, which holds split layers")

    def _gathered(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not self.overlap or self.axis.size == 1:
            return gather_sequence(x, self.axis, self.dim)
        layers = self.columns[id(m)]
        gathered, *outputs = gather_project(x, layers, self.axis)
        for layer, y in zip(layers, outputs):
            layer.ready = (gathered, y)
        return gathered

    def _unready(self, m: nn.Module, args: tuple, output) -> None:
        for layer in self.columns[id(m)]:  # outputs the forward did not ask for: not kept past it
            layer.ready = None

    def _leave(self, block: nn.Module, args: tuple, output):
        if isinstance(output, torch.Tensor):
            return leave_sequence_parallel(output, self.axis, self.dim)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):  # (hidden, extras...)
            return (leave_sequence_parallel(output[0], self.axis, self.dim), *output[1:])
        raise TypeError("sequence parallel needs the last block to return its hidden states (or a tuple led by them)")

    def reduce_partial_grads(self, grads: list[torch.Tensor] | None = None) -> None:
        """Sum the partial gradients of the region's replicated parameters over the tensor-parallel ranks,
        in one flat all-reduce. ``grads``: where those gradients are (by default their ``.grad``; under ZeRO,
        pieces of the shards)."""
        if grads is None:
            grads = [p.grad for p in self.partial if p.grad is not None]
        if not grads or self.axis.size == 1:
            return
        # On the parameters' device: under ZeRO offload the pieces are in host memory, which nccl cannot reduce.
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self.partial[0].device)
        comm.all_reduce(flat, self.axis)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for layer in self.layers:
            if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                layer.sequence_parallel = False
            if isinstance(layer, ColumnParallelLinear):
                layer.ready = None

