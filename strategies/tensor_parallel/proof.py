"""Proof, at set-up, that a module whose layers tensor parallel splits computes on each rank's slice what it computes
whole: its forward runs, in this process, once per simulated tp rank on that rank's slices, and every simulated
rank's output must equal the whole module's on the same probe input.

Tensor parallel runs the user's forward on slices: the split layers compute this rank's columns (`Colwise`) or
partial sums that an all-reduce completes (`Rowwise`), and the attention's head counts are made local
(`heads.localise`). That is the same computation only if everything between the split layers acts per head or
per element. A forward that mixes heads (a norm over the whole width of the queries), reads the width from its
input (nanoGPT's ``C``), or transforms the summed output differently from the partial ones would train something
else, with no error. The simulation is exact: a first pass records the input of every row-parallel layer on every
simulated rank, a second pass runs each rank again with those layers returning the all-reduced sum, as the real
layers do; so a rank's output is what it will compute in the run.

The probe is small (2 x 4 tokens of the layer's width), on a copy of the module in float64 with its parameters
drawn afresh (a zero-initialised output projection would make any two forwards agree), in eval mode (dropout off).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from strategies.comm import Axis
from strategies.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, _linear, linear_parts

RTOL = 1e-6  # of the largest output element; float64 gives ~1e-15, a forward cast to float32 inside ~1e-7
BATCH, TOKENS = 2, 4
Forward = Callable[[nn.Module, torch.Tensor], Any]


@dataclass(frozen=True)
class Verdict:
    """Whether a forward computes on the slices what the whole module computes; ``why`` when it does not."""

    same: bool
    why: str = ""
    probed: bool = True  # False: the forward did not run whole on the probe (it needs what a probe cannot make)


def probe_input(module: nn.Module, layers: dict[str, Any]) -> torch.Tensor | None:
    """A probe for ``module``'s forward: (2, 4, width) with the width its first column-parallel layer takes; None
    when its forward does not take one tensor (it needs arguments a probe cannot make: masks, positions)."""
    colwise = [module.get_submodule(n) for n, s in layers.items() if type(s).__name__ == "Colwise"]
    if not colwise or not _one_tensor(module):
        return None
    weight, _, transposed = linear_parts(colwise[0])
    width = weight.shape[0 if transposed else 1]
    return torch.randn(BATCH, TOKENS, width, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _one_tensor(module: nn.Module) -> bool:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return len(positional) >= 1 and len(required) <= 1


def check(module: nn.Module, layers: dict[str, Any], tp: int, forward: Forward, x: torch.Tensor,
          localise: Callable[[nn.Module, int], None]) -> Verdict:
    """Whether ``forward(copy, x)`` on each of ``tp`` simulated ranks' slices of ``module`` (``layers``: its split
    layers by relative name, and their styles; ``localise(copy, tp)`` makes its counts local) equals the user's own
    forward of the whole ``module``."""
    whole = _fresh_copy(module)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            expected = _first_tensor(whole(x))
        except Exception as error:  # the probe cannot run it whole: nothing to compare against
            return Verdict(False, f"does not run whole on a probe input {tuple(x.shape)} ({_short(error)})", False)
        rows: dict[tuple[str, int], list[torch.Tensor]] = {}
        try:
            for rank in range(tp):  # pass 1: every row-parallel layer's partial output, per call
                forward(_slice(whole, layers, tp, rank, rows, None, localise), x)
            sums = {key: torch.stack(parts).sum(0) for key, parts in rows.items()}
            outputs = [_first_tensor(forward(_slice(whole, layers, tp, rank, {}, sums, localise), x))
                       for rank in range(tp)]
        except Exception as error:
            return Verdict(False, f"fails on a rank's slice: {_short(error)}")
    for rank, out in enumerate(outputs):
        if out is None or expected is None or out.shape != expected.shape:
            return Verdict(False, f"returns shape {None if out is None else tuple(out.shape)} on rank {rank}'s "
                                  f"slice, {None if expected is None else tuple(expected.shape)} whole")
        scale = expected.abs().max().clamp_min(1e-30)
        error = float((out - expected).abs().max() / scale)
        if error > RTOL:
            return Verdict(False, f"differs on rank {rank}'s slice from the user's forward on the whole layer by "
                                  f"{error:.1e} of its largest output (tolerance {RTOL:.0e})")
    return Verdict(True)


def _fresh_copy(module: nn.Module) -> nn.Module:
    """A float64 copy in eval mode, its parameters drawn again (seeded): the probe's arithmetic, not the user's."""
    out = copy.deepcopy(module).to(torch.float64).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in out.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / fan_in**0.5)
    return out


def _slice(whole: nn.Module, layers: dict[str, Any], tp: int, rank: int,
           rows: dict[tuple[str, int], list[torch.Tensor]], sums: dict | None,
           localise: Callable[[nn.Module, int], None]) -> nn.Module:
    """Simulated rank ``rank``'s module: its slices of the split layers, its local counts."""
    local = copy.deepcopy(whole)
    axis = Axis("tp", None, tuple(range(tp)), rank)  # no group: a column-parallel forward is the identity on it
    for name, style in layers.items():
        parent_name, _, attr = name.rpartition(".")
        parent = local.get_submodule(parent_name) if parent_name else local
        child = local.get_submodule(name)
        if type(style).__name__ == "Colwise":
            setattr(parent, attr, ColumnParallelLinear.from_linear(child, axis, chunks=style.chunks))
        else:
            setattr(parent, attr, _RowSum(RowParallelLinear.from_linear(child, axis), name, rows, sums))
    localise(local, tp)
    return local


class _RowSum(nn.Module):
    """A row-parallel layer of one simulated rank: records its partial output per call (first pass), or returns the
    sum over the ranks of that call's partial outputs, as the all-reduce does (second pass)."""

    def __init__(self, layer: RowParallelLinear, name: str, rows: dict, sums: dict | None) -> None:
        super().__init__()
        self.layer, self.name, self.rows, self.sums, self.calls = layer, name, rows, sums, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key, self.calls = (self.name, self.calls), self.calls + 1
        partial = _linear(x, self.layer.weight, None, self.layer.transposed)
        if self.sums is None:
            self.rows.setdefault(key, []).append(partial)
            total = partial
        else:
            total = self.sums[key]
        return total + self.layer.bias if self.layer.bias is not None else total


def _first_tensor(output: Any) -> torch.Tensor | None:
    """The hidden states a module returns: itself, or the first tensor of a tuple (attention weights follow)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((o for o in output if isinstance(o, torch.Tensor)), None)
    return None


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text[:200]}"
