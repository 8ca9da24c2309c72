"""One runner for every schedule: executes this rank's program (`messages`: groups of sends and receives, each followed
by an action of the schedule) and records a timeline.

Every group goes out as one `comm.exchange`, in the program's order: that order is what NCCL runs by (one stream per
rank, a pair's messages matched as issued, no tags) and what `messages.check` proved free of hangs and swapped messages.
On gloo (outside strict mode) the engine hands a step shaped as the last one a program with every receive posted at the
first (`messages.early_receives`): gloo runs each message by itself, and a receive posted before its send spares gloo's
threads a handshake; a gradient's buffer is then made before the output it answers, sized as its header announced.
The CPU waits less than the stream does, which can only let things progress sooner: a receive is waited for when an
action needs it (or a buffer's shape: a header), sends before the next compute where the program is grouped per action
on gloo (a send left in flight is moved by gloo's thread while this rank computes, and on a host with a core per rank
that thread waits for a core, so the next stage gets its input late; on a host with fewer cores than ranks every program
is grouped in rounds: `messages.crowded`), else at the step's end (each let go before the next compute once it has
completed: a gradient sent is held by nothing else). A W does not wait for them: it fills the time the receiver takes to
post its receive (a large send completes only then), which waiting would turn back into bubble (measured, pp2_zb1p_mb8
on 2 CPU ranks: 21% idle waiting, 7% not; 1F1B 10%). The first microbatch's activation of each stage goes with a small
header (shape, dtype), since the receiver cannot know it in advance; the step's other microbatches have the same shape
(the batch is cut evenly), so they go without one, and a gradient has the shape of the output the receiver sent, so it
never needs one. A step run with a program without headers (the engine's, for a batch shaped as the last one) reuses the
shapes the last headers gave; every activation is checked against the shape its header announced before it is sent, so a
stage whose output changes shape unannounced stops with an error (a receive of the wrong size hangs NCCL). The step's
loss has no message of its own (it was one more send and receive per rank and step, the last stage to every other rank):
the last stage sums its microbatches' (scaled) losses at its last backward, when every one is known, and the gradient
that backward sends carries the sum in a few extra elements at its end, a float32 bit for bit in the gradient's dtype
(float64 in an 8-byte one); each stage passes it on with its own gradient of that microbatch (``carrier``; as it came,
where the dtypes agree), so every rank has the same float when its backwards are done. Only that microbatch's gradients
are copied to make room for it: it rode on every gradient once, a copy each way per backward. A W that directly follows
its own B (``fused``: where B's input gradient goes to no other rank, or the CPU is short:
`schedules.fused_weights`) runs inside that B, as one full backward: split, the pair would only cost the deferred
linears' Python, about 8% of a stage's compute on the demo's blocks; the timeline names that B ``B<s>.<m>+W``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from strategies import comm
from strategies.comm import Axis
from strategies.pipeline.messages import Message, Program, Step
from strategies.pipeline.schedules import Action, Phase
from strategies.pipeline.weights import WeightStore

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
    timeline: list[TimelineEntry] = field(default_factory=list)
    loss: torch.Tensor | None = None  # the sum of the losses, on every rank

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
    kept: dict = field(default_factory=dict)  # (stage, microbatch) -> (_Output, received input), until its backward
    headers: set = field(default_factory=set)  # the header messages this rank's program sends
    outbox: dict = field(default_factory=dict)  # Message -> tensor to send
    arriving: dict = field(default_factory=dict)  # Message -> (group handle, buffer): issued, waited when needed
    sending: list = field(default_factory=list)  # (group handle, tensors) of sends not yet waited for
    local: dict = field(default_factory=dict)  # ("a"|"g", stage, microbatch) -> tensor passed to a stage on this rank
    losses: dict = field(default_factory=dict)  # microbatch -> its scaled loss, float32 (on the last stage)
    loss: torch.Tensor | None = None  # the step's, summed on the last stage: float32, or as carried (`_loss`)
    result: StepResult = field(default_factory=StepResult)
    # stage -> (shape, dtype) of its activation: received (from headers) and sent (announced), kept across training
    # steps by the runner; evaluation's are its own
    shapes: dict = field(default_factory=dict)
    sent: dict = field(default_factory=dict)


@dataclass
class _Output:
    """A forward's output until its backward. Sent to another rank, only where its gradient enters the graph: its
    data is the next stage's input, which that rank holds (Megatron's ``deallocate_output_tensor``; Korthikanti et
    al. 2022, appendix B: one activation less per microbatch in flight). Kept whole where it stays on this rank (the
    next stage's input shares it)."""

    root: torch.Tensor | GradientEdge  # what backward starts from
    shape: torch.Size
    requires_grad: bool

    @staticmethod
    def of(out: torch.Tensor, free: bool) -> _Output:
        free = free and out.requires_grad
        return _Output(get_gradient_edge(out) if free else out, out.shape, out.requires_grad)


class PipelineRunner:
    """Runs programs on the pp axis. ``forward(stage, microbatch, received)`` runs the user's code as that stage
    and returns its output (the scaled loss on the last stage). ``wait_sends``: in training, complete the sends
    before each compute (on gloo, where that is faster; see the module's docstring), else at the step's end.
    ``where``: stage -> pp rank (two neighbouring stages on this rank pass activations and gradients in memory);
    ``weights``: the store that splits weight gradients off B for the table's W actions (None: no W actions);
    ``fused``: the (stage, microbatch) whose W runs inside its B (see the module's docstring). An output sent to
    another rank is kept as its graph only (`_Output`)."""

    def __init__(self, axis: Axis, stages: int, wait_sends: bool = True, where: dict[int, int] | None = None,
                 weights: WeightStore | None = None, fused: frozenset[tuple[int, int]] = frozenset(),
                 carrier: int = 0, traced: dict[int, tuple] | None = None) -> None:
        self.axis, self.stages, self.wait_sends = axis, stages, wait_sends
        # stage -> (shape, dtype) its last block gave when traced: a rehearsal's headers carry no values, so its
        # receiver reads a stage's activation shape here (`comm.set_rehearsal`)
        self.traced = traced or {}
        self.fused, self.carrier = fused, carrier
        self.where = where if where is not None else {s: s % axis.size for s in range(stages)}
        self.weights = weights
        # stage -> (shape, dtype) of its activation, as the last training step's headers gave them (received) and
        # announced them (sent)
        self._shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self._sent: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}

    def run(self, program: Program, forward: Callable[[int, int, torch.Tensor | None], torch.Tensor],
            device: torch.device,
            backward_context: Callable[[Action], contextlib.AbstractContextManager] | None = None) -> StepResult:
        """Run this rank's training ``program``; ``backward_context(action)`` is entered around each backward
        (data parallel's ``no_sync`` for all but a stage's last one, so each gradient is reduced once)."""
        step = _start(program, self._shapes, self._sent)
        for item in program:
            self._exchange(item, step, device)
            if item.action is None or self._merged(item.action, Phase.WEIGHT):
                continue  # (a fused W ran inside its B)
            if item.action.phase is not Phase.WEIGHT:
                _complete(step.sending) if self.wait_sends else _release(step.sending)
            context = contextlib.nullcontext()
            if item.action.phase is not Phase.FORWARD and backward_context is not None:
                context = backward_context(item.action)
            if item.action.phase is Phase.FORWARD:
                start, end = self._forward(item.action, forward, step)
            elif item.action.phase is Phase.BACKWARD:
                start, end = self._backward(item.action, step, context)
            else:
                start, end = self._weights(item.action, context)
            name = f"{item.action}+W" if self._merged(item.action, Phase.BACKWARD) else str(item.action)
            step.result.timeline.append(TimelineEntry(name, item.action.phase.value, item.action.stage,
                                                      item.action.microbatch, start - step.t0, end - step.t0))
        _complete(step.sending)
        step.result.loss = _loss(step.loss)
        return step.result

    def forward_only(self, program: Program, forward: Callable[[int, torch.Tensor | None], torch.Tensor],
                     device: torch.device) -> torch.Tensor | None:
        """Every stage once, in order, no microbatches (validation, prediction): the last stage's output on
        the rank that holds it, None elsewhere."""
        step = _start(program, {}, {})
        out = None
        for item in program:
            self._exchange(item, step, device)
            if item.action is not None:
                s = item.action.stage
                received = _receive(Message("a", s - 1, 0), step).detach() if s > 0 else None
                out = forward(s, received)
                if s < self.stages - 1:
                    self._outgoing(out, s, 0, step)
                    out = None
        _complete(step.sending)
        return out

    def _exchange(self, item: Step, step: _Step, device: torch.device) -> None:
        """Issue ``item``'s group. Nothing waits here: a receive is waited for when an action (or a buffer's
        shape) needs it, sends before the next compute or at the step's end; the issue order, which is what NCCL
        runs by and what `messages.check` proved, is the program's."""
        if not item.group:
            return
        ops = [comm.P2P(t.send, step.outbox.pop(t.message) if t.send else self._buffer(t.message, step, device),
                        t.peer, t.label) for t in item.group]
        handle = comm.exchange(ops, self.axis)
        sent = [op.tensor for op in ops if op.send]
        if sent:  # held until waited for: the backend reads them
            step.sending.append((handle, sent))
        for t, op in zip(item.group, ops, strict=True):
            if not t.send:
                step.arriving[t.message] = (handle, op.tensor)

    def _buffer(self, message: Message, step: _Step, device: torch.device) -> torch.Tensor:
        """Where a message lands: its shape is known from a header, the output it answers, or its kind."""
        if message.kind == "h":
            return torch.empty(_HEADER, dtype=torch.int64, device=device)
        if message.kind == "a":
            header = next((m for m in step.arriving if m.kind == "h" and m.stage == message.stage), None)
            if header is not None:  # this step's first activation of the stage: read its header first
                got = _receive(header, step)
                if comm.rehearsing() and self.traced.get(message.stage):
                    step.shapes[message.stage] = self.traced[message.stage]
                else:
                    ndim = int(got[0])
                    step.shapes[message.stage] = (tuple(int(d) for d in got[2 : 2 + ndim].tolist()),
                                                  _DTYPES[int(got[1])])
            if message.stage not in step.shapes:
                raise RuntimeError(f"pipeline: {message} is to arrive without a header, but no header of stage "
                                   f"{message.stage} ever came (a program without headers ran first)")
            shape, dtype = step.shapes[message.stage]
            return torch.empty(shape, dtype=dtype, device=device)
        # the gradient of the output this rank's stage message.stage - 1 sent, flat (and the step's loss), sized as the
        # stage's header announced it (`_outgoing` checks every output against it): the receive may be posted before
        # that output is made (`messages.early_receives`)
        shape, dtype = step.sent[message.stage - 1]
        extra = _carried(dtype) if message.microbatch == self.carrier else 0
        return torch.empty(math.prod(shape) + extra, dtype=dtype, device=device)

    def _outgoing(self, out: torch.Tensor, stage: int, m: int, step: _Step) -> None:
        """Put a forward's output (and, for the stage's first microbatch, its header) in the outbox."""
        if out.dim() > _HEADER - 2 or out.dtype not in _DTYPES:
            raise TypeError(f"pipeline stages pass one tensor of at most 6 dims in {_DTYPES}; got {out.dtype} "
                            f"{tuple(out.shape)}")
        if Message("h", stage, m) in step.headers:
            step.sent[stage] = (tuple(out.shape), out.dtype)
            header = torch.zeros(_HEADER, dtype=torch.int64, device=out.device)
            header[0], header[1] = out.dim(), _DTYPES.index(out.dtype)
            header[2 : 2 + out.dim()] = torch.tensor(out.shape)
            step.outbox[Message("h", stage, m)] = header
        elif step.sent.get(stage) != (tuple(out.shape), out.dtype):
            raise ValueError(
                f"pipeline: stage {stage}'s output for microbatch {m} is {out.dtype} {tuple(out.shape)}, but the "
                f"stage's header announced {_announced(step.sent.get(stage))}. Every microbatch of a step, and every "
                "step whose batch has the same shapes, must give each stage's output the same shape and dtype (the "
                "receiver sizes its buffer from the header): make the shapes depend on the batch's shapes only")
        step.outbox[Message("a", stage, m)] = out.detach().contiguous()

    def _split(self, stage: int, m: int) -> bool:
        """Whether (stage, m)'s backward leaves its weights' gradients to a later W."""
        return self.weights is not None and (stage, m) not in self.fused

    def _linears(self, stage: int, m: int) -> contextlib.AbstractContextManager:
        """What the blocks' linears are during (stage, m)'s forward: deferring their weights' gradients to W, or (W
        inside B) taking the same half copy of their weights (`WeightStore.shared`), or autocast's own (no W)."""
        if self.weights is None:
            return contextlib.nullcontext()
        return self.weights.linears() if self._split(stage, m) else self.weights.shared()

    def _merged(self, action: Action, phase: Phase) -> bool:
        return action.phase is phase and (action.stage, action.microbatch) in self.fused

    def _local(self, stage: int, other: int) -> bool:
        """Whether ``other``, a neighbour of ``stage``, runs on this rank too (no message between them)."""
        return self.where[stage] == self.where[other]

    def _forward(self, action: Action, forward: Callable, step: _Step) -> tuple[float, float]:
        s, m = action.stage, action.microbatch
        received = None
        if s > 0:
            received = (step.local.pop(("a", s - 1, m)) if self._local(s, s - 1)
                        else _receive(Message("a", s - 1, m), step)).requires_grad_()
        start = time.perf_counter()
        with self._linears(s, m):
            out = forward(s, m, received)
        end = time.perf_counter()
        sent = s < self.stages - 1 and not self._local(s, s + 1)
        if s == self.stages - 1:
            step.losses[m] = out.detach().float().reshape(())
        elif not sent:
            step.local[("a", s, m)] = out.detach()
        else:  # (the outbox holds its data until the send completes)
            self._outgoing(out, s, m, step)
        step.kept[(s, m)] = (_Output.of(out, sent), received)
        return start, end

    def _backward(self, action: Action, step: _Step, context: contextlib.AbstractContextManager) -> tuple[float, float]:
        s, m = action.stage, action.microbatch
        out, received = step.kept.pop((s, m))
        grad, carries = None, m == self.carrier
        if s < self.stages - 1:
            local = self._local(s, s + 1)
            packed = step.local.pop(("g", s + 1, m)) if local else _receive(Message("g", s + 1, m), step)
            if carries:
                grad, step.loss = _unpack(packed, out.shape)
            else:
                grad = packed.view(out.shape)
        elif carries:  # the last stage's last backward: every forward has run, so every loss is known
            step.loss = torch.stack([step.losses[k] for k in sorted(step.losses)]).sum()
        split = self.weights.backward_input((s, m)) if self._split(s, m) else contextlib.nullcontext()
        start = time.perf_counter()
        if out.requires_grad:
            with context, split:
                torch.autograd.backward(out.root, grad)
        end = time.perf_counter()
        if s > 0:
            grad_in = (received.grad if received.grad is not None else torch.zeros_like(received)).contiguous()
            sent = _pack(grad_in, step.loss) if carries else grad_in.view(-1)
            if self._local(s, s - 1):
                step.local[("g", s, m)] = sent
            else:
                step.outbox[Message("g", s, m)] = sent
        return start, end

    def _weights(self, action: Action, context: contextlib.AbstractContextManager) -> tuple[float, float]:
        """W: the weight gradients B of this (stage, microbatch) left for later."""
        start = time.perf_counter()
        with context:
            self.weights.weights((action.stage, action.microbatch))
        return start, time.perf_counter()


