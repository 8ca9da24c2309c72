"""One runner for every schedule: executes this rank's actions with p2p sends and receives, records a timeline.

Receives block and sends do not (`comm.isend`), so a rank never waits on its own send; since every
schedule in `schedules` is deadlock-free for that model (checked by `schedules.simulate`), neither does
the pipeline. On gloo, where the table allows it (`schedules.sends_can_wait`: every shipped schedule does),
a rank also completes its sends before it computes again, as torch's schedules do: a send left in flight is
moved by gloo's thread while this rank computes, and on a host with a core per rank that thread then waits
for a core, so the next stage gets its input late (1F1B on 2 CPU ranks against torch's: 0.93 with sends in
flight, 0.94-1.02 over four runs with them completed first). Each message is tagged with (kind, stage,
microbatch): between two ranks activations and gradients can travel the same way (interleaved, pp = 2), and tags
keep them apart. The first microbatch's activation of each step goes with a small header (shape, dtype), since
the receiver cannot know it in advance; the step's other microbatches have the same shape (the batch is cut
evenly), so they go without one, and a gradient has the shape of the output the receiver sent, so it never needs
one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from strategies import comm
from strategies.comm import Axis
from strategies.pipeline.schedules import Action, Phase, owner

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 8  # ndim, dtype, up to 6 dims


@dataclass
class TimelineEntry:
    action: str  # "F3.1": forward of stage 3, microbatch 1
    phase: str
    stage: int
    microbatch: int
    start: float  # seconds since the step began
    end: float


@dataclass
class StepResult:
    losses: list[torch.Tensor]  # last stage's per-microbatch losses (empty elsewhere)
    timeline: list[TimelineEntry] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        """The idle fraction of this rank's step: 1 - (seconds computing) / (seconds from the step's start
        to its last action's end). Waiting on a receive is idle, as in the schedule's theory."""
        if not self.timeline:
            return 0.0
        span = max(e.end for e in self.timeline)
        return 1.0 - sum(e.end - e.start for e in self.timeline) / span if span > 0 else 0.0


@dataclass
class _Step:
    """One step's bookkeeping while its actions run."""

    t0: float  # perf_counter at the step's start
    kept: dict = field(default_factory=dict)  # (stage, microbatch) -> (output, received input), until its backward
    pending: list = field(default_factory=list)  # (handle, tensor) of sends in flight
    posted: dict = field(default_factory=dict)  # (kind, stage, microbatch) -> (handle, buffer) of early receives
    result: StepResult = field(default_factory=lambda: StepResult(losses=[]))


