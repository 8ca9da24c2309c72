"""Tensor parallel as a technique of a plan: the model's layers split in place over the tp axis, undone for state,
clipping and the end of training."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from strategies.comm import Axis
from strategies.deferred import Deferred
from strategies.technique import HeldGrad, OptimizerState, Technique
from strategies.tensor_parallel import state as tp_state
from strategies.tensor_parallel.plans import Colwise, Rowwise, Style, apply_plan, param_splits, split_params
from strategies.tensor_parallel.sequence_parallel import SequenceParallel


class TensorParallel(Technique):
    """The layers ``plan`` names (`plans.apply_plan`) split over ``axis``; with ``sequence_parallel``, the blocks
    between them see 1/tp of the sequence (`SequenceParallel`), with ``overlap`` its collectives by pieces beside the
    matmuls (the plan's ``async``)."""

    def __init__(self, module: nn.Module, plan: dict[str, Style], axis: Axis, sequence_parallel: bool = False,
                 materialise: Deferred | None = None, overlap: bool = False):
        self.module, self.axis = module, axis
        self.layers = apply_plan(module, plan, axis, materialise)  # split the full layers: name -> style
        self.splits = param_splits(module, self.layers)  # split parameter name (every name of a tied one) -> cut
        # The vocabulary layers sit outside the blocks, where the sequence is whole again: not sequence parallel.
        in_blocks = {n: s for n, s in self.layers.items() if isinstance(s, (Colwise, Rowwise))}
        self.sequence_parallel = SequenceParallel(module, in_blocks, set(split_params(module, self.layers)), axis,
                                                  overlap=overlap) if sequence_parallel else None

    def place_box(self, name: str, box: Any) -> Any:
        from strategies.checkpoint.slices import TensorSlices

        return TensorSlices(self.splits, self.axis.index, self.axis.size).place_one(name, box)

    def full_model_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return tp_state.unsplit_state(state, self.splits, self.axis)

    def local_model_state(self, state: dict[str, Tensor], strict: bool) -> dict[str, Tensor]:
        return tp_state.split_state(state, self.splits, self.axis)

    def full_optimizer_state(self, optimizer: Any, state: OptimizerState) -> OptimizerState:
        shapes = {n: p.shape for n, p in self.module.named_parameters()}
        return state.with_entries(
            tp_state.unsplit_optimizer_state(state.per_param, state.names, self.splits, shapes, self.axis))

    def local_optimizer_state(self, optimizer: Any, state: OptimizerState) -> OptimizerState:
        return state.with_entries(tp_state.split_optimizer_state(state.per_param, self.splits, self.axis))

    def held_grads(self, grads: list[HeldGrad]) -> list[HeldGrad]:
        return [g._replace(split=self.axis) if g.name in self.splits else g for g in grads]

    def split_axes(self) -> list[Axis]:
        return [self.axis]

    def finish_backward(self, held_grads: Callable[[], list[HeldGrad]], sync: bool) -> None:
        if sync and self.sequence_parallel is not None:  # the norms saw 1/tp of the sequence: sum their partials
            partial = {id(p) for p in self.sequence_parallel.partial}
            self.sequence_parallel.reduce_partial_grads([g.grad for g in held_grads() if id(g.param) in partial])

    def teardown(self, healthy: bool) -> None:
        if self.sequence_parallel is not None:
            self.sequence_parallel.remove()
        if healthy:
            tp_state.restore_full_layers(self.module, self.layers, self.axis)  # the user's layers, whole again

    def leave_in_slices(self) -> None:
        tp_state.restore_sliced_layers(self.module, self.layers)  # the user's layers, on meta
