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

The probe is small (2 x 4 tokens of the layer's width), on a copy of the module on the CPU in float64 with its
parameters drawn afresh (a zero-initialised output projection would make any two forwards agree), in eval mode
(dropout off), without the module's hooks; so a module built on meta is probed too. A module with buffers on the
meta device, or larger than `MAX_ELEMENTS`, is not probed (the first-batch check covers it).
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
from strategies.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, linear_parts
from strategies.tensor_parallel.overlap import project

RTOL = 1e-6  # of the largest output element; float64 gives ~1e-15, a forward cast to float32 inside ~1e-7
BATCH, TOKENS = 2, 4
MAX_ELEMENTS = 64 * 2**20  # a module's parameters and buffers the proof copies (512 MiB in float64, on the CPU)
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
    forward of the whole ``module``, on every output tensor of the same shape (a rank's attention weights are
    its heads' only: another shape, not compared)."""
    too_big = _unprobeable(module)
    if too_big:
        return Verdict(False, too_big, False)
    whole = _fresh_copy(module)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            expected = _tensors(whole(x))
        except Exception as error:  # the probe cannot run it whole: nothing to compare against
            return Verdict(False, f"does not run whole on a probe input {tuple(x.shape)} ({_short(error)})", False)
        rows: dict[tuple[str, int], list[torch.Tensor]] = {}
        try:
            for rank in range(tp):  # pass 1: every row-parallel layer's partial output, per call
                forward(_slice(whole, layers, tp, rank, rows, None, localise), x)
            sums = {key: torch.stack(parts).sum(0) for key, parts in rows.items()}
            outputs = [_tensors(forward(_slice(whole, layers, tp, rank, {}, sums, localise), x))
                       for rank in range(tp)]
        except Exception as error:
            return Verdict(False, f"fails on a rank's slice: {_short(error)}")
    for rank, out in enumerate(outputs):
        if not out or not expected or out[0].shape != expected[0].shape:
            return Verdict(False, f"returns shape {tuple(out[0].shape) if out else None} on rank {rank}'s "
                                  f"slice, {tuple(expected[0].shape) if expected else None} whole")
        for mine, whole_out in zip(out, expected):
            if mine.shape != whole_out.shape:
                continue
            scale = whole_out.abs().max().clamp_min(1e-30)
            error = float((mine - whole_out).abs().max() / scale)
            if error > RTOL:
                return Verdict(False, f"differs on rank {rank}'s slice from the user's forward on the whole layer "
                                      f"by {error:.1e} of its largest output (tolerance {RTOL:.0e})")
    return Verdict(True)


def _unprobeable(module: nn.Module) -> str | None:
    tensors = [*module.parameters(), *module.buffers()]
    if any(b.device.type == "meta" for b in module.buffers()):  # parameters are drawn afresh: theirs may be on meta
        return "has buffers on the meta device (nothing to run a probe with)"
    count = sum(t.numel() for t in tensors)
    if count > MAX_ELEMENTS:  # the probe's float64 copies would cost more than the proof is worth at set-up
        return f"holds {count:,} elements, more than the probe copies ({MAX_ELEMENTS:,} at most)"
    return None


def _fresh_copy(module: nn.Module) -> nn.Module:
    """A float64 copy on the CPU in eval mode, its parameters drawn again (seeded): the probe's arithmetic, not the
    user's. Built without copying the user's tensors (they may be on a GPU)."""
    g = torch.Generator().manual_seed(1)
    memo: dict[int, Any] = {}
    for p in module.parameters():
        fan_in = p.shape[-1] if p.dim() > 1 else 1
        memo[id(p)] = nn.Parameter(torch.randn(p.shape, generator=g, dtype=torch.float64) / fan_in**0.5,
                                   requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = b.detach().to("cpu", torch.float64 if b.is_floating_point() else b.dtype, copy=True)
    for m in module.modules():  # hooks stay out: another technique's (context parallel's) hold process groups
        for name, value in vars(m).items():
            if "hooks" in name and isinstance(value, dict):
                memo[id(value)] = type(value)()
    return copy.deepcopy(module, memo).eval()


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
        partial = project(x, self.layer.weight, None, self.layer.transposed)
        if self.sums is None:
            self.rows.setdefault(key, []).append(partial)
            total = partial
        else:
            total = self.sums[key]
        return total + self.layer.bias if self.layer.bias is not None else total


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors a module returns, in order: itself, or those of a tuple, list or dict (the hidden states first)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [o for o in output if isinstance(o, torch.Tensor)]
    return []


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text[:200]}"