class PipelineRunner:
    """Runs a schedule on the pp axis. ``forward(stage, microbatch, received)`` runs the user's code as that
    stage and returns its output (the scaled loss on the last stage)."""

    def __init__(self, axis: Axis, stages: int, microbatches: int, wait_sends: bool = False) -> None:
        self.axis, self.stages, self.microbatches = axis, stages, microbatches
        self.wait_sends = wait_sends  # complete the sends before each compute (see the module's docstring)
        self._shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}  # this step's activation per stage

    def _tag(self, kind: int, stage: int, microbatch: int, part: int = 0) -> int:
        return ((kind * self.stages + stage) * self.microbatches + microbatch) * 2 + part

    def _send_activation(self, out: torch.Tensor, stage: int, m: int, pending: list) -> None:
        if out.dim() > _HEADER - 2 or out.dtype not in _DTYPES:
            raise TypeError(f"pipeline stages pass one tensor of at most 6 dims in {_DTYPES}; got {out.dtype} "
                            f"{tuple(out.shape)}")
        dst = owner(stage + 1, self.axis.size)
        if m == 0:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=out.device)
            header[0], header[1] = out.dim(), _DTYPES.index(out.dtype)
            header[2 : 2 + out.dim()] = torch.tensor(out.shape)
            pending.append((comm.isend(header, self.axis, dst, self._tag(0, stage, m, 0)), header))
        payload = out.detach().contiguous()
        pending.append((comm.isend(payload, self.axis, dst, self._tag(0, stage, m, 1)), payload))

    def _recv_activation(self, stage: int, m: int, device: torch.device, posted: dict) -> torch.Tensor:
        src = owner(stage - 1, self.axis.size)
        if (0, stage, m) in posted:  # received in the background while the previous action computed
            handle, out = posted.pop((0, stage, m))
            handle.wait()
            return out.requires_grad_()
        if m == 0:
            header = torch.empty(_HEADER, dtype=torch.int64, device=device)
            comm.recv(header, self.axis, src, self._tag(0, stage - 1, m, 0))
            ndim = int(header[0])
            self._shapes[stage] = (tuple(int(d) for d in header[2 : 2 + ndim]), _DTYPES[int(header[1])])
        shape, dtype = self._shapes[stage]
        out = torch.empty(shape, dtype=dtype, device=device)
        comm.recv(out, self.axis, src, self._tag(0, stage - 1, m, 1))
        return out.requires_grad_()

    def _recv_grad(self, out: torch.Tensor, stage: int, m: int, posted: dict) -> torch.Tensor:
        if (1, stage, m) in posted:
            handle, grad = posted.pop((1, stage, m))
            handle.wait()
            return grad
        grad = torch.empty_like(out)
        comm.recv(grad, self.axis, owner(stage + 1, self.axis.size), self._tag(1, stage + 1, m))
        return grad

    def _prefetch(self, action: Action, kept: dict, posted: dict, device: torch.device) -> None:
        """Post the receive of ``action``'s input now, so that the sender's message lands while this rank
        computes (a send cannot finish before its receive is posted). Not for a step's first activation
        of a stage, whose shape comes in a header first."""
        s, m = action.stage, action.microbatch
        if action.phase is Phase.FORWARD and s > 0 and m > 0:
            shape, dtype = self._shapes[s]
            out = torch.empty(shape, dtype=dtype, device=device)
            src = owner(s - 1, self.axis.size)
            posted[(0, s, m)] = (comm.irecv(out, self.axis, src, self._tag(0, s - 1, m, 1)), out)
        elif action.phase is Phase.BACKWARD and s < self.stages - 1 and (s, m) in kept:
            grad = torch.empty_like(kept[(s, m)][0])
            src = owner(s + 1, self.axis.size)
            posted[(1, s, m)] = (comm.irecv(grad, self.axis, src, self._tag(1, s + 1, m)), grad)

    def run(self, actions: list[Action], forward: Callable[[int, int, torch.Tensor | None], torch.Tensor],
            device: torch.device,
            backward_context: Callable[[Action], contextlib.AbstractContextManager] | None = None) -> StepResult:
        """Run this rank's ``actions``; ``backward_context(action)`` is entered around each backward (data
        parallel's ``no_sync`` for all but a stage's last one, so each gradient is reduced once, complete)."""
        step = _Step(time.perf_counter())
        for i, action in enumerate(actions):
            following = actions[i + 1] if i + 1 < len(actions) else None
            if action.phase is Phase.FORWARD:
                start, end = self._forward(action, following, forward, device, step)
            else:
                context = backward_context(action) if backward_context is not None else contextlib.nullcontext()
                start, end = self._backward(action, following, device, step, context)
            step.result.timeline.append(TimelineEntry(str(action), action.phase.value, action.stage,
                                                      action.microbatch, start - step.t0, end - step.t0))
        for handle, _ in step.pending:
            handle.wait()
        return step.result

    def _forward(self, action: Action, following: Action | None, forward: Callable, device: torch.device,
                 step: _Step) -> tuple[float, float]:
        s, m = action.stage, action.microbatch
        received = self._recv_activation(s, m, device, step.posted) if s > 0 else None
        if following is not None:
            self._prefetch(following, step.kept, step.posted, device)
        self._complete(step.pending)
        start = time.perf_counter()
        out = forward(s, m, received)
        end = time.perf_counter()
        if s == self.stages - 1:
            step.result.losses.append(out.detach())
        else:
            self._send_activation(out, s, m, step.pending)
        step.kept[(s, m)] = (out, received)
        return start, end

    def _backward(self, action: Action, following: Action | None, device: torch.device, step: _Step,
                  context: contextlib.AbstractContextManager) -> tuple[float, float]:
        s, m = action.stage, action.microbatch
        out, received = step.kept.pop((s, m))
        grad = self._recv_grad(out, s, m, step.posted) if s < self.stages - 1 else None
        if following is not None:
            self._prefetch(following, step.kept, step.posted, device)
        self._complete(step.pending)
        start = time.perf_counter()
        if out.requires_grad:
            with context:
                torch.autograd.backward(out, grad)
        end = time.perf_counter()
        if s > 0:
            g = received.grad if received.grad is not None else torch.zeros_like(received)
            step.pending.append((comm.isend(g, self.axis, owner(s - 1, self.axis.size), self._tag(1, s, m)), g))
        return start, end

    def _complete(self, pending: list) -> None:
        if self.wait_sends:
            for handle, _ in pending:
                handle.wait()
            pending.clear()

    def forward_only(self, my_stages: list[int], forward: Callable[[int, torch.Tensor | None], torch.Tensor],
                     device: torch.device) -> torch.Tensor | None:
        """Every stage once, in order, no microbatches (validation, prediction): the last stage's output on
        the rank that holds it, None elsewhere."""
        pending: list = []
        out = None
        for s in my_stages:
            received = self._recv_activation(s, 0, device, {}).detach() if s > 0 else None
            out = forward(s, received)
            if s < self.stages - 1:
                self._send_activation(out, s, 0, pending)
                out = None
        for handle, _ in pending:
            handle.wait()
        return out
