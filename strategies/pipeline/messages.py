"""The pipeline's messages as data: what each rank sends and receives, in which groups, in which order; and a
checker that runs those programs under NCCL's rules.

A rank's *program* is a list of `Step`s: issue one group of messages (one `comm.exchange`, a
``batch_isend_irecv``), then compute one action of the schedule (or nothing). NCCL's stream completes the group
before anything issued after it; the runner's CPU waits only for what an action needs. `programs` builds it
from a schedule table the way torch's pipelining does: before each action, one group holds the sends of the
previous action's output and the receive of this action's input, so that two neighbours that exchange an
activation and a gradient at the same point of their schedules do it in one group each (neither waits on the
other). A step's first activation of a stage is preceded by its header (shape and dtype), a group of its own on
both sides, since the receiver must read it before it can size the activation's buffer; a program without headers
serves the steps whose shapes the receivers learned from an earlier step's headers. The step's loss has no message
of its own: each gradient carries its microbatch's loss back down the stages (`runner`), so every rank has it.

`check` is the proof that the programs are right under NCCL (see ``shared/NCCL-NOTES.md``): per ordered pair of
ranks, the k-th send is received by the k-th receive (no tags), so their labels must agree; each rank runs its
groups one after the other (one stream); a message completes once both of its ends are in their ranks' current
groups (a send waits for its receive to be posted, and the other way round: the messages of one group progress
together, which is what grouping is for), and a group once all of its messages have. A program that would hang
or swap two messages raises, naming the ranks and messages.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

from strategies.pipeline.schedules import Action, Phase, ScheduleTable, dependencies, owners


class PipelineOrderError(RuntimeError):
    """A pipeline program that would hang or swap messages under NCCL's rules."""


@dataclass(frozen=True)
class Message:
    kind: str  # "h": header, "a": activation, "g": gradient (with its microbatch's loss: `runner`)
    stage: int  # the stage that sends it
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


@dataclass(frozen=True)
class Transfer:
    send: bool
    peer: int  # the other pp rank
    message: Message

    def __str__(self) -> str:
        return f"{'send' if self.send else 'recv'} {self.message} {'to' if self.send else 'from'} {self.peer}"

    @cached_property
    def label(self) -> str:
        """The message's name on the wire (strict mode checks it), made once: a program runs every step."""
        return str(self.message)


@dataclass(frozen=True)
class Step:
    group: tuple[Transfer, ...]  # issued together, then waited for
    action: Action | None  # then computed; None: a group on its own (a header, the last sends)


Program = list[Step]


def programs(table: ScheduleTable, pp: int, how: str | None = None, headers: bool = True) -> list[Program]:
    """Each rank's program for ``table``, proven by `check` (see `grouped`)."""
    return grouped(table, pp, how, headers)[0]


def grouped(table: ScheduleTable, pp: int, how: str | None = None, headers: bool = True) -> tuple[list[Program], str]:
    """Each rank's program for ``table``, proven by `check`, and how its messages are grouped: "action" (one group
    per action: GPipe, 1F1B, as torch's single-stage schedules do) where that is safe under NCCL's rules, else
    "rounds" (interleaved and the V schedules, as torch's multi-stage ones do: see `_rounds`); ``how`` forces one.
    Per action, a receive is posted just before the action that needs it; in rounds, as soon as its send is issued
    (so a sender that waited for its send could wait for the receiver's compute: the runner leaves sends in flight
    there). Where the table puts two consecutive stages on one rank (the V placement's bottom), the activation and its
    gradient pass in memory: no message. ``headers=False``: no header messages, for a step whose activations' shapes
    the receivers already know."""
    where = owners(table)
    headed = _headed(table) if headers else {}
    kinds = [how] if how else ["action", "rounds"]
    for kind in kinds:
        built = _per_action(table, where, headed) if kind == "action" else _rounds(table, where, headed)
        try:
            check(built)
        except PipelineOrderError:
            if kind == kinds[-1]:
                raise
            continue
        return built, kind
    raise AssertionError("unreachable: the last kind returns or raises")


def _headed(table: ScheduleTable) -> dict[int, int]:
    """Stage -> the microbatch whose activation has a header: the stage's first forward's."""
    headed: dict[int, int] = {}
    for actions in table:
        for a in actions:
            if a.phase is Phase.FORWARD and a.microbatch < headed.get(a.stage, a.microbatch + 1):
                headed[a.stage] = a.microbatch
    return headed


