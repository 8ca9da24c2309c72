"""The first-batch check (`PlanStrategy(check_first_batch=True)`; on by default in ``stratpack train`` and
``compare``): the plan's loss on its first batch against the whole model's loss on the same batch, computed in this
rank's process by one process's arithmetic. A plan that computes something other than the user's model (a layer
split the wrong way in a user's ``tp_plan``, stages run out of order, a forward the pack runs differently) stops
there, with both losses and the plan named, before its first optimizer step.

At set-up, before any technique splits the model, each rank keeps a copy of the whole LightningModule on its device
(made equal to what the plan's replicas start from: the same broadcast over the data-parallel ranks). At the first
training batch the copy runs the user's ``training_step`` on the rank's batch (before context parallel cuts it), in
the Trainer's precision, without gradients; then the copy is dropped. After the plan's step every rank gathers the
others' losses, so all stop together or none does.

Tolerance: 1e-5 relative in fp32. In lower precision, the spread of the loss the precision itself makes, measured on
the copy (its loss again in fp32): 4x that, and at least 2^-8 (bf16's rounding). Skipped, saying why: a model whose
training forward draws random numbers (dropout: its loss on a batch is not one number), manual optimization, a
training_step that returns no loss or cannot run on a copy, a model with parameters on the meta device (too large
to hold whole: the next issue's models), a GPU without room for a second copy.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from strategies import comm
from strategies.comm import Axis
from strategies.data_parallel import broadcast_module
from strategies.lightning.steps import deferred_logs

FP32_RTOL = 1e-5
LOW_PRECISION_FLOOR = 2.0**-8  # bf16 keeps 8 significant bits
SPREAD_FACTOR = 4.0


class FirstBatchMismatch(RuntimeError):
    """The plan's loss on its first batch is not the whole model's."""


@dataclass(frozen=True)
class Outcome:
    """What the check found on one rank: both losses and the tolerance, or why it was skipped."""

    reference: float | None = None
    plan: float | None = None
    tolerance: float | None = None
    skipped: str | None = None

    @property
    def relative(self) -> float:
        if self.reference is None or self.plan is None:
            return 0.0
        return abs(self.plan - self.reference) / max(abs(self.reference), 1e-12)


class FirstBatchCheck:
    """One rank's side of the check: the whole model kept at set-up, its loss at the first batch, the comparison."""

    def __init__(self, reference: Any, precision: str, context: Callable[[], Any]) -> None:
        self.copy, self.precision, self.context = reference, precision, context
        self.mine = Outcome()  # until the first batch: skipped, with why, when no copy could be kept

    @classmethod
    def prepare(cls, module: Any, precision: str, context: Callable[[], Any]) -> FirstBatchCheck:
        """Keep a copy of ``module`` (the whole model, before any split); ``context()``: the Trainer's precision
        context for a training step."""
        check = cls(None, precision, context)
        reason = _cannot_copy(module)
        if reason is None:
            try:
                check.copy = _copy(module)
            except Exception as error:  # a module deepcopy cannot copy (a compiled one, an open file...)
                reason = f"the LightningModule could not be copied ({type(error).__name__}: {error})"
        if reason is not None:
            check.mine = Outcome(skipped=reason)
        return check

    def equalise(self, axis: Axis) -> None:
        """Make the copy start where the plan's replicas do: the data-parallel ranks take index 0's weights."""
        if not all(comm.all_gather_object(self.copy is not None, axis)):  # a rank has no copy to send or receive in
            self.copy = None
            self.mine = self.mine if self.mine.skipped else Outcome(skipped="a rank could not keep a copy of the model")
            return
        broadcast_module(self.copy, axis)

    def reference(self, batch: Any, batch_idx: int, *args: Any) -> None:
        """The whole model's loss on this rank's first batch (then the copy is dropped)."""
        ref, self.copy = self.copy, None
        if ref is None:
            return
        try:
            self.mine = _reference(ref, self.precision, self.context, batch, batch_idx, *args)
        except Exception as error:
            self.mine = Outcome(skipped=f"training_step did not run on a copy of the model ({type(error).__name__}: "
                                        f"{error})")

    def failed(self, error: Exception, plan: str) -> Exception:
        """The plan's first step raised: where the whole model ran, say so with the error (a split that does not
        fit the model: a layer declared Colwise that is Rowwise fails in a matrix product deep in torch)."""
        if self.mine.reference is None or isinstance(error, (torch.OutOfMemoryError, FloatingPointError)):
            return error
        return FirstBatchMismatch(
            f"first-batch check: plan '{plan}' failed on its first batch ({type(error).__name__}: {error}), where the "
            f"whole model in one process ran it (loss {self.mine.reference:.8g}). The plan does not fit the model: a "
            "tp_plan that declares a layer Colwise where it is Rowwise (or the reverse), a forward that reads a width "
            "or a head count the split changed.")

    def compare(self, output: Any, plan: str, world: Axis) -> Outcome:
        """Every rank: gather each rank's losses, raise `FirstBatchMismatch` on all of them when one differs by
        more than its tolerance; else this rank's outcome (skipped: the first reason any rank gave)."""
        mine = self.mine
        if mine.skipped is None:
            loss = _loss(output)
            mine = Outcome(mine.reference, loss, mine.tolerance,
                           None if loss is not None else "the plan's training_step returned no loss")
        outcomes = comm.all_gather_object(mine, world)
        skipped = next((o.skipped for o in outcomes if o.skipped is not None), None)
        if skipped is not None:
            rank_zero_warn(f"first-batch check of '{plan}' skipped: {skipped}")
            return Outcome(mine.reference, mine.plan, mine.tolerance, skipped)
        worst = max(range(len(outcomes)), key=lambda r: outcomes[r].relative / outcomes[r].tolerance)
        bad = outcomes[worst]
        if bad.relative > bad.tolerance:
            raise FirstBatchMismatch(
                f"first-batch check: plan '{plan}' gives loss {bad.plan:.8g} on rank {worst}'s first batch, where the "
                f"whole model in one process's arithmetic gives {bad.reference:.8g} (relative difference "
                f"{bad.relative:.2e}, tolerance {bad.tolerance:.1e} at precision {self.precision}). The plan computes "
                "something other than your model: a tp_plan that splits a layer the wrong way (Colwise for Rowwise), "
                "a forward the technique cannot run on its slice, stages that do not chain as the forward does, or "
                "ranks that built different initial weights (call seed_everything before building the model). "
                "Stopped before the first optimizer step; PlanStrategy(..., check_first_batch=False) trains anyway.")
        return mine


