"""Cutting a user's model into pipeline stages, and running the user's own code on one stage at a time.

The model is cut at its list of blocks (the ``nn.ModuleList`` / ``nn.Sequential`` its forward runs in
order, hidden states as the first argument): stage s gets a contiguous range of blocks, stage 0 also
the parameters the forward uses before the list (embeddings), the last stage those it uses after it (final norm,
head), as one traced forward shows (`trace`; without a trace, by registration order). Ranges are balanced by
parameter count (`partition`) or measured time.

The user's code is left as written. To run stage s, the list is swapped for one that holds only stage s's
blocks; for s > 0 the first of them gets the activation received from stage s-1 in place of its input,
and for s < last the last of them ends the forward by raising `StageDone` with its output. So the user's
``training_step`` runs the pre-block code (cheap lookups, and on stages > 0 their result is dropped), this
stage's blocks, and on the last stage the head and the user's loss. Where the traced forward showed the blocks as a
plain chain (`trace.ForwardTrace.chained`: each takes the previous one's output alone) and nothing outside them is
hooked, a stage between the first and the last runs its blocks by themselves (`StageRunner.run_blocks`), as torch's
stage modules do: the user's code around them would only compute what the received activation replaces. The last
stage checks, on every microbatch, that its first block is still called with the hidden states alone.

Parameters a rank does not own are replaced by zero-stride placeholders of the same shape (one element of
storage) and frozen: the memory per stage is the stage's own.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from strategies.pipeline.cuts import partition
from strategies.pipeline.trace import BETWEEN, BLOCKS, POST, PRE, ForwardTrace, tensors_of


class StageDone(Exception):
    """Raised from inside the user's forward once this stage's last block has run."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__("pipeline stage finished")
        self.output = output


def find_blocks(module: nn.Module, name: str | None = None) -> str:
    """The name of the list of blocks to cut: ``name`` if given, else the longest ModuleList/Sequential."""
    if name is not None:
        container = module.get_submodule(name)
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            raise TypeError(
                f"pipeline_blocks={name!r} is a {type(container).__name__}, not an nn.ModuleList/Sequential")
        return name
    lists = []
    for n, m in module.named_modules():
        if n and isinstance(m, (nn.ModuleList, nn.Sequential)):
            with_params = sum(1 for child in m if any(True for _ in child.parameters()))
            if with_params >= 2:  # by the number of elements that hold parameters, then the shallowest name
                lists.append((with_params, -n.count("."), n))
    if not lists:
        raise ValueError(
            "pipeline parallel cuts the model at its list of blocks, an nn.ModuleList or nn.Sequential whose "
            "elements run one after the other (hidden states as their first argument); this model has none. "
            "Keep the layers in such a list, or name it: PlanStrategy('pp2', pipeline_blocks='model.layers')."
        )
    return max(lists)[2]


@dataclass
class StageLayout:
    """Where the model is cut: the blocks' list, its parent, and which parameters each stage owns."""

    blocks_name: str
    ranges: list[range]  # blocks of each global stage
    pre: list[str]  # parameters outside the blocks that stage 0 holds (used before the blocks)
    post: list[str]  # those the last stage holds (used after the blocks)
    post_buffers: tuple[str, ...] = ()  # buffers outside the blocks that only the last stage uses (and updates)
    shared: tuple[str, ...] = ()  # parameters used before and after the blocks (a tied head): stage 0's and the last's

    @property
    def stages(self) -> int:
        return len(self.ranges)

    def stage_of(self, name: str) -> int:
        """The stage that owns parameter ``name``: 0 before the blocks, the last after, else its block's."""
        if name in self.pre or name in self.shared:
            return 0
        if name in self.post:
            return self.stages - 1
        index = int(name[len(self.blocks_name) + 1 :].split(".")[0])
        return next(s for s, r in enumerate(self.ranges) if index in r)

    def held_by(self, name: str, stages: list[int]) -> bool:
        """Whether a rank running ``stages`` holds parameter ``name`` (a shared one: the first and last stage)."""
        return self.stage_of(name) in stages or (name in self.shared and self.stages - 1 in stages)

    def buffer_stage(self, name: str) -> int:
        """The stage whose copy of buffer ``name`` is the one in use: its block's, the last stage's for a buffer
        only the code after the blocks uses, else stage 0's."""
        if name.startswith(self.blocks_name + "."):
            return self.stage_of(name)
        return self.stages - 1 if name in self.post_buffers else 0

    def describe(self) -> str:
        """The partition, one stage a line, for logs and errors."""
        last = self.stages - 1
        return "\n".join(
            f"stage {s}: {'embeddings + ' if s == 0 and self.pre else ''}{self.blocks_name}[{r.start}:{r.stop}]"
            f"{' + head' if s == last and self.post else ''}" for s, r in enumerate(self.ranges))