def _start(program: Program, shapes: dict, sent: dict) -> _Step:
    return _Step(time.perf_counter(), headers={t.message for item in program for t in item.group
                                              if t.send and t.message.kind == "h"}, shapes=shapes, sent=sent)


def _announced(shape: tuple | None) -> str:
    return "nothing (no header was sent yet)" if shape is None else f"{shape[1]} {shape[0]}"


def _carrier(dtype: torch.dtype) -> torch.dtype:
    """The dtype a microbatch's loss travels as, bit for bit, at the end of a gradient of ``dtype``: float32 (float64
    where the elements are 8 bytes, which a float32 would not fill)."""
    return torch.float64 if dtype.itemsize == 8 else torch.float32


def _carried(dtype: torch.dtype) -> int:
    """How many elements of ``dtype`` carry the loss."""
    return _carrier(dtype).itemsize // dtype.itemsize


def _pack(grad: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``grad``, flat, followed by the loss's bits: what a stage sends back (or passes in memory) to the one before.
    ``loss``: the float32 the last stage computed, or the tail `_unpack` passed on (forwarded as it came where it is
    in ``grad``'s dtype: the middle stages never decode it)."""
    tail = loss if loss.dim() == 1 and loss.dtype == grad.dtype else _encode(_loss(loss), grad.dtype)
    return torch.cat([grad.reshape(-1), tail])


def _unpack(flat: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of an output of ``shape`` and the tail that carries the step's loss (`_loss` reads it), from
    `_pack`."""
    n = math.prod(shape)
    return flat[:n].view(shape), flat[n:].clone()  # a copy: a view would hold the whole buffer to the step's end


def _encode(loss: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return loss.to(_carrier(dtype)).reshape(1).view(dtype)


def _loss(carried: torch.Tensor) -> torch.Tensor:
    """The float32 loss in ``carried``: itself (computed here), or decoded from a gradient's tail."""
    if carried.dim() == 0:
        return carried
    return carried.view(_carrier(carried.dtype)).float().reshape(())  # (aligned: `_unpack` copied it)


def _receive(message: Message, step: _Step) -> torch.Tensor:
    """A received message, once its group has completed."""
    handle, tensor = step.arriving.pop(message)
    handle.wait()
    return tensor


def _release(sending: list) -> None:
    """Let go of the sends that have completed (the others stay in flight): a gradient sent is held by nothing
    else, and held to the step's end it would raise the step's peak by a microbatch's worth per backward."""
    kept = []
    for handle, tensors in sending:
        if handle.done():
            handle.wait()  # returns at once (and runs strict mode's checks)
        else:
            kept.append((handle, tensors))
    sending[:] = kept


def _complete(sending: list) -> None:
    for handle, _ in sending:
        handle.wait()
    sending.clear()
