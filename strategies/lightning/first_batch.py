"""The first-batch check (`PlanStrategy(check_first_batch=True)`; on by default in ``stratpack train`` and
``compare``): the plan's loss on its first batch against the whole model's loss on the same batch, computed in this
rank's process by one process's arithmetic. A plan that computes something other than the user's model (a layer
split the wrong way in a user's ``tp_plan``, stages run out of order, a forward the pack runs differently) stops
there, with both losses and the plan named, before its first optimizer step.

At set-up, before any technique splits the model, each rank keeps a copy of the whole LightningModule (without its
Trainer; the data it holds shared), and the ranks agree to check or all skip. At the first training batch the copy
takes the weights the plan holds then, in the single-process layout (one gather: what callbacks or a resumed
checkpoint made them), and runs the user's ``training_step`` on the rank's batch (before context parallel cuts it;
under pipeline parallel the mean over the plan's microbatches, as the pipeline computes it), in the Trainer's
precision, eagerly, without gradients; then the copy is dropped. After the plan's step every rank gathers the
others' losses, so all stop together or none does.

Tolerance: 1e-5 relative plus 1e-6 absolute in fp32. In lower precision, the spread of the loss the precision itself
makes, measured on the copy (its loss again in fp32): 4x that, and at least 2^-8 (bf16's rounding). Skipped, saying
why: a model whose training forward draws random numbers (dropout: its loss on a batch is not one number), manual
optimization, SyncBatchNorm, a training_step that takes the dataloader iterator, returns no loss or cannot run on a
copy, a model with parameters on the meta device (too large to hold whole: the next issue's models), a GPU without
room for a second copy.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from strategies import comm
from strategies.comm import Axis
from strategies.lightning.steps import deferred_logs
from strategies.pipeline.stages import split_microbatches

FP32_RTOL = 1e-5
ATOL = 1e-6  # the pack's equivalence tests' absolute bound on a loss (tests/helpers.py)
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

    @property
    def excess(self) -> float:
        """How far the difference is past the tolerance (> 0: a mismatch); an absolute floor of `ATOL` keeps a loss
        near zero (a fitted model) from failing on its rounding alone."""
        if self.reference is None or self.plan is None or self.tolerance is None:
            return 0.0
        return abs(self.plan - self.reference) - (self.tolerance * abs(self.reference) + ATOL)


class FirstBatchCheck:
    """One rank's side of the check: the whole model kept at set-up, its loss at the first batch, the comparison."""

    def __init__(self, reference: Any, precision: str, context: Callable[[], Any]) -> None:
        self.copy, self.precision, self.context = reference, precision, context
        self.mine = Outcome()  # until the first batch: skipped, with why, when no copy could be kept

    @classmethod
    def prepare(cls, module: Any, precision: str, context: Callable[[], Any], world: Axis) -> FirstBatchCheck:
        """Keep a copy of ``module`` (the whole model, before any split); ``context()``: the Trainer's precision
        context for a training step. Every rank: the ranks agree to check, or all skip (the first batch's
        collectives, to gather the plan's weights, are then called by all of them or by none)."""
        check = cls(None, precision, context)
        reason = _cannot_copy(module)
        if reason is None:
            try:
                check.copy = _copy(module)
            except Exception as error:  # a module deepcopy cannot copy (an open file, a lock...)
                reason = f"the LightningModule could not be copied ({type(error).__name__}: {error})"
        reasons = [r for r in comm.all_gather_object(reason, world) if r is not None]
        if reasons:
            check.copy, check.mine = None, Outcome(skipped=reasons[0])
        return check

    @property
    def active(self) -> bool:
        return self.copy is not None

    def reference(self, state: dict[str, Tensor], args: tuple, microbatches: int) -> None:
        """The whole model's loss on this rank's first batch (``args``: the step's), with the weights the plan holds
        now (``state``, in the single-process layout: what set-up, callbacks or a resumed checkpoint made them); as a
        pipeline computes it, the mean over ``microbatches``. Then the copy is dropped."""
        ref, self.copy = self.copy, None
        if ref is None:
            return
        if args and isinstance(args[0], Iterator):
            self.mine = Outcome(skipped="training_step takes the dataloader iterator: no batch to run twice")
            return
        try:
            ref.load_state_dict(state, strict=True)
            self.mine = _reference(ref, self.precision, self.context, args, microbatches)
        except Exception as error:
            self.mine = Outcome(skipped=f"training_step did not run on a copy of the model ({type(error).__name__}: "
                                        f"{error})")

    def failed(self, error: Exception, plan: str) -> Exception:
        """The plan's first step raised where the whole model ran: a RuntimeError (a split that does not fit the
        model fails in a matrix product deep in torch) is said again with the plan; others are left as they are."""
        if self.mine.reference is None or type(error) is not RuntimeError:
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
        worst = max(range(len(outcomes)), key=lambda r: outcomes[r].excess)
        bad = outcomes[worst]
        if bad.excess > 0:
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
    if any(isinstance(m, torch.nn.SyncBatchNorm) for m in module.modules()):
        return ("SyncBatchNorm: the plan's batch statistics are over every data-parallel rank's batch, one process's "
                "over its own")
    params = list(module.parameters())
    if any(p.device.type == "meta" for p in params):
        return "the model has parameters on the meta device: too large to hold whole on one rank"
    device = params[0].device if params else torch.device("cpu")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        need = 3 * sum(p.numel() * p.element_size() for p in params)  # the copy, the gathered state, its step
        if need > free:
            return f"a whole copy of the model ({need / 2**30:.1f} GiB with its state and step) does not fit in the " \
                   f"GPU's free {free / 2**30:.1f} GiB"
    return None