def plan_stages(module: nn.Module, stages: int, blocks_name: str | None = None,
                weights: tuple[list[float], float, float] | None = None,
                trace: ForwardTrace | None = None) -> StageLayout:
    """Where to cut ``module`` into ``stages``: by parameter count, or by ``weights`` (per block, and for
    the code before and after the blocks), e.g. measured times (`measure_times`). With a ``trace`` of one forward
    (`trace.trace_forward`), the list of blocks is the one the forward ran, and every other parameter goes to the
    stage that uses it; without one, to stage 0 if registered before the list, else to the last."""
    if trace is not None:
        check_trace(trace)
    name = trace.blocks if trace is not None else find_blocks(module, blocks_name)
    blocks = module.get_submodule(name)
    params = list(module.named_parameters(remove_duplicate=False))
    if trace is None:
        _refuse_ties(params)
    pre, post, shared = _sides(module, name, trace)
    if weights is None:
        size = dict(params)
        weights = ([sum(p.numel() for p in block.parameters()) for block in blocks],
                   sum(size[n].numel() for n in pre + shared), sum(size[n].numel() for n in post + shared))
    per_block, first, last = weights
    if len(per_block) != len(blocks):
        raise ValueError(f"{len(per_block)} block weights for {len(blocks)} blocks")
    post_buffers = tuple(n for n, _ in module.named_buffers() if trace is not None and trace.phases(n) == {POST})
    return StageLayout(name, partition(list(per_block), stages, first, last), pre, post, post_buffers, tuple(shared))


def _refuse_ties(params: list[tuple[str, nn.Parameter]]) -> None:
    seen: dict[int, str] = {}
    for pname, p in params:
        if id(p) in seen and seen[id(p)] != pname:
            raise ValueError(
                f"pipeline parallel puts each parameter on one stage, but {seen[id(p)]} and {pname} are the same "
                "tensor (weight tying); untie them (e.g. a separate head) to use pp"
            )
        seen[id(p)] = pname


def _sides(module: nn.Module, blocks: str, trace: ForwardTrace | None) -> tuple[list[str], list[str], list[str]]:
    """The parameters outside the blocks that stage 0 holds (``pre``), the last stage holds (``post``), and both
    hold (``shared``: used before and after the blocks, as a head tied to the embedding)."""
    names = [n for n, _ in module.named_parameters()]
    inside = [i for i, n in enumerate(names) if n.startswith(blocks + ".")]
    if not inside:
        raise ValueError(f"the blocks' list {blocks!r} holds no parameters")
    aliases: dict[int, list[str]] = {}
    for alias, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(alias)
    pre, post, shared = [], [], []
    for i, name in enumerate(names):
        names_of = aliases[id(module.get_parameter(name))]
        phases = set().union(*(trace.phases(a) for a in names_of)) if trace else set()
        _check_placement(name, names_of, blocks, phases, i in inside)
        if i in inside:
            continue
        if {PRE, POST} <= phases:
            shared.append(name)
        elif PRE in phases or (not phases and i < inside[0]):
            pre.append(name)
        else:
            post.append(name)
    return pre, post, shared


def _check_placement(name: str, names: list[str], blocks: str, phases: set[str], in_blocks: bool) -> None:
    """Refuse a parameter whose users would sit on different stages: one block's parameter also used outside the
    blocks, one registered in two blocks, or one registered outside the blocks but used in them (the other stages
    would hold a zero placeholder of it)."""
    indices = {a[len(blocks) + 1 :].split(".")[0] for a in names if a.startswith(blocks + ".")}
    if in_blocks and phases - {BLOCKS}:
        where = f"the forward also uses it {sorted(phases - {BLOCKS})}"
    elif len(indices) > 1:
        where = f"it is the same tensor in blocks {sorted(indices, key=int)}"
    elif not in_blocks and BLOCKS in phases:
        where = "it is registered outside the blocks but the blocks use it"
    else:
        return
    raise ValueError(f"{name}: {where}; pipeline parallel gives each block's parameters to that block's stage only. "
                     "Keep such a weight inside one block (or untie it), or use a plan without pp.")


