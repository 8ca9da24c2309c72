"""Pipeline schedules as data: for each rank, the ordered list of (phase, stage, microbatch) actions.

Stages are numbered globally, 0 .. pp*v - 1. Rank r owns stages r, r + pp, r + 2pp, ... (v of them; v = 1
unless interleaved), so consecutive stages always sit on neighbouring ranks and the model flows
0 -> 1 -> ... -> pp-1 -> 0 -> ... around the ring, v times. A forward of (stage s, microbatch m) needs the
forward of (s-1, m); a backward of (s, m) needs the backward of (s+1, m) and the forward of (s, m).

- GPipe: every forward, then every backward. Holds all mb microbatches' activations.
- 1F1B (PipeDream-flush): rank r runs pp-1-r warm-up forwards, then alternates one forward and one
  backward, then drains the backwards. Holds at most pp microbatches' activations on stage 0.
- Interleaved 1F1B (Megatron, Narayanan et al. 2021): the same with v model chunks per rank, taken in
  groups of pp microbatches; the bubble shrinks by v, at the cost of v times more p2p messages.

The bubble fraction of all three is (pp-1) / (mb + pp-1) in units of one stage's work, divided by v for
interleaved (`ideal_bubble`).
"""

from __future__ import annotations

import functools

from strategies.pipeline import zero_bubble
from strategies.pipeline.actions import Action, Phase, ScheduleTable, check_counts

__all__ = ["Action", "Phase", "ScheduleTable", "check_counts"]


def owner(stage: int, pp: int) -> int:
    """The pipeline rank that holds ``stage`` in the looped placement (GPipe, 1F1B, interleaved, ZB-H1)."""
    return stage % pp


def v_owner(stage: int, pp: int) -> int:
    """The pipeline rank that holds ``stage`` in the V placement (ZB-V, DualPipeV): down the ranks and back up, so
    rank r holds stages r and 2pp-1-r."""
    return stage if stage < pp else 2 * pp - 1 - stage


def owners(table: ScheduleTable) -> dict[int, int]:
    """Stage -> the rank whose actions run it: where a table places its stages."""
    return {a.stage: r for r, actions in enumerate(table) for a in actions}


def is_split(table: ScheduleTable) -> bool:
    """Whether the table runs weight gradients as actions of their own (then every B is the input's gradient only)."""
    return any(a.phase is Phase.WEIGHT for actions in table for a in actions)


def reducing(actions: list[Action]) -> set[Action]:
    """The actions whose backward reduces over dp: each parameter once, complete, in its stage's last backward (with W
    split off, the last B for what B finishes, the last W for the weights)."""
    last: dict[tuple[Phase, int], Action] = {}
    for action in actions:
        if action.phase is not Phase.FORWARD:
            last[(action.phase, action.stage)] = action
    return set(last.values())


def fused_weights(actions: list[Action], reducing: set[Action],
                  where: dict[int, int], across: bool = False) -> frozenset[tuple[int, int]]:
    """The (stage, microbatch) whose W the runner runs inside its B, as one full backward (torch's `_merge_bw` defines
    the merge): where the W directly follows its B in this rank's ``actions`` and B's input gradient goes to no other
    rank (stage 0, or the previous stage on this rank per ``where``, the V's bottom). Where it goes to another rank the
    split is what sends it one W sooner, which the receiver may be waiting for (merged anyway: pp2 ZB-V on 2 CPU ranks,
    10% slower a step), unless ``across``: the CPU time is what the step waits on (`messages.crowded`), and the split
    costs more than the receiver gains (pp4 on 2 CPU cores, merged: DualPipeV 0.96 -> 1.02 of torch's steps a second,
    4 ms less CPU a rank and step; ZB-V 1.07 -> 1.09). Not where only one of the two reduces over dp (``reducing``): a
    full backward reduces every gradient it makes, or none."""
    return frozenset((b.stage, b.microbatch) for b, w in zip(actions, actions[1:])
                     if b.phase is Phase.BACKWARD and w.phase is Phase.WEIGHT
                     and (b.stage, b.microbatch) == (w.stage, w.microbatch) and (b in reducing) == (w in reducing)
                     and (across or b.stage == 0 or where[b.stage - 1] == where[b.stage]))


def gpipe(pp: int, microbatches: int) -> ScheduleTable:
    """All forwards, then all backwards (in the same microbatch order)."""
    check_counts(pp, microbatches, 1)
    return [[Action(Phase.FORWARD, r, m) for m in range(microbatches)]
            + [Action(Phase.BACKWARD, r, m) for m in range(microbatches)] for r in range(pp)]