def _copy(module: Any) -> Any:
    """A deep copy of the module, without its Trainer (what training_step would do through it, stepping a scheduler,
    must not happen twice); data it holds (datasets, loaders, numpy arrays and memory maps) is shared, not copied."""
    memo: dict[int, Any] = {}
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, (torch.utils.data.Dataset, torch.utils.data.DataLoader, np.ndarray)):
                memo[id(value)] = value
    out = copy.deepcopy(module, memo)  # LightningModule.__getstate__ leaves the Trainer out
    out._trainer = None
    return out


def _rng_states(devices: list[int]) -> list[Tensor]:
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]


def _reference(ref: Any, precision: str, context: Callable[[], Any], args: tuple, microbatches: int) -> Outcome:
    drew = []  # per run: whether the forward moved torch's generators (dropout with p > 0 does; p = 0 does not)

    def loss(seed: int | None, low_precision: bool = True) -> float | None:
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        # Eager: a model the user compiled runs uncompiled here (no second compile, no graph counted for the copy).
        with torch.no_grad(), torch.random.fork_rng(devices=devices), deferred_logs(ref), \
                torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (Lightning's "not attached to a Trainer" warnings: the copy is not)
            if seed is not None:
                torch.manual_seed(seed)
            before = _rng_states(devices)
            with context() if low_precision else contextlib.nullcontext():
                losses = [_loss(ref.training_step(micro, *args[1:])) for micro in parts]
            drew.append(any(not torch.equal(a, b) for a, b in zip(before, _rng_states(devices))))
        return None if any(x is None for x in losses) else sum(losses) / len(losses)

    parts = split_microbatches(args[0], microbatches) if microbatches > 1 else [args[0]]
    first, again = loss(None), loss(12345)  # as many runs on every rank
    if first is None or again is None:
        return Outcome(skipped="training_step returned no loss on the first batch")
    # Two runs from different seeds can agree by chance on a small model (4 dropout draws match once in 16): the
    # generators' states say it whatever the draws were; a loss that still moves draws from a generator of its own.
    if any(drew) or abs(again - first) > 1e-7 * max(abs(first), 1e-12):
        return Outcome(skipped="the model's training forward draws random numbers (dropout?): its loss on a batch "
                               "is not one number. Set dropout to 0 for the run you want checked")
    if _fp32(precision):
        return Outcome(first, None, FP32_RTOL)
    try:
        exact = loss(None, low_precision=False) if "mixed" in precision else _in_fp32(ref, lambda: loss(None, False))
    except Exception:  # (inputs already in low precision against fp32 weights): no spread, the floor
        exact = None
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