def check_trace(trace: ForwardTrace) -> None:
    """Refuse what the stages could not reproduce: block arguments computed from parameters (each stage would
    compute them from its placeholders), block outputs beyond the hidden states (only those cross stages), and
    parameters used between two blocks (no stage owns that code)."""
    between = sorted(n for n, phases in trace.uses.items() if BETWEEN in phases)
    problems = [
        (trace.computed_args, "block arguments besides the hidden states (the first positional argument) are "
         "computed from parameters; each stage would compute them from zeros on stages that do not hold those "
         "parameters. Compute them inside the blocks, or pass the hidden states first"),
        (trace.extra_outputs, "blocks return more than their hidden states; only the hidden states cross from one "
         "stage to the next. Return the hidden states alone (an aux loss: add it inside the block's last stage)"),
        (between, "parameters are used between two blocks, by code in the loop over the blocks that no stage owns. "
         "Move that code into the blocks"),
    ]
    for found, why in problems:
        if found:
            raise ValueError(f"pipeline parallel cannot cut this model at {trace.blocks!r}: {', '.join(found[:4])}: "
                             f"{why}; or use a plan without pp.")


def measure_times(module: nn.Module, blocks_name: str, run) -> tuple[list[float], float, float]:
    """Seconds each block's forward takes in ``run()`` (a forward of the whole model), and the seconds
    before the first block and after the last (embeddings; head and loss): weights for `plan_stages`."""
    blocks = module.get_submodule(blocks_name)
    marks: dict[tuple[str, int], float] = {}
    hooks = []
    def mark(kind: str, i: int) -> None:
        marks[(kind, i)] = time.perf_counter()

    for i, block in enumerate(blocks):
        hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: mark("start", i)))
        hooks.append(block.register_forward_hook(lambda m, a, o, i=i: mark("end", i)))
    try:
        start = time.perf_counter()
        run()
        end = time.perf_counter()
    finally:
        for hook in hooks:
            hook.remove()
    n = len(blocks)
    if any(("start", i) not in marks or ("end", i) not in marks for i in range(n)):
        raise RuntimeError(f"measuring the stages: the forward did not run every block of {blocks_name!r}")
    times = [marks[("end", i)] - marks[("start", i)] for i in range(n)]
    return times, marks[("start", 0)] - start, end - marks[("end", n - 1)]


class StageRunner:
    """This rank's stages of ``module`` (global indices ``stages``), and the swap that runs one of them."""

    def __init__(self, module: nn.Module, layout: StageLayout, stages: list[int], chained: bool = False) -> None:
        self.module, self.layout, self.stages = module, layout, stages
        parent_name, _, self._attr = layout.blocks_name.rpartition(".")
        self._parent = module.get_submodule(parent_name) if parent_name else module
        self.blocks = module.get_submodule(layout.blocks_name)
        # The blocks are a plain chain (the trace's `chained`) in a list of torch's own kind (a subclass could run
        # them its way), and there are stages between the first and the last: those may run their blocks by
        # themselves (`direct_stages`), and the stages that run the user's code check the chain holds (`_feed`).
        self.chained = chained and type(self.blocks) in (nn.ModuleList, nn.Sequential) and layout.stages > 2
        self.owned = {name for name, _ in module.named_parameters() if layout.held_by(name, stages)}
        self.shapes: dict[str, tuple[torch.Size, bool]] = {}
        self._containers: dict[int, nn.Module] = {}  # stage -> its blocks in a container like the user's (`_swap`)
        for name, p in module.named_parameters():
            if name not in self.owned:  # a placeholder: the right shape, one element of storage, no gradient
                self.shapes[name] = (p.shape, p.requires_grad)
                p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
                p.requires_grad_(False)

    @contextlib.contextmanager
    def stage(self, stage: int, received: torch.Tensor | None) -> Iterator[None]:
        """Run the user's code as stage ``stage``: its blocks only, fed ``received`` (stages > 0)."""
        blocks = [self.blocks[i] for i in self.layout.ranges[stage]]
        swapped = self._swap(stage, blocks)
        hooks = []
        if received is not None:
            hooks.append(blocks[0].register_forward_pre_hook(self._feed(received), with_kwargs=True))
        if stage < self.layout.stages - 1:
            hooks.append(blocks[-1].register_forward_hook(_finish))
        setattr(self._parent, self._attr, swapped)
        try:
            yield
        finally:
            setattr(self._parent, self._attr, self.blocks)
            for hook in hooks:
                hook.remove()

    def direct_stages(self) -> frozenset[int]:
        """This rank's stages that run their blocks by themselves this step: those between the first and the last,
        when the blocks are a plain chain and no hook waits on a module outside them (the user's code around the
        blocks would run it: a hook added since the trace, ZeRO-3's on the model, context parallel's on the
        embeddings) nor on every module."""
        if not self.chained or _global_hooks() or any(m._forward_pre_hooks or m._forward_hooks
                                                      for m in _outside(self.module, self.blocks)):
            return frozenset()
        return frozenset(s for s in self.stages if 0 < s < self.layout.stages - 1)

    def run_blocks(self, stage: int, received: torch.Tensor) -> torch.Tensor:
        """Stage ``stage``'s blocks on ``received``, one after the other (see `direct_stages`)."""
        out = received
        for i in self.layout.ranges[stage]:
            out = self.blocks[i](out)
        return out

    def _feed(self, received: torch.Tensor):
        """The first block's pre-hook: ``received`` in place of its input (on a chained model, checked to be its
        only argument, as the middle stages that run their blocks by themselves assume)."""
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            if self.chained and (len(args) != 1 or kwargs):
                raise ValueError(
                    f"pipeline: {self.layout.blocks_name}'s blocks are called with more than the hidden states "
                    f"({len(args)} positional arguments, keywords {sorted(kwargs)}), but the first training batch "
                    "called them with the hidden states alone, so the stages between the first and the last run "
                    "their blocks by themselves and would leave the rest out. Call the blocks the same way on every "
                    "batch (an attention mask always, or never)")
            return (received, *args[1:]), kwargs
        return hook

    def _swap(self, stage: int, blocks: list[nn.Module]) -> nn.Module:
        """``blocks`` (stage ``stage``'s) in a container of the user's kind: built once per stage, since a
        container's construction is a good part of a stage's overhead in Python, and again if a block was replaced
        since (the container holds the blocks themselves)."""
        held = self._containers.get(stage)
        if held is None or len(held) != len(blocks) or any(a is not b for a, b in zip(held, blocks)):
            held = type(self.blocks)(*blocks) if isinstance(self.blocks, nn.Sequential) else \
                _StageBlocks(blocks, self.layout.blocks_name, self.layout.ranges[stage])
            self._containers[stage] = held
        return held

    def restore(self, full: dict[str, torch.Tensor]) -> None:
        """Put full parameters (gathered from their owners) back in place of the placeholders."""
        params = dict(self.module.named_parameters())
        for name, (shape, requires_grad) in self.shapes.items():
            params[name].data = full[name].to(params[name].device).reshape(shape)
            params[name].requires_grad_(requires_grad)
        self.shapes.clear()


