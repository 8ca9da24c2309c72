"""Where one optimizer step's time goes on this rank: compute by phase, the pipeline's idle time, and (from the
communication counters) the time blocked in each collective. The rest of the step is ``other``: data loading,
Lightning's loop, the monitor, Python between the phases.

`StepSplit` is driven by the monitor's hooks, which cut each micro-step of Lightning's automatic optimization into
windows: forward (``on_train_batch_start`` to ``on_before_backward``: training_step and zero_grad), backward (to
``on_before_optimizer_step``: autograd, then the techniques' gradient sync) and optimizer (to
``on_train_batch_end``: clipping, the step, ZeRO's gather of the updated shards). Each window's compute is its
length less the seconds the communication counters say this rank was blocked inside it, so compute, the exposed
communication (the counters' ``wait_s`` per collective) and ``other`` never count the same second twice.

Under pipeline parallel the schedule runs forwards and backwards inside training_step, so the forward window holds
the whole schedule; its compute is split by the timeline (`pipeline.runner.StepResult`): forward the F actions'
share of the busy time, backward the B and W actions'. The schedule's idle time (from the step's start to its last
action's end, less the busy time, as `StepResult.bubble` counts it) is the ``bubble``; a stage that waits on a
receive from its neighbour is idle, as in the schedule's theory, so the pipeline axis's blocked seconds are counted
in the bubble up to its length (`exposed_comm`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

PHASES = ("forward", "backward", "optimizer")


class StepSplit:
    """Seconds per phase, summed over the optimizer steps since the last `take` (every micro-step of an
    accumulation window), on this rank. ``blocked()`` gives the seconds this rank has been blocked in collectives
    so far: (all of them, the pipeline axis's), two monotone counters."""

    def __init__(self, blocked: Callable[[], tuple[float, float]]) -> None:
        self.blocked = blocked
        self._reset()
        self._open: tuple[str, float, tuple[float, float]] | None = None  # phase, its start, blocked then

    def _reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.bubble = 0.0
        self._window = (0.0, 0.0, 0.0)  # this step's forward window: length, blocked (all, pp)

    def enter(self, phase: str | None) -> None:
        """Close the open window (if any) and open ``phase`` (None: close only)."""
        now, blocked = time.perf_counter(), self.blocked()
        if self._open is not None:
            name, start, (all_then, pp_then) = self._open
            length, waited, waited_pp = now - start, blocked[0] - all_then, blocked[1] - pp_then
            self.seconds[name] += max(0.0, length - waited)
            if name == "forward":
                w = self._window
                self._window = (w[0] + length, w[1] + waited, w[2] + waited_pp)
        if phase == "forward":  # a micro-step begins: `add_pipeline` sees its own window only
            self._window = (0.0, 0.0, 0.0)
        self._open = (phase, now, blocked) if phase is not None else None

    def add_pipeline(self, timeline: list[Any]) -> None:
        """Re-split this step's forward window, which held a pipeline schedule, by its ``timeline`` (entries with
        ``phase``, ``start``, ``end``): compute is the actions' busy time less the seconds blocked in other axes'
        collectives inside them, shared between forward (F) and backward (B, W) as the actions are; the span's idle
        time is the bubble; the window's rest (Python between the actions) is left to ``other``."""
        busy = {"F": 0.0, "BW": 0.0}
        for e in timeline:
            busy["F" if e.phase == "F" else "BW"] += e.end - e.start
        total = busy["F"] + busy["BW"]
        length, waited, waited_pp = self._window
        if total <= 0 or length <= 0:
            return
        compute = max(0.0, total - (waited - waited_pp))
        self.seconds["forward"] -= max(0.0, length - waited)  # the window as `enter` counted it
        self.seconds["forward"] += compute * busy["F"] / total
        self.seconds["backward"] += compute * busy["BW"] / total
        self.bubble += max(0.0, max(e.end for e in timeline) - total)  # times are from the step's start

    def take(self, steps: int) -> dict[str, float]:
        """The mean per step over the ``steps`` since the last take (seconds), and a fresh start."""
        out = {**self.seconds, "bubble": self.bubble}
        self._reset()
        return {k: v / max(steps, 1) for k, v in out.items()}


def exposed_comm(comm: dict[str, dict[str, float]], bubble: float) -> dict[str, float]:
    """Seconds blocked per collective (``kind/axis``) in a step's ``comm`` record, with the pipeline axis's waits
    inside the schedule left to the ``bubble`` (a receive waited on is the stage idling for its neighbour)."""
    out = {key: float(rec.get("wait_s") or 0.0) for key, rec in comm.items()}
    pp = [key for key in out if key.endswith("/pp")]
    room = bubble
    for key in sorted(pp, key=lambda k: -out[k]):
        inside = min(out[key], room)
        out[key], room = out[key] - inside, room - inside
    return {key: seconds for key, seconds in out.items() if seconds > 0}


def breakdown(step_time: float, split: dict[str, float], comm: dict[str, dict[str, float]]) -> dict[str, float]:
    """One step's time as disjoint parts (seconds): compute by phase, exposed communication by collective, the
    bubble, and ``other`` (what is left of ``step_time``)."""
    parts = {phase: split.get(phase, 0.0) for phase in PHASES}
    bubble = split.get("bubble", 0.0)
    waits = {f"comm {key}": s for key, s in exposed_comm(comm, bubble).items()}
    if bubble > 0:
        parts["bubble"] = bubble
    parts.update(waits)
    parts["other"] = max(0.0, step_time - sum(parts.values()))
    return parts
