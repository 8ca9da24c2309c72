"""PlanStrategy's steps under pipeline parallel: the schedule runs forward and backward inside training_step.

Lightning's automatic optimization calls training_step, then (on the first micro-step of an accumulation
window) zero_grad, then backward. The schedule backpropagates inside training_step, so its gradients are
kept aside until `backward`, where they are handed back (LIGHTNING-NOTES: "the optimization loop under
pipeline parallel"). Evaluation steps go through `PipelineEngine.eval_step`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor
from torch.distributed import ReduceOp
from typing_extensions import override

from strategies import comm
from strategies.pipeline.engine import PipelineEngine
from strategies.pipeline.stages import find_blocks, measure_times, split_microbatches


class PipelineStepsMixin(ParallelStrategy):
    """training/validation/test/predict steps and backward under pp (PlanStrategy's attributes)."""

    def _build_timed_pipeline(self, batch: Any, batch_idx: int, *args: Any) -> None:
        # The whole model is still on every rank: time its blocks on the first microbatch (a warm-up run, then
        # a measured one), take the slowest rank's figures so that every rank cuts the same way, then build.
        micro = split_microbatches(batch, self.resolved_plan.microbatches)[0]
        blocks = find_blocks(self.model, self._pipeline_blocks)

        def run() -> None:
            with torch.no_grad():
                ParallelStrategy.training_step(self, micro, batch_idx, *args)

        run()
        times, first, last = measure_times(self.model, blocks, run)
        agreed = torch.tensor([*times, first, last], dtype=torch.float64, device=self.root_device)
        comm.all_reduce(agreed, self.mesh.world, op=ReduceOp.MAX)
        weights = (agreed[:-2].tolist(), float(agreed[-2]), float(agreed[-1]))
        self.pipeline = PipelineEngine(self.model, self.resolved_plan, self.mesh, blocks, weights)
        self._pipeline_deferred = False
        self._setup_grad_sync()

    def _pipeline_training_step(self, batch: Any, batch_idx: int, *args: Any) -> Tensor:
        if self._pipeline_deferred:
            self._build_timed_pipeline(batch, batch_idx, *args)
        # Lightning calls zero_grad *after* training_step on the first micro-step of an accumulation window and
        # backward() after that. So: start the window's gradients here, run the schedule (it backpropagates),
        # and keep its gradients aside until backward(), where they are handed back.
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        if self._new_window:
            for p in params:
                p.grad = None
            self._new_window = False

        def step(microbatch: Any, index: int) -> Any:
            return ParallelStrategy.training_step(self, microbatch, index, *args)

        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        self._in_schedule = True  # training_step runs on the last stage only: no world collective from it
        try:
            with _deferred_logs(self.lightning_module) as logged:
                loss = self.pipeline.train_step(batch, batch_idx, step, self.root_device, self.grad_sync, accumulate)
        finally:
            self._in_schedule = False
        self._replay_logs(logged)
        self._pipeline_grads = {id(p): p.grad for p in params}
        for p in params:
            p.grad = None
        return loss

    def _replay_logs(self, logged: list[tuple[str, Any, tuple, dict]]) -> None:
        # What training_step logged, per microbatch, on the last stage: averaged over the microbatches (equal
        # sizes: the batch's mean), sent to every pp rank and logged there with the user's options. So rank 0,
        # which holds stage 0 and writes the logs, logs the batch's values, and sync_dist reduces over every rank.
        pipeline = self.pipeline
        payload: Any = None
        if self.mesh.pp.index == pipeline.last_rank:
            entries: dict[str, tuple[list[float], tuple, dict]] = {}
            for name, value, args, kwargs in logged:
                if isinstance(value, Tensor):
                    value = value.detach().float().mean().item() if value.numel() == 1 else None
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    # Sent as the payload, so every stage raises it (not only this one, leaving the rest waiting).
                    payload = (f"under pipeline parallel, training_step can log numbers and one-element tensors "
                               f"(averaged over the microbatches); {name!r} is neither")
                    break
                entries.setdefault(name, ([], args, kwargs))[0].append(float(value))
            else:
                payload = [(name, sum(v) / len(v), args, kwargs) for name, (v, args, kwargs) in entries.items()]
        payload = comm.broadcast_object(payload, self.mesh.pp, src=pipeline.last_rank)
        if isinstance(payload, str):
            raise TypeError(payload)
        for name, value, args, kwargs in payload:
            self.lightning_module.log(name, torch.tensor(value, device=self.root_device), *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        for p in self.lightning_module.parameters():  # the schedule already ran backward: hand its gradients back
            if id(p) in self._pipeline_grads:
                p.grad = self._pipeline_grads[id(p)]
        self._pipeline_grads = {}
        self.post_backward(closure_loss)
        return closure_loss

    def _pipeline_eval(self, hook: str, batch: Any, batch_idx: int, *args: Any) -> Any:
        step = getattr(ParallelStrategy, hook)
        return self.pipeline.eval_step(batch, batch_idx, lambda b, i, *a: step(self, b, i, *a), self.root_device,
                                       *args)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().validation_step(*args, **kwargs)
        return self._pipeline_eval("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().test_step(*args, **kwargs)
        return self._pipeline_eval("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().predict_step(*args, **kwargs)
        return self._pipeline_eval("predict_step", *args, **kwargs)


@contextlib.contextmanager
def _deferred_logs(module: Any) -> Iterator[list[tuple[str, Any, tuple, dict]]]:
    """``module.log(...)`` calls are collected instead of reaching Lightning (self.log_dict goes through log)."""
    calls: list[tuple[str, Any, tuple, dict]] = []

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        calls.append((name, value, args, kwargs))

    module.log = log
    try:
        yield calls
    finally:
        del module.log