class _StageBlocks(nn.ModuleList):
    """One stage's blocks where the user's list was: a forward that indexes the list past them (``self.h[i]`` for
    ``i in range(n_layer)``) gets an error that says why, not a bare IndexError."""

    def __init__(self, blocks: Any = None, name: str = "blocks", held: range | None = None) -> None:
        super().__init__(blocks)  # (a slice of it is one too: ModuleList builds it from the blocks alone)
        self._where = (name, held if held is not None else range(len(self)))

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int) and not -len(self) <= index < len(self):
            name, held = self._where
            raise IndexError(
                f"pipeline parallel: this stage holds {name}[{held.start}:{held.stop}] only, and the forward asked "
                f"for {name}[{index}]: run the blocks through the list ('for block in self.{name.rpartition('.')[2]}'"
                ", or len() of it), not by a count of your own, so that each stage runs its blocks")
        return super().__getitem__(index)


def _outside(module: nn.Module, blocks: nn.Module) -> Iterator[nn.Module]:
    """``module`` and its submodules but the blocks' own (the container itself included), walked each step: a
    technique may have replaced one (a vocabulary-parallel head) since the runner was built."""
    yield module
    for child in module.children():
        if child is blocks:
            yield child
        else:
            yield from _outside(child, blocks)


def _global_hooks() -> bool:
    """Whether forward hooks are registered for every module (`torch.nn.modules.module.register_module_forward_hook`
    and the like)."""
    from torch.nn.modules import module as torch_module

    return bool(torch_module._global_forward_pre_hooks or torch_module._global_forward_hooks)


def _finish(module: nn.Module, args: tuple, output):
    hidden = output[0] if isinstance(output, tuple) else output
    raise StageDone(hidden)


def split_microbatches(batch, microbatches: int) -> list:
    """Cut every tensor of ``batch`` (a tensor, or a tuple/list/dict of them) into ``microbatches`` equal
    parts along dim 0; a clear error when the batch does not divide."""
    tensors = tensors_of(batch)
    if not tensors:
        raise TypeError("pipeline parallel splits the batch into microbatches, but the batch holds no tensor")
    size = tensors[0].shape[0]
    if size % microbatches or any(t.shape[0] != size for t in tensors):
        raise ValueError(
            f"a batch of {size} samples does not split into mb{microbatches} equal microbatches; make the batch "
            f"size a multiple of {microbatches} (and drop_last=True in the DataLoader), or change mb<N>"
        )
    return [_take(batch, k, size // microbatches) for k in range(microbatches)]


def _take(batch, k: int, size: int):
    if isinstance(batch, torch.Tensor):
        return batch[k * size : (k + 1) * size]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take(item, k, size) for item in batch)
    if isinstance(batch, dict):
        return {key: _take(item, k, size) for key, item in batch.items()}
    return batch