def held_ahead(table: ScheduleTable, pp: int, crowded: bool = False, early: bool = False) -> list[list[int]] | None:
    """Per rank and action, how many messages the runner's program for a step without headers holds received ahead
    of use (`held_receives`), grouped as `as_run` groups it; None where it receives each just before its use (per
    action, not ``early``). For the estimator, which asks it of tables of tens of thousands of actions, cheaper than
    `as_run`: a table with one stage per rank is grouped per action without trying (`grouped` always finds that safe,
    as torch's single-stage schedules assume; tests/unit/test_messages.py checks it over a grid), a table of several
    stages per rank tries per action (with headers, as `grouped` does) and otherwise takes rounds, and the program
    counted is not proven again (the runner proves what it runs)."""
    where = owners(table)
    if crowded:
        how = "rounds"
    elif len(where) == pp:
        how = "action"
    else:
        try:
            check(_per_action(table, where, _headed(table)))
            how = "action"
        except PipelineOrderError:
            how = "rounds"
    if how == "action" and not early:
        return None
    if how == "rounds" and not early:
        return _held_in_rounds(table, where)
    known = (_per_action if how == "action" else _rounds)(table, where, {})
    return [held_receives(early_receives(p) if early else p) for p in known]


def crowded(ranks_here: int) -> bool:
    """Whether ``ranks_here`` ranks on this host outnumber this process's cores. On gloo the CPU time is then what a
    step waits on, more than any message: the runner groups every schedule's messages in rounds (a receive posted before
    its send arrives spares gloo's threads a handshake: pp4 1F1B on 2 CPU cores, 1.00 -> 1.05 of torch's steps a
    second), lets its sends complete while it computes, and runs a B and the W right after it as one backward
    (`schedules.fused_weights`). A launcher that pins each rank to cores of its own is taken for crowded: a heuristic of
    speed only, every grouping being proven by `check`."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return ranks_here > cores


def as_run(table: ScheduleTable, pp: int, crowded: bool = False,
           early: bool = False) -> tuple[list[Program], list[Program], str]:
    """Each rank's programs as the runner runs them: for a step that sends headers, for a step shaped as the last one
    (no headers: the receivers know the activations' shapes from the last headers, and the runner checks each send
    against them; two messages and a wait fewer per stage boundary and step), and how both are grouped: in rounds
    where the host is ``crowded`` (`crowded`), else as `grouped` prefers for the program with headers (the one without
    takes the same grouping; alone it may prefer another). ``early``: the program without headers posts every receive
    at its first (`early_receives`, where `posts_early`). The engine runs these; the estimator counts their buffers."""
    progs, how = grouped(table, pp, "rounds" if crowded else None)
    known = grouped(table, pp, how=how, headers=False)[0]
    return progs, [early_receives(p) for p in known] if early else known, how


def posts_early(gloo: bool) -> bool:
    """Whether the runner posts a step's receives together (`early_receives`): on gloo, unless strict mode
    (``STRATPACK_STRICT_P2P``) makes gloo follow NCCL's rules, under which that program would in general hang. Read
    when a step starts (the engine) and when a run is predicted (the estimator, in the process that starts the ranks,
    whose environment they inherit)."""
    if not gloo:  # NCCL: asked by `stratpack plan` too, which should not import torch for it
        return False
    from strategies.comm.p2p import strict_seconds

    return strict_seconds() is None


def early_receives(program: Program) -> Program:
    """``program`` (one without headers: every buffer's shape known when the step starts) with all of its receives
    posted at its first one, each a group of its own (waited for alone), in the order ``program`` posts them; the
    sends and the actions stay where they were. For gloo only: there each message progresses by itself (no stream runs
    a rank's messages in order), and a pair's messages are matched in the order they are posted, as on NCCL, so the
    per-pair order `check` proved is what keeps every tensor in its buffer. Under NCCL this program would in general
    hang (a receive posted ahead holds back the rank's own later sends; `check` refuses 1F1B's at pp2 mb4, though not
    GPipe's), so it never runs there.

    Why: gloo writes a payload at once from the sender's call only if the receive is already posted; a receive posted
    after its send costs two notices and a write from the sender's event thread, and every receive posted while the
    peer computes wakes the peer's event thread. Posted together, at the rank's first receive (where it waits anyway),
    the notices cost one wake-up and every send finds its receive (`stratpack bench` against torch's same schedules on
    2 CPU cores: pp2 interleaved 0.95 -> 1.07, GPipe 1.03 -> 1.13; pp4 on the same cores interleaved 0.98 -> 1.25,
    GPipe 0.98 -> 1.17). At the step's very start they would put their posts before the first forward (ZB-V and
    DualPipeV 2-4% slower); spread over the step, each post wakes the peer mid-compute (slower still). The cost is
    memory: every buffer the step receives exists from the first receive on (`held_receives` counts them for the
    estimator)."""
    if any(t.message.kind == "h" for step in program for t in step.group):
        raise ValueError("early_receives needs a program without headers: a header must be read before its "
                         "activation's buffer can be made")
    posted = [Step((t,), None) for step in program for t in step.group if not t.send]
    out: Program = []
    for step in program:
        sends = tuple(t for t in step.group if t.send)
        if posted and len(sends) < len(step.group):  # the first receive: this group's sends, then every receive
            out += ([Step(sends, None)] if sends else []) + posted + [Step((), step.action)]
            posted = []
        elif sends or step.action is not None:
            out.append(Step(sends, step.action))
    return [step for step in out if step.group or step.action is not None]


def evaluation(pp: int, where: dict[int, int]) -> list[Program]:
    """Each rank's program for evaluation: every stage once, in order, on the whole batch (microbatch 0); ``where``:
    stage -> rank, as the training table places them."""
    chain = [[Action(Phase.FORWARD, s, 0) for s in sorted(where) if where[s] == r] for r in range(pp)]
    return programs(chain, pp)


def _per_action(table: ScheduleTable, where: dict[int, int], headed: dict[int, int]) -> list[Program]:
    """Before each action, one group: the previous action's output out, this action's input in. (Receiving the
    next action's input earlier, as the runner once did on gloo, cannot be made safe: on one in-order stream a
    receive posted early holds back the rank's own later sends: the checker finds 1F1B and most GPipe tables hang
    that way.)"""
    out = []
    for actions in table:
        steps: Program = []
        pending: list[Transfer] = []  # the previous action's output
        for action in actions:
            incoming = _input(action, where, headed)
            steps += _header_steps(pending + incoming)
            steps.append(Step(_payloads(pending + incoming), action))
            pending = _output(action, where, headed)
        steps += _header_steps(pending)
        if _payloads(pending):
            steps.append(Step(_payloads(pending), None))
        out.append(steps)
    return out


def _rounds(table: ScheduleTable, where: dict[int, int], headed: dict[int, int]) -> list[Program]:
    """Round after round, each rank in rank order computes its next action if what it needs was made (in this round
    by a lower rank, or earlier), then sends the output; each receive is appended to the receiver's program the
    moment its send is issued. So a receive is posted as early as the programs allow (a sender then finds it
    posted: gloo writes the payload at once from the sender's call instead of announcing it and writing it later
    from its event thread, the receiver's compute meanwhile; pp2_zbv_mb4 on 2 CPU ranks: 0.94 -> 1.08 of torch's
    time per step against the time-step lock step this replaces), and every program is a subsequence of one global
    order in which each send is followed by its receive: no order can hang (torch's `_add_send_recv` places its
    receives the same way)."""
    out: list[Program] = [[] for _ in table]
    for r, action in _round_order(table, max(where)):
        out[r].append(Step((), action))
        sent = _output(action, where, headed)
        out[r] += _header_steps(sent) + ([Step(_payloads(sent), None)] if _payloads(sent) else [])
        for peer in sorted({t.peer for t in sent}):
            got = [Transfer(False, r, t.message) for t in sent if t.peer == peer]
            out[peer] += _header_steps(got) + [Step(_payloads(got), None)]
    return out


def _round_order(table: ScheduleTable, last: int) -> Iterator[tuple[int, Action]]:
    """`_rounds`' order: round after round, each rank in rank order whose next action's inputs were made (in this
    round by a lower rank, or earlier): (rank, action)."""
    cursor, made = [0] * len(table), set()
    needs = [dependencies(actions[0], last) if actions else [] for actions in table]  # each rank's next action's
    while any(cursor[r] < len(actions) for r, actions in enumerate(table)):
        moved = False
        for r, actions in enumerate(table):
            if cursor[r] == len(actions) or any(d not in made for d in needs[r]):
                continue
            action = actions[cursor[r]]
            yield r, action
            made.add(action)
            cursor[r] += 1
            needs[r] = dependencies(actions[cursor[r]], last) if cursor[r] < len(actions) else []
            moved = True
        if not moved:
            raise PipelineOrderError("the schedule's table cannot complete: every rank's next action waits for an "
                                     "input that no rank makes first")


def _held_in_rounds(table: ScheduleTable, where: dict[int, int]) -> list[list[int]]:
    """`held_receives` of each rank's program in rounds without headers, counted from `_round_order` without
    building the programs: a receive is posted on its rank once the rank's actions so far have run, and held until
    the action that uses it."""
    index = [{a: i for i, a in enumerate(actions)} for actions in table]
    spans: list[list[tuple[int, int]]] = [[] for _ in table]
    ran = [0] * len(table)
    last = max(where)
    for r, action in _round_order(table, last):
        ran[r] += 1
        s, m = action.stage, action.microbatch
        if action.phase is Phase.FORWARD and s < last and where[s + 1] != r:
            peer, use = where[s + 1], _user("a", s, m)
        elif action.phase is Phase.BACKWARD and s > 0 and where[s - 1] != r:
            peer, use = where[s - 1], _user("g", s, m)
        else:
            continue
        spans[peer].append((ran[peer], index[peer][use]))
    return [_held_over(spans[r], len(actions)) for r, actions in enumerate(table)]


def held_receives(program: Program) -> list[int]:
    """Per action of ``program``, in order: how many received activations and gradients it holds for later actions
    while that action runs (posted before it, used after it): the buffers a program posts ahead of use."""
    posted: dict[Action, int] = {}  # the action that uses a received tensor -> the actions run before it was posted
    uses: list[Action] = []
    for step in program:
        for t in step.group:
            if not t.send and t.message.kind in ("a", "g"):
                posted[_user(t.message.kind, t.message.stage, t.message.microbatch)] = len(uses)
        if step.action is not None:
            uses.append(step.action)
    first: dict[Action, int] = {}
    for i, action in enumerate(uses):
        first.setdefault(action, i)
    return _held_over([(at, first[use]) for use, at in posted.items()], len(uses))


def _user(kind: str, stage: int, microbatch: int) -> Action:
    """The action that uses the activation ("a") or gradient ("g") stage ``stage`` sends: the next stage's forward,
    the previous stage's backward."""
    return Action(Phase.FORWARD, stage + 1, microbatch) if kind == "a" else Action(Phase.BACKWARD, stage - 1,
                                                                                      microbatch)


def _held_over(spans: list[tuple[int, int]], actions: int) -> list[int]:
    """Per action of ``actions``, how many messages are held while it runs, each over the actions [posted, used) of
    its span: a running sum (the planner asks this of programs of thousands of actions)."""
    change = [0] * (actions + 1)
    for posted, used in spans:
        if posted < used:
            change[posted] += 1
            change[used] -= 1
    return list(itertools.accumulate(change[:-1]))


def _payloads(transfers: list[Transfer]) -> tuple[Transfer, ...]:
    """The messages other than headers, sends first (the order within a group is the same on every rank)."""
    if not transfers:  # most actions: the planner builds programs of tens of thousands of actions
        return ()
    return tuple([t for t in transfers if t.send and t.message.kind != "h"] +
                 [t for t in transfers if not t.send and t.message.kind != "h"])


def _header_steps(transfers: list[Transfer]) -> list[Step]:
    """The headers among ``transfers``, as a group of their own: read before the activation's buffer is made."""
    headers = [t for t in transfers if t.message.kind == "h"]
    if not headers:
        return []
    return [Step(tuple([t for t in headers if t.send] + [t for t in headers if not t.send]), None)]


def _input(action: Action, where: dict[int, int], headed: dict[int, int]) -> list[Transfer]:
    """What ``action`` receives from another rank: its input activation (F) or output gradient (B); none when the
    neighbouring stage is on the same rank, or for W."""
    s, m, last = action.stage, action.microbatch, len(where) - 1  # stages 0 .. last
    if action.phase is Phase.FORWARD and s > 0 and where[s - 1] != where[s]:
        src = where[s - 1]
        header = [Transfer(False, src, Message("h", s - 1, m))] if m == headed.get(s - 1) else []
        return header + [Transfer(False, src, Message("a", s - 1, m))]
    if action.phase is Phase.BACKWARD and s < last and where[s + 1] != where[s]:
        return [Transfer(False, where[s + 1], Message("g", s + 1, m))]
    return []


def _output(action: Action, where: dict[int, int], headed: dict[int, int]) -> list[Transfer]:
    s, m, last = action.stage, action.microbatch, len(where) - 1  # stages 0 .. last
    if action.phase is Phase.FORWARD and s < last and where[s + 1] != where[s]:
        dst = where[s + 1]
        header = [Transfer(True, dst, Message("h", s, m))] if m == headed.get(s) else []
        return header + [Transfer(True, dst, Message("a", s, m))]
    if action.phase is Phase.BACKWARD and s > 0 and where[s - 1] != where[s]:
        return [Transfer(True, where[s - 1], Message("g", s, m))]
    return []


def check(progs: list[Program]) -> int:
    """Run ``progs`` under NCCL's rules; raises `PipelineOrderError` if a rank would wait forever or a receive
    would get another message than the one it is for. Returns the number of rounds (sets of groups completing
    together), for tests."""
    groups = [[step.group for step in prog if step.group] for prog in progs]
    ends = _match(groups)
    where: dict[tuple[int, int], list] = {}  # (rank, group) -> the messages it holds, as (sender, receiver, k)
    for key, (sent, got) in ends.items():
        where.setdefault(sent[:2], []).append(key)
        where.setdefault(got[:2], []).append(key)
    return _run_in_order(groups, where, ends)


def _match(groups: list[list[tuple[Transfer, ...]]]) -> dict[tuple[int, int, int], list]:
    """Pair the ends as NCCL does, the k-th send from a to b with the k-th receive on b from a: (a, b, k) ->
    [the send's (rank, group, label), the receive's]. Raises if an end has no partner or their labels differ."""
    sides: dict[tuple[int, int], tuple[list, list]] = defaultdict(lambda: ([], []))  # (a, b) -> sends, receives
    for r, rank_groups in enumerate(groups):
        for g, group in enumerate(rank_groups):
            for t in group:
                if t.send:
                    sides[(r, t.peer)][0].append((r, g, t.message))
                else:
                    sides[(t.peer, r)][1].append((r, g, t.message))
    ends: dict[tuple[int, int, int], list] = {}
    for (a, b), (sent, got) in sides.items():
        for k in range(max(len(sent), len(got))):
            ends[(a, b, k)] = [sent[k] if k < len(sent) else None, got[k] if k < len(got) else None]
    wrong = [key for key, (sent, got) in ends.items() if sent is None or got is None or sent[2] != got[2]]
    for (a, b, k), (sent, got) in sorted((key, ends[key]) for key in wrong):  # the first in order is named
        if sent is None or got is None:
            side = f"rank {a} sends" if got is None else f"rank {b} receives"
            raise PipelineOrderError(f"{side} {(sent or got)[2]} (message {k + 1} from rank {a} to rank {b}) with no "
                                     "matching " + ("receive" if got is None else "send") + " on the other side")
        if sent[2] != got[2]:
            raise PipelineOrderError(
                f"rank {b}'s receive number {k + 1} from rank {a} is for {got[2]}, but rank {a}'s send number {k + 1} "
                f"to rank {b} is {sent[2]}: NCCL matches a pair's messages in issue order (no tags), so {got[2]}'s "
                "buffer would get the wrong tensor")
    return ends


def _run_in_order(groups: list[list[tuple[Transfer, ...]]], where: dict, ends: dict) -> int:
    """Each rank's groups one after the other: a message completes once both of its ends are in their ranks'
    current groups (the members of a group progress together), a group once all its messages have."""
    cursor = [0] * len(groups)
    done: set = set()
    rounds = 0
    while True:
        heads = {(r, cursor[r]) for r in range(len(groups)) if cursor[r] < len(groups[r])}
        if not heads:
            return rounds
        done |= {key for head in heads for key in where[head] if {ends[key][0][:2], ends[key][1][:2]} <= heads}
        moved = [(r, g) for r, g in heads if all(key in done for key in where[(r, g)])]
        if not moved:
            stuck = "; ".join(f"rank {r} waits in [{', '.join(map(str, groups[r][g]))}]" for r, g in sorted(heads))
            raise PipelineOrderError(f"the pipeline's messages would hang under NCCL's in-order rule: {stuck}")
        for r, _ in moved:
            cursor[r] += 1
        rounds += 1