def _cannot_copy(module: Any) -> str | None:
    if not getattr(module, "automatic_optimization", True):
        return "manual optimization: training_step steps the optimizer itself, so it cannot run on a copy"
    params = list(module.parameters())
    if any(p.device.type == "meta" for p in params):
        return "the model has parameters on the meta device: too large to hold whole on one rank"
    device = params[0].device if params else torch.device("cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        need = 2 * sum(p.numel() * p.element_size() for p in params)  # the copy, and room to run it
        if need > free:
            return f"a whole copy of the model ({need / 2**30:.1f} GiB with its step) does not fit in the GPU's free " \
                   f"{free / 2**30:.1f} GiB"
    return None


def _copy(module: Any) -> Any:
    """A deep copy of the module's parameters and buffers; data and other plain tensors it holds are shared (the
    copy only reads them), the Trainer too (``self.trainer`` works inside its training_step)."""
    memo: dict[int, Any] = {}
    for m in module.modules():
        owned = {id(t) for t in (*m._parameters.values(), *m._buffers.values()) if t is not None}
        for value in vars(m).values():
            if isinstance(value, (Tensor, torch.utils.data.Dataset, torch.utils.data.DataLoader)) \
                    and id(value) not in owned:
                memo[id(value)] = value
    out = copy.deepcopy(module, memo)
    out._trainer = getattr(module, "_trainer", None)
    return out


def _reference(ref: Any, precision: str, context: Callable[[], Any], batch: Any, batch_idx: int,
               *args: Any) -> Outcome:
    def loss(seed: int | None, low_precision: bool = True) -> float | None:
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices), deferred_logs(ref):
            if seed is not None:
                torch.manual_seed(seed)
            with context() if low_precision else contextlib.nullcontext():
                return _loss(ref.training_step(batch, batch_idx, *args))

    first = loss(None)
    if first is None:
        return Outcome(skipped="training_step returned no loss on the first batch")
    again = loss(12345)
    if again is None or abs(again - first) > 1e-7 * max(abs(first), 1e-12):
        return Outcome(skipped="the model's training forward draws random numbers (dropout?): its loss on a batch "
                               "is not one number. Set dropout to 0 for the run you want checked")
    if _fp32(precision):
        return Outcome(first, None, FP32_RTOL)
    exact = loss(None, low_precision=False) if "mixed" in precision else _in_fp32(ref, lambda: loss(None, False))
    spread = abs(first - exact) / max(abs(exact), 1e-12) if exact is not None and math.isfinite(exact) else 0.0
    return Outcome(first, None, max(SPREAD_FACTOR * spread, LOW_PRECISION_FLOOR))


def _fp32(precision: str) -> bool:
    return precision.split("-")[0] in ("32", "64")


def _in_fp32(ref: Any, run: Callable[[], float | None]) -> float | None:
    ref.float()  # the copy is dropped after: no need to cast it back
    return run()


def _loss(output: Any) -> float | None:
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        return None
    return float(loss.detach().float())