def one_f_one_b(pp: int, microbatches: int) -> ScheduleTable:
    """Warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    check_counts(pp, microbatches, 1)
    if microbatches < pp:
        raise ValueError(
            f"1F1B needs at least as many microbatches as stages: mb{microbatches} < pp{pp}; use mb{pp} or more, "
            "or the gpipe schedule"
        )
    out = []
    for r in range(pp):
        warmup = min(pp - 1 - r, microbatches)
        actions = [Action(Phase.FORWARD, r, m) for m in range(warmup)]
        backward = 0
        for m in range(warmup, microbatches):
            actions.append(Action(Phase.FORWARD, r, m))
            actions.append(Action(Phase.BACKWARD, r, backward))
            backward += 1
        actions += [Action(Phase.BACKWARD, r, m) for m in range(backward, microbatches)]
        out.append(actions)
    return out


def interleaved(pp: int, microbatches: int, virtual: int, group: int | None = None) -> ScheduleTable:
    """Interleaved 1F1B with ``virtual`` chunks per rank: stage c*pp + r is rank r's chunk c. Each chunk takes
    ``group`` microbatches in turn (Megatron's microbatch_group_size_per_vp_stage, Meta's N; default pp): the
    microbatches run in groups of that many, every chunk's forwards of a group before the next group's. A smaller
    group holds fewer microbatches in warm-up, a larger one hides more of the messages; any count of microbatches
    runs, the last group the rest (`check_interleaved` refuses a table that would wait forever)."""
    check_counts(pp, microbatches, virtual)
    if group is None and microbatches % pp:
        raise ValueError(f"interleaved needs the microbatches to be a multiple of pp: mb{microbatches} % pp{pp} != 0 "
                         f"(or set the group of microbatches per chunk: mbg<N>)")
    group = group or pp
    order = [(chunk, m) for start in range(0, microbatches, group) for chunk in range(virtual)
             for m in range(start, min(start + group, microbatches))]
    forwards = [Action(Phase.FORWARD, chunk * pp, m) for chunk, m in order]  # rank 0's; rank r adds r
    backwards = [Action(Phase.BACKWARD, (virtual - 1 - chunk) * pp, m) for chunk, m in order]  # chunks reversed
    total, out = len(order), []
    for r in range(pp):  # Megatron's warm-up, then one forward and one backward, then the backwards left
        warmup = min((pp - r - 1) * 2 + (virtual - 1) * group, total)
        steady = [a for k in range(warmup, total) for a in (forwards[k], backwards[k - warmup])]
        out.append([Action(a.phase, a.stage + r, a.microbatch)
                    for a in forwards[:warmup] + steady + backwards[total - warmup:]])
    return out


def check_interleaved(table: ScheduleTable, pp: int, microbatches: int, group: int) -> None:
    """Refuse an interleaved table that deadlocks (its groups of microbatches cannot feed the ring), saying why."""
    try:
        timeline(table)
    except RuntimeError:
        raise ValueError(f"interleaved with mb{microbatches} in groups of mbg{group} over pp{pp}: a rank would wait "
                         f"for a microbatch it must itself send first; use a group of at least pp ({pp}) whose "
                         f"last group (mb % group) is 0 or at least pp") from None


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1p", "zbv", "dualpipev")
V_PLACED = ("zbv", "dualpipev")  # two stages per rank, placed as a V (`v_owner`)


def build(schedule: str, pp: int, microbatches: int, virtual: int = 1, group: int | None = None) -> ScheduleTable:
    """The table for a plan's schedule name (`SCHEDULES`); ``virtual``: chunks per rank for interleaved, ``group``
    its microbatches per chunk in turn (None: pp)."""
    return [list(actions) for actions in _built(schedule, pp, microbatches, virtual, group)]


def shared(schedule: str, pp: int, microbatches: int, virtual: int = 1,
           group: int | None = None) -> tuple[tuple[Action, ...], ...]:
    """`build`'s table, made once and shared, as tuples: for readers that ask for the same tables many times (the
    estimator, for the planner)."""
    return _built(schedule, pp, microbatches, virtual, group)


@functools.lru_cache(maxsize=256)
def _built(schedule: str, pp: int, microbatches: int, virtual: int,
           group: int | None) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(actions) for actions in _build(schedule, pp, microbatches, virtual, group))


def _build(schedule: str, pp: int, microbatches: int, virtual: int, group: int | None) -> ScheduleTable:
    if group is not None and schedule != "interleaved":
        raise ValueError(f"mbg{group}: a group of microbatches per chunk is the interleaved schedule's, not "
                         f"{schedule}'s")
    if schedule == "gpipe":
        return gpipe(pp, microbatches)
    if schedule == "1f1b":
        return one_f_one_b(pp, microbatches)
    if schedule == "interleaved":
        table = interleaved(pp, microbatches, virtual, group)
        if group is not None:  # the default's groups are Megatron's, proven by the tests; another is checked here
            check_interleaved(table, pp, microbatches, group)
        return table
    if schedule in ("zb1p", "zbv", "dualpipev"):
        return getattr(zero_bubble, schedule)(pp, microbatches)
    raise ValueError(f"unknown pipeline schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")


def chunks_per_rank(schedule: str, virtual: int = 1) -> int:
    """Stages each rank holds under ``schedule``: v for interleaved, two for the V-placed ones, else one."""
    return 2 if schedule in V_PLACED else virtual


@functools.cache  # the planner asks it for the same few schedules hundreds of times
def ideal_bubble(pp: int, microbatches: int, virtual: int = 1, schedule: str = "1f1b",
                 group: int | None = None) -> float:
    """The idle fraction of a rank with equal stages (`timeline`'s costs): (pp-1) / (mb + pp-1) for GPipe and 1F1B,
    divided by v for interleaved in groups of pp; for the zero-bubble schedules and other groups, from the tables."""
    if schedule in ("gpipe", "1f1b") or (schedule == "interleaved" and group in (None, pp) and microbatches % pp == 0):
        return (pp - 1) / virtual / (microbatches + (pp - 1) / virtual)
    return table_bubble(build(schedule, pp, microbatches, virtual, group))


def table_bubble(table: ScheduleTable) -> float:
    """1 - (a rank's busy time) / (the step's span) on `timeline`'s costs, averaged over the ranks."""
    runs = timeline(table)
    span = max(end for actions in runs for _, _, end in actions)
    return sum(1 - sum(end - start for _, start, end in actions) / span for actions in runs) / len(runs)


def timeline(table: ScheduleTable) -> list[list[tuple[Action, float, float]]]:
    """Each rank's actions with their start and end when every stage costs the same: F 1, B 2 (1 when its W is an
    action of its own), W 1, each action starting once the rank is free and its inputs exist. Raises on deadlock."""
    split = is_split(table)
    return _play(table, len(table), {Phase.FORWARD: 1.0, Phase.BACKWARD: 1.0 if split else 2.0, Phase.WEIGHT: 1.0})


def _play(table: ScheduleTable, pp: int, cost: dict[Phase, float]) -> list[list[tuple[Action, float, float]]]:
    """Each rank's actions with their start and end at these costs per phase, each action starting once the rank is
    free and its inputs exist (`timeline`, `simulate`). Raises on deadlock."""
    done: dict[Action, float] = {}
    clock = [0.0] * pp
    out: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    last = max(a.stage for actions in table for a in actions)

    def run(r: int, action: Action) -> bool:
        start = clock[r]
        for need in dependencies(action, last):  # a plain loop: the planner plays tables of 50,000 actions
            end = done.get(need)
            if end is None:
                return False
            start = max(start, end)
        done[action] = clock[r] = start + cost[action.phase]
        out[r].append((action, start, clock[r]))
        return True

    stuck = _as_far_as_possible(table, pp, run)
    if stuck:
        raise RuntimeError(f"pipeline schedule deadlocks: ranks wait on {[str(a) for a in stuck]}")
    return out


def peak_in_flight(actions: list[Action]) -> int:
    """Most microbatches whose forward ran and whose backward has not (whose W has not, where W is split off), at
    any point of ``actions``: the activations the rank holds at its peak (in units of one chunk's activations)."""
    split = any(a.phase is Phase.WEIGHT for a in actions)
    live = peak = 0
    for action in actions:
        if action.phase is Phase.FORWARD:
            live += 1
        elif action.phase is (Phase.WEIGHT if split else Phase.BACKWARD):
            live -= 1
        peak = max(peak, live)
    return peak


def simulate(table: ScheduleTable, pp: int) -> list[list[tuple[Action, int]]]:
    """Run ``table`` on unit-time stages, each rank in its own order, an action starting once its inputs
    exist: the (action, start time) per rank. Raises if the table deadlocks (some action can never run)."""
    unit = dict.fromkeys(Phase, 1.0)
    return [[(action, int(start)) for action, start, _ in actions] for actions in _play(table, pp, unit)]


def _as_far_as_possible(table: ScheduleTable, pp: int, run) -> list[Action]:
    """Offer each rank its next action, round after round, while any ``run(rank, action)`` returns
    True (it ran); the actions the ranks are stuck on at the end (none: the table completes)."""
    cursor = [0] * pp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while cursor[r] < len(table[r]):
                if not run(r, table[r][cursor[r]]):
                    break
                cursor[r] += 1
                progress = True
    return [table[r][cursor[r]] for r in range(pp) if cursor[r] < len(table[r])]


def _producer(action: Action, last_stage: int) -> Action | None:
    """The action on another stage whose output ``action`` receives (a W receives nothing)."""
    s, m = action.stage, action.microbatch
    if action.phase is Phase.WEIGHT:
        return None
    if action.phase is Phase.FORWARD:
        return Action(Phase.FORWARD, s - 1, m) if s > 0 else None
    return Action(Phase.BACKWARD, s + 1, m) if s < last_stage else None


def dependencies(action: Action, last_stage: int) -> list[Action]:
    """What must have run before ``action``: its input's producer, a backward's own forward, a W its own B."""
    if action.phase is Phase.WEIGHT:
        return [Action(Phase.BACKWARD, action.stage, action.microbatch)]
    producer = _producer(action, last_stage)
    needs = [] if producer is None else [producer]
    if action.phase is Phase.BACKWARD:
        needs.insert(0, Action(Phase.FORWARD, action.stage, action.microbatch))
    return needs
