"""The run store's schema (version `SCHEMA`): its files, the memory categories, and the shape of every field a
reader uses. The package's docstring describes the files in words."""

from __future__ import annotations

import math
from typing import Any

SCHEMA = 1
RUNS_ENV = "STRATPACK_RUNS"
META, SUMMARY, RESTARTS = "meta.json", "summary.json", "restarts.jsonl"

MODEL_STATE = ("params", "grads", "optimizer", "host")
"""What a rank holds of the model's state, by memory category (measured from its tensors, and predicted)."""
MEMORY_CATEGORIES = (*MODEL_STATE, "activations", "temporaries")
"""What the estimator predicts for a rank and the dashboard draws beside the measurement (temporaries: what a step
holds at its peak beyond the states and the saved activations; measured where the heap was sampled)."""

# The fields readers use, and their shapes: a file that differs is refused (meta.json) or left out (a record, the
# summary) with a message saying where, instead of failing later in what draws it. A shape is "int", "num" (finite),
# "str", None (null), a tuple (any one of), [item] (a list of), [a, b] (a list of exactly those), or {key: shape} (an
# object: those keys where present, "*" any other key, "!" the keys it must have). Keys not named are not checked.
_NUM = ("num", None)
_MEMORY = {k: _NUM for k in (*MEMORY_CATEGORIES, "total", "activations_peak", "logits")}
_EVENT = {"!": ("action", "start", "end"), "action": "str", "phase": "str", "start": "num", "end": "num"}
META_SHAPE = {
    "!": ("schema", "run_id", "label"), "schema": "int", "run_id": "str", "label": "str", "comparison": ("str", None),
    "plan": ("str", None), "degrees": ({"*": ("int", None)}, None), "world_size": ("int", None), "devices": ["str"],
    "num_params": ("int", None), "predicted": ({"memory": [_MEMORY]}, None), "wandb_run": ("str", None),
    "kind": ("str", None),
}
RECORD_SHAPE = {"!": ("schema",), "schema": "int", "step": ("int", None), "time": _NUM, "step_time_s": _NUM,
                "loss": _NUM, "tokens_per_s": _NUM, "memory": (_MEMORY, None), "split": ({"*": _NUM}, None),
                "error": ("str", None), "last_calls": (["str"], None),  # a rank's last line when it failed
                "attempt": "int", "redone": "bool",  # after a restart (`runs.restarts`)
                "experts": ({"tokens": {"*": ["int"]}, "routed_bytes": _NUM}, None)}  # expert parallel's routing
RESTART_SHAPE = {"!": ("schema", "attempt", "time", "resumed_step"), "schema": "int", "attempt": "int", "time": "num",
                 "resumed_step": "int", "redone": ([("int", None), ("int", None)], None), "last_steps": ["int"],
                 "cause": "str",
                 "ranks": ["int"], "time_lost_s": _NUM, "downtime_s": _NUM, "checkpoint": ("str", None)}
SUMMARY_SHAPE = {
    "losses": [_NUM], "tokens_per_s": _NUM, "mfu": _NUM, "comm_per_step": {"*": {"bytes_sent": _NUM, "wait_s": _NUM}},
    "pipeline": ({"bubble_ideal": _NUM, "bubble_measured": _NUM, "partition": ["str"], "timeline": [_EVENT],
                  "timelines": {"*": [_EVENT]}, "ideal": {"*": [(["str", "num", "num"], ["str", "num"])]}}, None),
    "experts": ({"tokens": {"*": ["int"]}, "imbalance": {"*": _NUM}, "imbalance_max": _NUM,
                 "routed_bytes_per_step": _NUM}, None),
}
_NAMES = {"int": "an integer", "num": "a number", "str": "a string", "bool": "true/false", None: "null", list: "a list",
          dict: "an object"}


def kind_of(value: Any) -> str:
    """What a JSON value is, in words."""
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int):
        return "a number" if abs(value) < 2**63 else "an integer too large (2**63 or more)"
    if isinstance(value, float):
        return "a number" if math.isfinite(value) else "NaN or infinity"
    return _NAMES.get(type(value) if isinstance(value, (list, dict)) else "str" if isinstance(value, str) else None,
                      "null")


def _fits(value: Any, shape: Any) -> bool:
    """``value`` is of ``shape``'s kind, outside only (`misfit` looks inside)."""
    if shape is None or shape == "str":
        return value is None if shape is None else isinstance(value, str)
    if shape == "bool" or isinstance(value, bool):
        return shape == "bool" and isinstance(value, bool)
    if isinstance(shape, (list, dict)):
        return isinstance(value, type(shape))
    if not isinstance(value, (int, float)):
        return False
    if isinstance(value, int):
        return abs(value) < 2**63  # an int64: a bigger one counts nothing a run measures
    return shape == "num" and math.isfinite(value)


def misfit(value: Any, shape: Any, where: str = "") -> str | None:
    """Where ``value`` is not of ``shape`` (see META_SHAPE), in words; None when it is."""
    shapes = shape if isinstance(shape, tuple) else (shape,)
    candidates = [s for s in shapes if _fits(value, s)]
    if not candidates:
        expected = " or ".join(_NAMES[type(s) if isinstance(s, (list, dict)) else s] for s in shapes)
        return f"{where or 'it'} is {kind_of(value)}, not {expected}"
    problems = [_misfit_inside(value, s, where) for s in candidates]  # any one shape that fits inside too will do
    return None if None in problems else problems[0]


def _misfit_inside(value: Any, shape: Any, where: str) -> str | None:
    """Where ``value``, whose outside is of ``shape``'s kind, is not of it inside."""
    if isinstance(shape, list):
        if len(shape) > 1 and len(value) != len(shape):
            return f"{where or 'it'} has {len(value)} items, not {len(shape)}"
        items = ((item, shape[i] if len(shape) > 1 else shape[0], f"{where}[{i}]") for i, item in enumerate(value))
    elif isinstance(shape, dict):
        missing = [key for key in shape.get("!", ()) if key not in value]
        if missing:
            return f"{where or 'it'} has no {missing[0]!r}"
        items = ((item, shape[key] if key in shape and key not in ("!", "*") else shape["*"],
                  f"{where}.{key:.40}" if where else f"{key:.40}")
                 for key, item in value.items() if (key in shape and key not in ("!", "*")) or "*" in shape)
    else:
        return None
    return next(filter(None, (misfit(*item) for item in items)), None)
