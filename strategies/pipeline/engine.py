"""Pipeline parallel as a technique of a plan: one training step as a schedule, evaluation as a chain.

Training: the batch is cut into microbatches; the schedule runs the user's ``training_step`` on each
(stage, microbatch) through `StageRunner` and `PipelineRunner`; the last stage's losses, each scaled by
1/mb (and 1/accumulate_grad_batches, as Lightning scales its own backward) so the gradients sum to the
batch's, travel down the stages with the gradients and are summed, so every rank returns the same loss to Lightning.
Data-parallel sync is enabled only in the last backward of each stage (the others run inside the ``no_sync``
the caller passes), so each parameter's gradient is reduced once, complete, while the rest of the schedule still
runs (overlap).

Evaluation (validation, test, prediction): the whole batch runs once through the stages in order; the
last stage captures the output of the model's top module, broadcasts it over the pp axis, and every rank
then runs the user's step with that module answering with the output, so ``self.log`` (with or without
``sync_dist``) and returned predictions are the same on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from strategies import comm
from strategies.comm import Axis
from strategies.mesh import ParallelMesh
from strategies.pipeline import messages, schedules
from strategies.pipeline.runner import PipelineRunner, StepResult
from strategies.pipeline.stages import StageDone, StageLayout, StageRunner, plan_stages, split_microbatches
from strategies.pipeline.tied import TiedWeights
from strategies.pipeline.trace import ForwardTrace, tensors_of
from strategies.pipeline.weights import WeightStore
from strategies.plan import ParallelPlan
from strategies.technique import HeldGrad, OptimizerState, Technique


class _TopDone(Exception):
    def __init__(self, output: Any) -> None:
        super().__init__("pipeline evaluation: model output captured")
        self.output = output


def _stage_outputs(layout: StageLayout, trace: ForwardTrace | None) -> dict[int, tuple]:
    """Stage -> (shape, dtype) of what it sends, as traced: its last block's output."""
    outputs = trace.outputs if trace is not None else []
    return {stage: outputs[r[-1]] for stage, r in enumerate(layout.ranges) if len(r) and r[-1] < len(outputs)}


