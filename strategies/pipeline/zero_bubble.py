"""Zero-bubble pipeline schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"; DeepSeek-V3's DualPipe in its
V-shaped, half-size form): each backward is split into B, the gradient of the stage's input (what the previous stage
waits for), and W, the gradients of its weights (what nobody waits for), so W can fill the pipeline's idle slots.

- ``zb1p`` (ZB-H1): 1F1B's order with every backward split, rank r holding back up to r of its W's and running them
  at its end, where 1F1B idles: with F, B and W of equal time the bubble falls from 1F1B's 3(p-1) units to (p-1),
  at 1F1B's memory (rank r keeps at most p - r microbatches between F and B).
- ``zbv`` (ZB-V): two stages per rank placed as a V (rank r holds stage r and stage 2p-1-r, so the first and the
  last stage share rank 0), in the paper's phases (warm-up forwards, then each microbatch's F, B and W together,
  steady state, drain); with fewer than 2p - 1 microbatches, built by list scheduling on unit-time actions (a rank
  runs a ready B first, else a ready F while it holds fewer than 2p chunk microbatches, else a W). About no bubble
  once m >= 2p, at the memory of 1F1B (2p half-size chunks), each microbatch crossing a rank boundary twice as often.
- ``dualpipev`` (DualPipeV): the same V placement; each rank warms up with forwards of its first chunk, then runs
  pairs of one chunk's forward beside the other chunk's backward (which DualPipe overlaps on a GPU; here they run one
  after the other), and ends splitting its backwards to fill the drain with W's. Needs m >= 2p.

Tables only: actions as `actions.Action` per rank, in order; `schedules.simulate` checks them.
"""

from __future__ import annotations

from collections import deque

from strategies.pipeline.actions import Action, Phase, ScheduleTable, check_counts


def zb1p(pp: int, microbatches: int) -> ScheduleTable:
    """ZB-H1: 1F1B with split backwards, rank r deferring up to r weight passes to its end."""
    check_counts(pp, microbatches, 1)
    if microbatches < pp:
        raise ValueError(f"zb1p needs at least as many microbatches as stages: mb{microbatches} < pp{pp}")
    table = []
    for r in range(pp):
        actions: list[Action] = []
        waiting: deque[int] = deque()  # microbatches whose W is still to run

        def backward(m: int) -> None:
            actions.append(Action(Phase.BACKWARD, r, m))
            waiting.append(m)
            if len(waiting) > r:  # rank r keeps r of them for its end
                actions.append(Action(Phase.WEIGHT, r, waiting.popleft()))
        warmup = pp - 1 - r
        actions += [Action(Phase.FORWARD, r, m) for m in range(warmup)]
        for k, m in enumerate(range(warmup, microbatches)):
            actions.append(Action(Phase.FORWARD, r, m))
            backward(k)
        for m in range(microbatches - warmup, microbatches):
            backward(m)
        actions += [Action(Phase.WEIGHT, r, m) for m in waiting]
        table.append(actions)
    return table


def zbv(pp: int, microbatches: int) -> ScheduleTable:
    """ZB-V: V placement, two chunks per rank. In phases where there are microbatches enough (m >= 2p - 1), else
    list-scheduled (`_zbv_listed`)."""
    if microbatches >= 2 * pp - 1:
        return _zbv_phased(pp, microbatches)
    return _zbv_listed(pp, microbatches)


def _zbv_phased(pp: int, microbatches: int) -> ScheduleTable:
    """ZB-V in the paper's phases, rank r holding stage r (the V's way down) and 2p-1-r (its way up): forwards down
    until the first microbatch could come back up, then each microbatch up as F, B, W at once, then the steady
    state (a forward down, a backward and its W down, the same up), then the drain. Every B is followed by its W
    where the drain leaves no idle slot to fill, which frees what B kept for W at once, and keeps the ranks in the
    rhythm real (unequal) action times allow: the list schedule below, built on unit times, defers W's that its
    unit-time idle slots suggest and left its ranks waiting on each other on real stages (measured, 2 CPU ranks,
    demo GPT at mb4: 15 ms a step of waiting against 5 ms this way)."""
    check_counts(pp, microbatches, 2)
    table = []
    for r in range(pp):
        down, up, actions = r, 2 * pp - 1 - r, []
        count = {(phase, s): 0 for phase in Phase for s in (down, up)}

        def run(*steps: tuple[Phase, int]) -> None:
            for phase, s in steps:
                actions.append(Action(phase, s, count[(phase, s)]))
                count[(phase, s)] += 1
        F, B, W = Phase.FORWARD, Phase.BACKWARD, Phase.WEIGHT
        run(*[(F, down)] * (2 * (pp - r) - 1))
        run(*[(F, up), (F, down)] * r)
        run(*[(F, up), (B, up), (W, up)] * (pp - r))
        while count[(F, up)] < count[(F, down)] or count[(F, down)] < microbatches:
            run(*([(F, down)] if count[(F, down)] < microbatches else []), (B, down), (W, down), (F, up), (B, up),
                (W, up))
        run(*[(B, down), (B, up)] * r)
        run(*[(B, down), (W, down)] * (pp - r))
        run(*[(W, up)] * (count[(B, up)] - count[(W, up)]), *[(W, down)] * (count[(B, down)] - count[(W, down)]))
        table.append(actions)
    return table


