"""How the strategy runs Lightning's steps: as Lightning does (`DirectSteps`), or through the pipeline's schedule
(`PipelineSteps`). The strategy holds one of the two and hands every step to it.

Under pipeline parallel, Lightning's automatic optimization calls training_step, then (on the first micro-step of an
accumulation window) zero_grad, then backward. The schedule backpropagates inside training_step, so its gradients
are kept aside until `backward`, where they are handed back (LIGHTNING-NOTES: "the optimization loop under pipeline
parallel"). Evaluation steps run the whole batch through the stages once (`PipelineParallel.eval_step`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from strategies import comm
from strategies.pipeline import PipelineParallel

# ``hook(name, *args, **kwargs)``: Lightning's own Strategy.<name> (training_step, validation_step...), which runs
# the user's step; ``backward()``: Lightning's own Strategy.backward for this step.
Hook = Callable[..., Any]


def check_finite(output: Any, rank: int, step: Any) -> None:
    """Raise FloatingPointError, naming the rank and step, when the loss in ``output`` is NaN or infinite."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if isinstance(loss, Tensor) and not bool(torch.isfinite(loss.detach()).all()):
        raise FloatingPointError(
            f"the loss is {loss.detach().float().reshape(-1)[0].item()} at step {step} on rank {rank}. Look at "
            f"that rank's batch, lower the learning rate or clip gradients (Trainer(gradient_clip_val=...)); "
            f"PlanStrategy(..., stop_on_nonfinite_loss=False) trains on")


