"""PlanStrategy's arguments, checked in the main process before anything starts: a bad one is a ValueError that
names it (wrong types too, which would otherwise fail, or as a truthy string pass, later on every rank)."""

from __future__ import annotations

import math
import numbers
import os
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from strategies.tp_plan import Colwise, Rowwise, VocabEmbedding

TIMEOUT_ENV = "STRATPACK_TIMEOUT"


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


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_tp_rule(item: tuple) -> bool:
    return isinstance(item[0], str) and isinstance(item[1], (Colwise, Rowwise, VocabEmbedding))


def check_options(**options: Any) -> None:
    """Reject a bad PlanStrategy argument here, in the main process, with a ValueError naming it: wrong types
    too, which would otherwise fail (or, as a truthy string, pass) later, on every rank, deep in a step."""
    rules = {
        "bucket_cap_mb": (lambda v: _is_number(v) and 0 < v and v * 2**20 < math.inf, "> 0 and finite (megabytes)"),
        "find_unused_parameters": (lambda v: isinstance(v, bool), "True or False"),
        "ring_all_reduce": (lambda v: isinstance(v, bool), "True or False"),
        "server_rank": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0,
                        "the server's index on the data-parallel axis, an int >= 0"),
        "zero3_units": (lambda v: v is None or callable(v), "None or a function module -> [(name, submodule), ...]"),
        "tp_plan": (lambda v: v is None or isinstance(v, dict) and all(map(_is_tp_rule, v.items())),
                    "None or a dict {module-name pattern: Colwise() / Rowwise() / VocabEmbedding()}"),
        "pipeline_blocks": (lambda v: v is None or isinstance(v, str) and v != "",
                            "None or the dotted name of the list of blocks, e.g. 'model.layers'"),
        "pipeline_balance": (lambda v: isinstance(v, str) and v in ("params", "time"), "'params' or 'time'"),
        "process_group_backend": (lambda v: v is None or isinstance(v, str) and v != "",
                                  "None or a backend name such as 'gloo' or 'nccl'"),
        "stop_on_nonfinite_loss": (lambda v: isinstance(v, bool), "True or False"),
        "start_method": (lambda v: isinstance(v, str) and v in ("popen", "spawn", "fork", "forkserver"),
                         "'popen', 'spawn', 'fork' or 'forkserver'"),
    }
    for name, value in options.items():
        valid, expected = rules[name]
        if not valid(value):
            raise ValueError(f"{name} must be {expected}, got {value!r}")
