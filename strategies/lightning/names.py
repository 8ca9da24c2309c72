"""Which strings are plan names: what Lightning's registry, once `registry.install` has extended it, answers for."""

from __future__ import annotations

import re
from typing import Any

_PLAN_TOKEN = re.compile(
    r"^(naive|dp|zero[123]|gpipe|1f1b|interleaved|zb1p|zbv|dualpipev|sp|vp|s?ac|offload|(dp|tp|pp|cp|ep|v|mb|ac)\d+)$")
_PLAN_HEAD = re.compile(r"^(naive|dp|zero|tp|pp|cp|ep)")


def looks_like_plan(name: Any) -> bool:
    """True for strings we should answer for: any plan token, or a head that starts like one."""
    if not isinstance(name, str) or not name:
        return False
    tokens = name.lower().split("_")
    return bool(_PLAN_HEAD.match(tokens[0])) or any(_PLAN_TOKEN.match(t) for t in tokens)


class PlanNames(list):
    """Lightning's snapshot of registered names, extended to plan strings (at module level: a Trainer that the
    spawn launcher pickles holds one)."""

    def __contains__(self, name: object) -> bool:
        return list.__contains__(self, name) or looks_like_plan(name)