class LossWatch:
    """Losses to check for NaN or infinity without stalling the host: each copied to pinned host memory as it is made
    (`add`), read in `check` once the backward has been queued, before clipping and the optimizer step. For one
    process on a GPU, where no collective can spread a bad gradient before the check (`check_finite` at once
    elsewhere)."""

    def __init__(self) -> None:
        self._pending: list[tuple[Tensor, Any, int, Any]] = []

    def add(self, loss: Any, rank: int, step: Any) -> None:
        if not isinstance(loss, Tensor) or loss.device.type != "cuda":
            check_finite(loss, rank, step)
            return
        host = torch.empty(loss.shape, dtype=loss.dtype, pin_memory=True)
        host.copy_(loss.detach(), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending.append((host, done, rank, step))

    def check(self) -> None:
        pending, self._pending = self._pending, []
        for host, done, rank, step in pending:
            done.synchronize()
            check_finite(host, rank, step)


def frees_grads_early(module: Any) -> bool:
    """Whether the last optimizer step's gradients may be freed before the next forward, as a hand-written loop frees
    them after its step. Lightning's own zero_grad comes after training_step, so they would be held through the
    forward, at its peak (4.5 GiB of a 1.2B model's fp32 gradients). Only where Lightning's zero_grad would run
    unchanged: automatic optimization, with neither ``optimizer_zero_grad`` nor ``on_before_zero_grad`` overridden by
    the module or a callback (those see the gradients as Lightning leaves them)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    trainer = getattr(module, "_trainer", None)
    if module is None or trainer is None or not module.automatic_optimization:
        return False
    if is_overridden("optimizer_zero_grad", module) or is_overridden("on_before_zero_grad", module):
        return False
    return not any(is_overridden("on_before_zero_grad", callback) for callback in trainer.callbacks)


class DirectSteps:
    """Every step as Lightning runs it: the user's step on this rank's batch, backward through autograd."""

    pipeline: PipelineParallel | None = None
    in_schedule = False  # a world collective from inside the user's step is fine

    def __init__(self, hook: Hook) -> None:
        self.hook = hook

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.hook("training_step", *args, **kwargs)

    cut_on_eval = False  # (`PipelineSteps`)

    def eval_step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.hook(name, *args, **kwargs)

    def backward(self, closure_loss: Tensor, backward: Callable[[], Tensor],
                 post_backward: Callable[[Tensor], None]) -> Tensor:
        return backward()

    def optimizer_stepped(self) -> None:
        """After each optimizer step."""


class PipelineSteps(DirectSteps):
    """Every step through the pipeline: the schedule's forwards and backwards inside training_step.

    ``module``: the LightningModule; ``pipeline``: the technique, or None until ``build(batch, batch_idx, *args)``
    makes it on the first training batch (stages balanced by measured time); ``no_sync()``: the context in which a
    backward does not reduce gradients; ``check_loss``: stop on a non-finite loss."""

    def __init__(self, hook: Hook, module: Any, device: torch.device, no_sync: Callable[[], Any],
                 pipeline: PipelineParallel | None, build: Callable[..., PipelineParallel], check_loss: bool) -> None:
        super().__init__(hook)
        self.module, self.device, self.no_sync, self.pipeline, self.build = module, device, no_sync, pipeline, build
        self.check_loss = check_loss
        self._grads: dict[int, Tensor] = {}  # gradients the schedule made, handed back in backward()
        self._new_window = True  # no gradient accumulated since the last optimizer step

    def training_step(self, batch: Any, batch_idx: int, *args: Any) -> Tensor:
        if self.pipeline is None:
            self.pipeline = self.build(batch, batch_idx, *args)
        # Lightning calls zero_grad *after* training_step on the first micro-step of an accumulation window and
        # backward() after that. So: start the window's gradients here, run the schedule (it backpropagates), and
        # keep its gradients aside until backward(), where they are handed back.
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self._new_window:
            for p in params:
                p.grad = None
            self._new_window = False
        def step(microbatch: Any, index: int) -> Any:  # the user's training_step on one microbatch
            return self.hook("training_step", microbatch, index, *args)

        accumulate = self.module.trainer.accumulate_grad_batches
        self.in_schedule = True  # training_step runs on the last stage only: no world collective from it
        try:
            with deferred_logs(self.module) as logged:
                loss = self.pipeline.train_step(batch, batch_idx, step, self.device, self.no_sync, accumulate)
        finally:
            self.in_schedule = False
        self._replay_logs(logged)
        self._grads = {id(p): p.grad for p in params}
        for p in params:
            p.grad = None
        if self.check_loss:  # the schedule already ran backward; raising here still skips the optimizer step
            check_finite(loss, self.module.global_rank, self.module.trainer.global_step)
        return loss

    def backward(self, closure_loss: Tensor, backward: Callable[[], Tensor],
                 post_backward: Callable[[Tensor], None]) -> Tensor:
        for p in self.module.parameters():  # the schedule already ran backward: hand its gradients back
            if id(p) in self._grads:
                p.grad = self._grads[id(p)]
        self._grads = {}
        post_backward(closure_loss)
        return closure_loss

    def optimizer_stepped(self) -> None:
        self._new_window = True

    def eval_step(self, name: str, batch: Any, batch_idx: int, *args: Any) -> Any:
        if self.pipeline is None and self.cut_on_eval:  # evaluating alone a model built on meta: cut at this batch
            self.pipeline = self.build(batch, batch_idx, *args, step=name)
        if self.pipeline is None:  # not cut yet (balanced by time, before the first training batch): whole model
            return self.hook(name, batch, batch_idx, *args)
        return self.pipeline.eval_step(batch, batch_idx, lambda b, i, *a: self.hook(name, b, i, *a), self.device,
                                       *args)

    def _replay_logs(self, logged: list[tuple[str, Any, tuple, dict]]) -> None:
        # What training_step logged, per microbatch, on the last stage: averaged over the microbatches (equal sizes:
        # the batch's mean), sent to every pp rank and logged there with the user's options. So rank 0, which holds
        # stage 0 and writes the logs, logs the batch's values, and sync_dist reduces over every rank.
        axis, last = self.pipeline.axis, self.pipeline.last_rank
        payload = _average_logs(logged) if axis.index == last else None
        payload = comm.broadcast_object(payload, axis, src=last, rehearsed=[])  # (a rehearsal: nothing to replay)
        if isinstance(payload, str):
            raise TypeError(payload)
        for name, value, args, kwargs in payload:
            self.module.log(name, torch.tensor(value, device=self.device), *args, **kwargs)


def _average_logs(logged: list[tuple[str, Any, tuple, dict]]) -> list[tuple] | str:
    """Each logged name's mean over the microbatches, or the error every stage raises (sent as the payload, so
    that not only this stage raises, leaving the rest waiting)."""
    entries: dict[str, tuple[list[float], tuple, dict]] = {}
    for name, value, args, kwargs in logged:
        if isinstance(value, Tensor):
            value = value.detach().float().mean().item() if value.numel() == 1 else None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return (f"under pipeline parallel, training_step can log numbers and one-element tensors (averaged over "
                    f"the microbatches); {name!r} is neither")
        entries.setdefault(name, ([], args, kwargs))[0].append(float(value))
    return [(name, sum(v) / len(v), args, kwargs) for name, (v, args, kwargs) in entries.items()]


@contextlib.contextmanager
def deferred_logs(module: Any) -> Iterator[list[tuple[str, Any, tuple, dict]]]:
    """``module.log(...)`` calls are collected instead of reaching Lightning (self.log_dict goes through log)."""
    calls: list[tuple[str, Any, tuple, dict]] = []

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        # Detached: a logged loss keeps its graph, and through it the stage's received input and that input's
        # gradient, alive to the step's end (two boundary tensors per microbatch on the last stage).
        calls.append((name, value.detach() if isinstance(value, Tensor) else value, args, kwargs))

    module.log = log
    try:
        yield calls
    finally:
        del module.log
