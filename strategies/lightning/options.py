"""The options of every plan strategy, in one frozen object checked when it is built: in the main process, before
anything starts. A bad value is a ValueError that names it (wrong types too, which would otherwise fail, or as a
truthy string pass, later, on every rank, deep in a step)."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from strategies.data_parallel import DEFAULT_BUCKET_CAP_MB
from strategies.tensor_parallel import Colwise, Rowwise, VocabEmbedding, VocabHead

TIMEOUT_ENV = "STRATPACK_TIMEOUT"


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_tp_rule(item: tuple) -> bool:
    return isinstance(item[0], str) and isinstance(item[1], (Colwise, Rowwise, VocabEmbedding, VocabHead))


def _rule(check: Callable[[Any], bool], expected: str) -> dict[str, Any]:
    """A field's metadata: the check its value must pass, and what to say it must be when it does not."""
    return {"check": check, "expected": expected}


_BOOL = _rule(_is_bool, "True or False")


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """How a plan runs, beyond the plan string. Every strategy class of the pack takes these as keyword arguments."""

    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    """DDP bucket size (torch's default, 25 MB); ZeRO-1/2 flats are cut the same way."""
    find_unused_parameters: bool = False
    """Allow parameters that get no gradient in a step (they are reduced as zeros)."""
    ring_all_reduce: bool = False
    """Reduce DDP buckets with the explicit p2p ring of `strategies.comm` instead of the backend's all-reduce
    (synchronous: it shows the algorithm; the backend's is faster)."""
    server_rank: int = 0
    """The parameter server's index on the data-parallel axis, for ``naive``."""
    zero3_units: Callable | None = None
    """ZeRO-3's wrapping policy: ``module -> [(name, submodule), ...]`` gathered together (default: the blocks of
    every ModuleList/Sequential, then each other module owning parameters)."""
    tp_plan: dict | None = None
    """Which submodules tensor parallel splits, ``{"*.attn.qkv": Colwise(chunks=3), ...}``
    (`strategies.tensor_parallel`); by default the shipped plan that fits the model."""
    pipeline_blocks: str | None = None
    """The name of the list of blocks pipeline parallel cuts into stages and activation checkpointing wraps (e.g.
    ``"model.layers"``); by default the longest ``nn.ModuleList`` / ``nn.Sequential`` of the module."""
    pipeline_balance: Literal["params", "time"] = "params"
    """Cut the stages by parameter count (``"params"``), or by the forward time of each block measured on the first
    training batch (``"time"``, agreed by all ranks)."""
    process_group_backend: str | None = None
    """``"gloo"`` / ``"nccl"``; by default from the device."""
    timeout: timedelta | float | None = None
    """How long a collective may wait for the other ranks before the job fails with each rank's last collectives
    (a timedelta or seconds); by default ``$STRATPACK_TIMEOUT`` seconds, else 30 minutes. Held as a timedelta."""
    start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen"
    """``"popen"`` (re-run the script, like ``ddp``) or ``"spawn"`` / ``"fork"`` / ``"forkserver"``."""
    deterministic: bool = False
    """Sum every gradient reduction in rank order (`comm.ordered_sums`), so that ``dp`` and ZeRO-1/2/3 at one world
    size give bit-identical losses and parameters (also ``STRATPACK_DETERMINISTIC=1``). N-1 times the bytes of a
    reduction and synchronous: for proving and debugging, not for speed. Not clipping's norm (summed per parameter
    under dp, per shard under ZeRO: it may differ in the last bit)."""
    compile: bool | dict = False
    """``torch.compile`` each block's forward (`strategies.compile`): True, or torch.compile's keyword arguments
    (``{"mode": "max-autotune"}``). A model the user compiled (``torch.compile(net)`` inside the module, or
    ``net.compile()``) is compiled per block in the same way without it."""
    check_first_batch: bool = False
    """Before the first optimizer step, compare the plan's loss on its first batch with the whole model's on the
    same batch in one process's arithmetic, and stop with both losses if they differ (`first_batch`: fp32 1e-5
    relative). Costs a copy of the whole model until the first batch and two forwards of it; on by default in
    ``stratpack train`` and ``compare``."""
    stop_on_nonfinite_loss: bool = True
    """A NaN or infinite loss ends the job with ``FloatingPointError`` naming the rank and step, instead of
    training on with parameters it would poison."""
    resume: Literal["auto"] | None = None
    """``"auto"``: a ``fit`` given no ``ckpt_path`` resumes from the newest complete checkpoint in the folder of the
    Trainer's ModelCheckpoint (a save torn by a crash is passed over), or starts fresh when there is none, saying so:
    what a job restarted by torchrun ``--max-restarts`` or a SLURM requeue needs (`checkpoint.newest`)."""

    share_casts: bool = True
    """Under ``bf16-mixed`` and ``16-mixed``: each weight cast to the half dtype once per training step, the copy
    shared by every microbatch of a pipeline's step and by recompute (`strategies.mixed_precision`), as FSDP2's
    ``param_dtype`` and Megatron's half weights are; the same values as Lightning's autocast, which casts at every
    call. False: Lightning's autocast as it is."""
    param_dtype: Any = None
    """``torch.bfloat16`` (or ``torch.float16``) under the matching ``*-mixed`` precision: every module computes with
    copies of its weights in that dtype, cast once per step, the float32 weights kept for the optimizer (FSDP2's and
    Megatron's mixed precision: the embedding's output, the residual stream and the norms' weights in half too, where
    autocast alone keeps them float32; `mixed_precision.ParamDtype`). Halves what a block keeps of the stream; its
    values are no longer autocast's alone (the stream rounded to half between blocks). None: autocast's casts only."""
    reduce_dtype: Any = None
    """The dtype gradients are reduced in: float32 (None means the same), as the pack reduces the float32 gradients
    that accumulate into the float32 weights; a half-precision reduction is refused."""
    async_save: bool = False
    """Save checkpoints without stopping training: each rank copies its part to host memory and a background thread
    writes it, the manifest last (`checkpoint.async_save`); one save in flight, the next waits for it. Training waits
    only for the copy (``checkpoint/stall_s`` in the run store)."""
    checkpoint_format: Literal["dcp", "gathered"] = "dcp"
    """``"dcp"``: each rank writes what it holds, as it lies, in torch's Distributed Checkpoint format, and loads only
    what its slice needs (`checkpoint.dcp_dir`); a plan whose state cannot yet be saved so (expert parallel, several
    optimizers, a pipeline over a module with buffers) is saved gathered, and says so. ``"gathered"``: every rank
    gathers the single-process state and writes 1/N of it (`checkpoint.sharded`, the format before #59)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in _RULES and not _RULES[f.name]["check"](getattr(self, f.name)):
                raise ValueError(f"{f.name} must be {_RULES[f.name]['expected']}, got {getattr(self, f.name)!r}")
        object.__setattr__(self, "timeout", collective_timeout(self.timeout))


_RULES = {
    "bucket_cap_mb": _rule(lambda v: _is_number(v) and 0 < v and v * 2**20 < math.inf, "> 0 and finite (megabytes)"),
    "find_unused_parameters": _BOOL,
    "ring_all_reduce": _BOOL,
    "server_rank": _rule(lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0,
                         "the server's index on the data-parallel axis, an int >= 0"),
    "zero3_units": _rule(lambda v: v is None or callable(v), "None or a function module -> [(name, submodule), ...]"),
    "tp_plan": _rule(lambda v: v is None or isinstance(v, dict) and all(map(_is_tp_rule, v.items())),
                     "None or a dict {module-name pattern: Colwise() / Rowwise() / VocabEmbedding() / VocabHead()}"),
    "pipeline_blocks": _rule(lambda v: v is None or isinstance(v, str) and v != "",
                             "None or the dotted name of the list of blocks, e.g. 'model.layers'"),
    "pipeline_balance": _rule(lambda v: isinstance(v, str) and v in ("params", "time"), "'params' or 'time'"),
    "process_group_backend": _rule(lambda v: v is None or isinstance(v, str) and v != "",
                                   "None or a backend name such as 'gloo' or 'nccl'"),
    "stop_on_nonfinite_loss": _BOOL,
    "resume": _rule(lambda v: v is None or v == "auto", "None or 'auto'"),
    "check_first_batch": _BOOL,
    "async_save": _BOOL,
    "checkpoint_format": _rule(lambda v: v in ("dcp", "gathered"), "'dcp' or 'gathered'"),
    "share_casts": _BOOL,
    "param_dtype": _rule(lambda v: v is None or v in (torch.bfloat16, torch.float16), "None, torch.bfloat16 or "
                         "torch.float16 (with the matching precision, 'bf16-mixed' or '16-mixed')"),
    "reduce_dtype": _rule(lambda v: v is None or v == torch.float32, "None or torch.float32 (the pack reduces the "
                          "float32 gradients that accumulate into the float32 weights)"),
    "deterministic": _BOOL,
    "compile": _rule(lambda v: isinstance(v, bool) or isinstance(v, dict) and all(isinstance(k, str) for k in v),
                     "True, False or a dict of torch.compile keyword arguments"),
    "start_method": _rule(lambda v: isinstance(v, str) and v in ("popen", "spawn", "fork", "forkserver"),
                          "'popen', 'spawn', 'fork' or 'forkserver'"),
}


def collective_timeout(timeout: timedelta | float | None = None) -> timedelta:
    """The process-group timeout: ``timeout``, else ``$STRATPACK_TIMEOUT`` (seconds), else torch's 30 minutes."""
    source = f"timeout={timeout!r}"
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return default_pg_timeout
        try:
            source, timeout = f"{TIMEOUT_ENV}={raw!r}", float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not isinstance(timeout, timedelta):
        if not _is_number(timeout):
            raise ValueError(f"{source}: the collective timeout must be a timedelta or a number of seconds")
        try:
            timeout = timedelta(seconds=float(timeout))
        except (OverflowError, ValueError):  # nan, inf, or more than timedelta.max
            raise ValueError(f"{source}: the collective timeout must be a finite number of seconds") from None
    if timeout.total_seconds() <= 0:
        raise ValueError(f"{source}: the collective timeout must be positive, got {timeout}")
    return timeout