class PipelineParallel(Technique):
    """``module`` cut into the schedule's stages (``plan.pp * plan.virtual``) over the mesh's pp axis, placed as the
    schedule's table places them; this rank runs its own."""

    def __init__(self, module: nn.Module, plan: ParallelPlan, mesh: ParallelMesh, blocks: str | None = None,
                 weights: tuple[list[float], float, float] | None = None, trace: ForwardTrace | None = None):
        self.module, self.axis = module, mesh.pp
        pp, self.microbatches = plan.pp, plan.microbatches
        tables = schedules.build(plan.schedule.value, pp, self.microbatches, plan.virtual, plan.group)
        self.where = schedules.owners(tables)  # stage -> pp rank, as the schedule places them (looped, or a V)
        self.stages = len(self.where)
        self.layout = plan_stages(module, self.stages, blocks, weights, trace)
        self.my_stages = sorted(s for s, r in self.where.items() if r == self.axis.index)
        self.runner_stages = StageRunner(module, self.layout, self.my_stages, trace is not None and trace.chained)
        # One collective on the axis before its first grouped p2p: on nccl, the first batch_isend_irecv of a group
        # must involve every rank of it (it creates the communicator); later ones may involve a pair.
        comm.barrier(self.axis)
        self.tied = TiedWeights(module, list(self.layout.shared), self.axis, mesh.dp, self.where[0],
                                self.where[self.stages - 1])
        self.table = tables[self.axis.index]
        self.ideal_bubble = schedules.table_bubble(tables)
        # Messages proven under NCCL's rules (messages.check), grouped by the host's cores on gloo (`messages.crowded`)
        crowded, self._gloo = crowded_host(mesh), _on_gloo(self.axis)
        progs, known, how = messages.as_run(tables, pp, crowded)
        self.program, self.known_program = progs[self.axis.index], known[self.axis.index]
        self.early_program = messages.early_receives(self.known_program) if self._gloo else None
        self._known: tuple | None = None  # the shapes of the batch whose headers the runner last sent and received
        self.eval_program = messages.evaluation(pp, self.where)[self.axis.index]
        # Zero-bubble tables split each backward: B for the input now, W for the weights later (`weights`).
        # Only the blocks' linears wait for W (the head's logits-sized output gradient is not kept).
        blocks = module.get_submodule(self.layout.blocks_name)
        self.weights = WeightStore(list(blocks.parameters())) if schedules.is_split(tables) else None
        self._last_backward = schedules.reducing(self.table)
        fused = self.weights and schedules.fused_weights(self.table, self._last_backward, self.where, crowded)
        self.runner = PipelineRunner(self.axis, self.stages, how == "action" and self._gloo, self.where, self.weights,
                                     fused or frozenset(), _loss_carrier(tables), _stage_outputs(self.layout, trace))
        # Evaluation captures the model's output at its top module: the LightningModule's child that holds the
        # blocks (self.model), or an nn.Sequential the LightningModule calls itself (its last block's output).
        top, _, _ = self.layout.blocks_name.partition(".")
        container = module.get_submodule(self.layout.blocks_name)
        self._sequential_top = "." not in self.layout.blocks_name and isinstance(container, nn.Sequential)
        self.top = module.get_submodule(top) if "." in self.layout.blocks_name else (
            container if self._sequential_top else module)
        self.last_step: StepResult | None = None

    @property
    def last_rank(self) -> int:
        return self.where[self.stages - 1]

    # -- training ------------------------------------------------------------------------------------------

    def train_step(self, batch: Any, batch_idx: int, step: Callable[[Any, int], Any], device: torch.device,
                   no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
                   accumulate: int = 1) -> torch.Tensor:
        """One batch through the schedule; returns the batch's mean loss on every pp rank. ``no_sync``: the
        context in which a backward must not reduce gradients over dp (all but each stage's last one).
        ``accumulate``: Lightning's accumulate_grad_batches, which it would divide the loss by before its own
        backward."""
        micro = split_microbatches(batch, self.microbatches)
        scale = self.microbatches * accumulate
        direct = self.runner_stages.direct_stages()

        def forward(stage: int, m: int, received: torch.Tensor | None) -> torch.Tensor:
            if stage in direct:  # a middle stage of a plain chain of blocks: the user's code would add nothing
                return self.runner_stages.run_blocks(stage, received)
            with self.runner_stages.stage(stage, received):
                try:
                    out = step(micro[m], batch_idx)
                except StageDone as done:
                    return done.output
            loss = out.get("loss") if isinstance(out, Mapping) else out
            if not isinstance(loss, torch.Tensor):
                raise TypeError("under pipeline parallel training_step must return the loss (or {'loss': ...})")
            return loss / scale

        def backward_context(action: schedules.Action) -> contextlib.AbstractContextManager:
            # Reduce each parameter once, complete, in its stage's last backward.
            return no_sync() if no_sync is not None and action not in self._last_backward else contextlib.nullcontext()

        # The loss reaches every rank with the gradients (`runner`): no broadcast, which would hold the last stage
        # until stage 0 finishes its last backward instead of letting it step its optimizer meanwhile.
        shapes = _shapes_of(batch, self.microbatches)
        program = self.program
        if shapes == self._known:  # on gloo outside strict mode every receive posted at the first (`messages`)
            program = self.early_program if messages.posts_early(self._gloo) else self.known_program
        self._known = None  # until this step has run: if it fails midway, the next one sends its headers
        self.last_step = self.runner.run(program, forward, device, backward_context)
        self._known = shapes
        return self.last_step.loss * accumulate

    # -- evaluation ----------------------------------------------------------------------------------------

    def eval_step(self, batch: Any, batch_idx: int, step: Callable[..., Any], device: torch.device, *args) -> Any:
        def forward(stage: int, received: torch.Tensor | None) -> Any:
            hooks = self._capturing() if stage == self.stages - 1 else []
            try:
                with self.runner_stages.stage(stage, received):
                    step(batch, batch_idx, *args)
            except (StageDone, _TopDone) as done:
                return done.output
            finally:
                for hook in hooks:
                    hook.remove()
            raise RuntimeError(
                f"pipeline evaluation: the step never called {type(self.top).__name__}'s forward, nor that of a module "
                f"inside it that holds {self.layout.blocks_name}. Evaluation under pp captures the model's output "
                "there: keep the blocks under a submodule the step calls (self.model(x)), or call the nn.Sequential of "
                "blocks directly")

        with torch.no_grad():
            output = self.runner.forward_only(self.eval_program, forward, device)
        # Pickled through host memory: a CUDA tensor would be unpickled onto the sender's GPU on every rank.
        name, output = _to(comm.broadcast_object(_to(output, torch.device("cpu")), self.axis, src=self.last_rank),
                           device)
        with _answering(self.module.get_submodule(name) if name else self.top, output):
            return step(batch, batch_idx, *args)

    def _capturing(self) -> list:
        """Hooks that end the last stage's evaluation at the model's output, with it: its last block's, where the
        step calls the nn.Sequential of blocks itself; else the outermost module holding the blocks whose forward the
        step calls (``self.model``, or inside it where the step calls a method: ``self.net.loss(x)`` calling
        ``self.net.model(x)``), named so that every rank answers there."""
        if self._sequential_top:
            at = self.runner_stages.blocks[self.layout.ranges[self.stages - 1].stop - 1]
            return [at.register_forward_hook(lambda m, a, out: _capture(m, a, ("", out)))]
        parts, entered, hooks = self.layout.blocks_name.split("."), [], []
        # (blocks on the LightningModule itself: its own forward, ``top``, named "")
        for name in [".".join(parts[:i]) for i in range(1, len(parts))] or [""]:
            module = self.module.get_submodule(name) if name else self.top
            hooks.append(module.register_forward_pre_hook(lambda m, a, name=name: entered.append(name)))
            hooks.append(module.register_forward_hook(
                lambda m, a, out, name=name: _capture(m, a, (name, out)) if entered[:1] == [name] else None))
        return hooks

    # -- state ---------------------------------------------------------------------------------------------

    def full_state_dict(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Every parameter and buffer from the rank whose copy is in use (every rank must call this).
        ``state``: this rank's view to take the owned values from (default: the module's own; tensor
        parallel passes its gathered, full-shaped one: placeholders then have the full shape too); a part of it
        (`save_pretrained`'s one block at a time) gives that part."""
        state = dict(state) if state is not None else {k: v.detach() for k, v in self.module.state_dict().items()}
        owners = {name: self.layout.stage_of(name) for name, _ in self.module.named_parameters() if name in state}
        owners |= {name: self.layout.buffer_stage(name) for name, _ in self.module.named_buffers() if name in state}
        for name, stage in owners.items():
            src = self.where[stage]
            mine = state[name]
            value = mine.clone() if src == self.axis.index else torch.empty(mine.shape, dtype=mine.dtype,
                                                                            device=mine.device)
            comm.broadcast(value, self.axis, src=src)
            state[name] = value
        for alias, name in self._primary_names().items():  # a tied weight's other names
            if alias in state and alias != name:
                state[alias] = state[name]
        return state

    def _primary_names(self) -> dict[str, str]:
        """Every name of a parameter (tied ones have several) -> the name `named_parameters` gives it."""
        primary = {id(p): name for name, p in self.module.named_parameters()}
        return {alias: primary[id(p)] for alias, p in self.module.named_parameters(remove_duplicate=False)}

    def restore_full_model(self) -> None:
        full = self.full_state_dict()
        self.runner_stages.restore(full)
        with torch.no_grad():  # the buffers as the stage that uses them has them
            for name, buffer in self.module.named_buffers():
                if name in full:
                    buffer.copy_(full[name])

    def holds(self, name: str) -> bool:
        return self.owns(name)

    def holds_buffer(self, name: str) -> bool:
        return self.layout.buffer_stage(name) in self.my_stages

    def owns(self, name: str) -> bool:
        """Whether this rank's stages hold parameter ``name``."""
        return name in self.runner_stages.owned

    def merge_states(self, state: dict[str, Any]) -> dict[str, Any]:
        """The union of every stage's per-parameter optimizer states (each holds its own parameters')."""
        merged: dict = {}
        for src in range(self.axis.size):
            mine = _to(state, torch.device("cpu")) if src == self.axis.index else None  # see eval_step
            merged.update(comm.broadcast_object(mine, self.axis, src=src))
        return merged

    # -- the technique's hooks -----------------------------------------------------------------------------

    loads_own_entries = True  # other stages' parameters are placeholders here: each stage loads its own

    def full_model_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.full_state_dict(state)

    def local_model_state(self, state: dict[str, torch.Tensor], strict: bool) -> dict[str, torch.Tensor]:
        names = self._primary_names()
        missing = sorted(set(names.values()) - set(state))
        if strict and missing:
            raise KeyError(f"the checkpoint has no values for {', '.join(missing[:8])}")
        return {k: v for k, v in state.items() if k not in names or self.owns(names[k])}  # a tied alias: its owner's

    def full_optimizer_state(self, optimizer: Any, state: OptimizerState) -> OptimizerState:
        return state.with_entries(self.merge_states(state.per_param))

    def local_optimizer_state(self, optimizer: Any, state: OptimizerState) -> OptimizerState:
        return state.with_entries({k: v for k, v in state.per_param.items() if self.owns(k)})  # this stage's

    def disjoint_axes(self) -> list[Axis]:
        return [self.axis]

    def held_grads(self, grads: list[HeldGrad]) -> list[HeldGrad]:
        return [g._replace(counted=False) if self.tied.is_copy(g.param) else g for g in grads]

    def finish_backward(self, held_grads: Callable[[], list[HeldGrad]], sync: bool) -> None:
        if sync and self.layout.shared:  # after data parallel's: the tied weights' two shares, summed
            self.tied.reduce(held_grads())

    def teardown(self, healthy: bool) -> None:
        self.tied.remove()
        if healthy:
            self.restore_full_model()  # every parameter back from its stage: a whole module again


def _shapes_of(batch: Any, microbatches: int) -> tuple:
    """What decides the activations' shapes, as every rank of the pipeline sees it (they all load the same batch):
    the microbatch count and each tensor's shape and dtype."""
    return microbatches, tuple((tuple(t.shape), t.dtype) for t in tensors_of(batch))


def _loss_carrier(tables: schedules.ScheduleTable) -> int:
    """The microbatch whose gradients carry the step's loss down the stages (`runner`): the last stage's last
    backward's, since by then the last stage has run every forward and knows every microbatch's loss."""
    last = max(schedules.owners(tables))
    return [a for actions in tables for a in actions if a.phase is schedules.Phase.BACKWARD and a.stage == last][-1] \
        .microbatch


def crowded_host(mesh: ParallelMesh) -> bool:
    """On gloo, whether this node's ranks outnumber this process's cores (`messages.crowded`): what the engine and
    the schedule's choice (`lightning.assemble.choose_schedule`) both go by."""
    return _on_gloo(mesh.pp) and messages.crowded(mesh.nodes.count(mesh.nodes[mesh.world.index]))


def _on_gloo(axis: Axis) -> bool:
    """Whether ``axis`` (of more than one rank) runs on gloo, where the CPU moves the messages."""
    import torch.distributed as dist

    return axis.size > 1 and dist.is_initialized() and comm.backend_of(axis) == "gloo"


def _to(tree: Any, device: torch.device) -> Any:
    """``tree`` with every tensor in it moved to ``device``."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def _capture(module: nn.Module, args: tuple, output: Any):
    raise _TopDone(output)


@contextlib.contextmanager
def _answering(module: nn.Module, output: Any) -> Iterator[None]:
    """``module(...)`` returns ``output`` without computing."""
    module.forward = lambda *args, **kwargs: output
    try:
        yield
    finally:
        del module.forward