def _zbv_listed(pp: int, microbatches: int) -> ScheduleTable:
    """ZB-V with fewer than 2p - 1 microbatches: list-scheduled on unit-time F, B and W (B first, then F up to 2p chunk
    microbatches in flight, the later stage's first, then W)."""
    check_counts(pp, microbatches, 2)
    stages = 2 * pp
    done: dict[Action, int] = {}  # action -> the time step it ends
    table: list[list[Action]] = [[] for _ in range(pp)]
    next_of = {Phase.FORWARD: [0] * stages, Phase.BACKWARD: [0] * stages}  # each stage runs them in microbatch order
    held = [0] * pp  # chunk microbatches between their F and their W, per rank
    weights: list[deque[Action]] = [deque() for _ in range(pp)]
    total, t = 3 * stages * microbatches, 0
    while sum(map(len, table)) < total:
        for r in range(pp):
            action = _next_zbv(r, pp, microbatches, t, done, next_of, held[r] < stages, weights[r])
            if action is None:
                continue
            done[action] = t + 1
            table[r].append(action)
            if action.phase is Phase.WEIGHT:
                held[r] -= 1
                continue
            next_of[action.phase][action.stage] += 1
            if action.phase is Phase.FORWARD:
                held[r] += 1
            else:
                weights[r].append(Action(Phase.WEIGHT, action.stage, action.microbatch))
        t += 1
        if t > 4 * total:
            raise RuntimeError("zbv: the list scheduler made no progress")  # a bug, never the user's input
    return table


def _next_zbv(r: int, pp: int, microbatches: int, t: int, done: dict[Action, int],
              next_of: dict[Phase, list[int]], room: bool, weights: deque[Action]) -> Action | None:
    """Rank r's action at time step t: a ready B (oldest microbatch, later stage first), else a ready F if it has
    ``room`` (later stage first), else its oldest W whose B is done."""
    last = 2 * pp - 1

    def finished(action: Action) -> bool:
        return done.get(action, t + 1) <= t
    mine = (last - r, r)  # the later stage first
    backwards = [Action(Phase.BACKWARD, s, m) for s in mine if (m := next_of[Phase.BACKWARD][s]) < microbatches
                 and finished(Action(Phase.FORWARD, s, m))
                 and (s == last or finished(Action(Phase.BACKWARD, s + 1, m)))]
    if backwards:
        return min(backwards, key=lambda a: a.microbatch)
    if room:
        for s in mine:
            m = next_of[Phase.FORWARD][s]
            if m < microbatches and (s == 0 or finished(Action(Phase.FORWARD, s - 1, m))):
                return Action(Phase.FORWARD, s, m)
    if weights and finished(Action(Phase.BACKWARD, weights[0].stage, weights[0].microbatch)):
        return weights.popleft()
    return None


def dualpipev(pp: int, microbatches: int) -> ScheduleTable:
    """DualPipeV: V placement; per rank r, in phases: 2(p-r-1) forwards of chunk 0; r+1 forwards of both chunks;
    p-r-1 times a full backward of chunk 1 and a forward of chunk 1; then m-2p+r+1 times chunk 0's forward beside chunk
    1's backward and chunk 1's forward beside chunk 0's backward; p-r-1 times chunk 1's backward, then chunk 1's
    forward beside chunk 0's backward; r+1 times both chunks' backwards (chunk 0's W held back); p-r-1 times a held W
    then chunk 0's backward (its W held back); the r+1 held W's left."""
    check_counts(pp, microbatches, 2)
    if microbatches < 2 * pp:
        raise ValueError(f"dualpipev needs at least twice as many microbatches as pp: mb{microbatches} < 2 * pp{pp}")
    return [_dualpipev_rank(r, pp, microbatches) for r in range(pp)]


def _dualpipev_rank(r: int, pp: int, microbatches: int) -> list[Action]:
    chunk = (r, 2 * pp - 1 - r)
    out: list[Action] = []
    forward, backward = [0, 0], [0, 0]
    held: deque[Action] = deque()

    def f(c: int) -> None:
        out.append(Action(Phase.FORWARD, chunk[c], forward[c]))
        forward[c] += 1

    def b(c: int, split: bool = False) -> None:
        action = Action(Phase.BACKWARD, chunk[c], backward[c])
        backward[c] += 1
        out.append(action)
        if split:  # its W held back, for the drain
            held.append(Action(Phase.WEIGHT, action.stage, action.microbatch))
        else:  # a full backward: B and W at once
            out.append(Action(Phase.WEIGHT, action.stage, action.microbatch))
    for _ in range(2 * (pp - r - 1)):
        f(0)
    for _ in range(r + 1):
        f(0), f(1)
    for _ in range(pp - r - 1):
        b(1), f(1)
    for _ in range(microbatches - 2 * pp + r + 1):
        f(0), b(1), f(1), b(0)
    for _ in range(pp - r - 1):
        b(1), f(1), b(0)
    for _ in range(r + 1):
        b(1), b(0, split=True)
    for _ in range(pp - r - 1):
        out.append(held.popleft())
        b(0, split=True)
    out += held
    return out
