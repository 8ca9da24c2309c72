"""The vocabulary of pipeline schedules: a rank's actions, (phase, stage, microbatch), and a table of them per rank."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # the gradient of the stage's input; of its weights too unless a WEIGHT action of its own follows
    WEIGHT = "W"  # the gradients of the stage's weights, split from its B (zero-bubble schedules)

    # By identity (the members are singletons), in C: Enum's own hashes the name in Python, and every Action hashes
    # its phase (the planner's schedules hash millions of them).
    __hash__ = object.__hash__


@dataclass(frozen=True)
class Action:
    phase: Phase
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.phase.value}{self.stage}.{self.microbatch}"


ScheduleTable = list[list[Action]]  # one ordered list of actions per pipeline rank


def check_counts(pp: int, microbatches: int, virtual: int) -> None:
    for name, value in (("pp", pp), ("microbatches", microbatches), ("virtual", virtual)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
