"""Pipeline schedule tables: every action once, dependencies respected, memory bounds, bubble."""

from __future__ import annotations

import pytest

from strategies.pipeline.schedules import (
    Action,
    Phase,
    build,
    gpipe,
    ideal_bubble,
    interleaved,
    one_f_one_b,
    owner,
    owners,
    peak_in_flight,
    simulate,
    table_bubble,
    timeline,
    v_owner,
)

CASES = [("gpipe", 2, 4, 1), ("gpipe", 4, 8, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 4, 1),
         ("1f1b", 3, 7, 1), ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2), ("interleaved", 2, 6, 3),
         ("gpipe", 1, 3, 1), ("zb1p", 2, 4, 1), ("zb1p", 4, 8, 1), ("zb1p", 3, 5, 1), ("zbv", 2, 4, 1),
         ("zbv", 4, 8, 1), ("zbv", 3, 2, 1), ("dualpipev", 2, 4, 1), ("dualpipev", 4, 8, 1), ("dualpipev", 3, 9, 1)]
IDS = [f"{s}-pp{p}-mb{m}-v{v}" for s, p, m, v in CASES]


@pytest.mark.parametrize("name,pp,mb,v", CASES, ids=IDS)
def test_every_forward_and_backward_once_on_its_owner(name: str, pp: int, mb: int, v: int):
    table = build(name, pp, mb, v)
    assert len(table) == pp
    v_shaped, split = name in ("zbv", "dualpipev"), name in ("zb1p", "zbv", "dualpipev")
    chunks = 2 if v_shaped else v
    phases = list(Phase) if split else [Phase.FORWARD, Phase.BACKWARD]  # a W for every B, or none
    expected = {Action(phase, s, m) for phase in phases for s in range(pp * chunks) for m in range(mb)}
    seen = [a for actions in table for a in actions]
    assert len(seen) == len(set(seen)) == len(expected) and set(seen) == expected
    where = owners(table)
    assert where == {s: (v_owner(s, pp) if v_shaped else owner(s, pp)) for s in range(pp * chunks)}
    for r, actions in enumerate(table):
        assert all(where[a.stage] == r for a in actions)
        position = {a: i for i, a in enumerate(actions)}
        for a in actions:  # a stage's own forward comes before its backward, its backward before its W
            if a.phase is Phase.BACKWARD:
                assert position[Action(Phase.FORWARD, a.stage, a.microbatch)] < position[a]
            if a.phase is Phase.WEIGHT:
                assert position[Action(Phase.BACKWARD, a.stage, a.microbatch)] < position[a]


@pytest.mark.parametrize("name,pp,mb,v", CASES, ids=IDS)
def test_dependencies_between_stages_are_respected(name: str, pp: int, mb: int, v: int):
    # Unit-time simulation: each action starts after what it needs, and no rank waits forever.
    timeline = simulate(build(name, pp, mb, v), pp)
    start = {a: t for rank in timeline for a, t in rank}
    last = pp * v - 1
    for a, t in start.items():
        if a.phase is Phase.FORWARD and a.stage > 0:
            assert start[Action(Phase.FORWARD, a.stage - 1, a.microbatch)] < t
        if a.phase is Phase.BACKWARD:
            assert start[Action(Phase.FORWARD, a.stage, a.microbatch)] < t
            if a.stage < last:
                assert start[Action(Phase.BACKWARD, a.stage + 1, a.microbatch)] < t


@pytest.mark.parametrize("pp,mb", [(2, 4), (4, 8), (4, 4), (3, 9)])
def test_1f1b_holds_at_most_pp_microbatches_and_gpipe_holds_all(pp: int, mb: int):
    assert peak_in_flight(one_f_one_b(pp, mb)[0]) == pp  # stage 0 warms up with pp-1, then one more
    for r, actions in enumerate(one_f_one_b(pp, mb)):
        assert peak_in_flight(actions) == pp - r
    assert all(peak_in_flight(actions) == mb for actions in gpipe(pp, mb))


def test_interleaved_holds_fewer_chunks_than_gpipe():
    pp, mb, v = 4, 8, 2
    table = interleaved(pp, mb, v)
    assert peak_in_flight(table[0]) < mb * v  # chunk-microbatches in flight, below all of them


@pytest.mark.parametrize("name,pp,mb,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 2, 4, 1)])
def test_simulated_bubble_equals_theory(name: str, pp: int, mb: int, v: int):
    # With unit forward and backward, each rank works 2*mb units in a makespan of 2*(mb + pp - 1).
    timeline = simulate(build(name, pp, mb, v), pp)
    makespan = max(t + 1 for rank in timeline for _, t in rank)
    busy = 2 * mb * v
    assert 1 - busy / makespan == pytest.approx(ideal_bubble(pp, mb, v))


def test_interleaved_bubble_is_smaller():
    # Each chunk is 1/v of the model: in units of a chunk, a rank works 2*mb*v units per step.
    pp, mb, v = 4, 8, 2

    def bubble(table, work):
        makespan = max(t + 1 for rank in simulate(table, pp) for _, t in rank)
        return 1 - work / makespan

    assert bubble(interleaved(pp, mb, v), 2 * mb * v) < bubble(one_f_one_b(pp, mb), 2 * mb)
    assert ideal_bubble(pp, mb, v) < ideal_bubble(pp, mb)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="mb2 < pp4"):
        one_f_one_b(4, 2)
    with pytest.raises(ValueError, match="mb6 % pp4"):
        interleaved(4, 6, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        build("zigzag", 2, 2)


def test_table_of_pp2_1f1b_mb4():
    as_text = [" ".join(map(str, actions)) for actions in one_f_one_b(2, 4)]
    assert as_text == ["F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3", "F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3"]


@pytest.mark.parametrize("pp,mb", [(2, 4), (4, 8), (4, 16), (3, 6)])
def test_zero_bubble_schedules_shrink_the_bubble_at_1f1bs_memory(pp: int, mb: int):
    # On stages of equal cost (F 1, B 2; split: B 1, W 1). ZB-H1: the bubble of (p-1)/(3m+p-1), a third of 1F1B's
    # in time units, and rank 0 holds no more microbatches than under 1F1B (the last rank holds back p-1 W's).
    one = table_bubble(one_f_one_b(pp, mb))
    assert one == pytest.approx(ideal_bubble(pp, mb))
    assert table_bubble(build("zb1p", pp, mb)) == pytest.approx((pp - 1) / (3 * mb + pp - 1))
    assert peak_in_flight(build("zb1p", pp, mb)[0]) == peak_in_flight(one_f_one_b(pp, mb)[0]) == pp
    # ZB-V and DualPipeV (V placement, two half-size chunks per rank): at most half of 1F1B's bubble; ZB-V holds at
    # most 2p chunk-microbatches (p full ones, 1F1B's rank 0).
    zbv = build("zbv", pp, mb)
    assert table_bubble(zbv) <= one / 2 and max(peak_in_flight(a) for a in zbv) <= 2 * pp
    if mb >= 2 * pp:
        assert table_bubble(build("dualpipev", pp, mb)) <= one / 2


def test_timeline_costs_split_and_full_backwards():
    full = {a: end - start for rank in timeline(one_f_one_b(2, 2)) for a, start, end in rank}
    split = {a: end - start for rank in timeline(build("zb1p", 2, 2)) for a, start, end in rank}
    assert full[Action(Phase.BACKWARD, 0, 0)] == 2 and split[Action(Phase.BACKWARD, 0, 0)] == 1
    assert split[Action(Phase.WEIGHT, 0, 0)] == 1 and full[Action(Phase.FORWARD, 0, 0)] == 1


def test_zero_bubble_refuses_too_few_microbatches():
    with pytest.raises(ValueError, match="zb1p needs at least as many microbatches as stages"):
        build("zb1p", 4, 2)
    with pytest.raises(ValueError, match="dualpipev needs at least twice as many microbatches"):
        build("dualpipev", 4, 6)


def test_a_w_right_after_its_own_b_runs_inside_it_where_no_rank_waits_for_bs_gradient():
    from strategies.pipeline.schedules import fused_weights, reducing

    def table(text: str) -> list[Action]:
        return [Action(Phase(a[0]), int(a[1]), int(a[3])) for a in text.split()]

    alone = {0: 0, 1: 1}  # stage 0 sends no gradient back: its adjacent B and W merge (the last pair reduces in both)
    ahead = table("F0.0 F0.1 B0.0 W0.0 F0.2 B0.1 F0.3 B0.2 W0.1 W0.2 B0.3 W0.3")
    assert fused_weights(ahead, reducing(ahead), alone) == {(0, 0), (0, 3)}  # W's held back stay split
    # B0.1 is the stage's last B (it reduces what B finishes) but W0.1 is not its last W: a full backward would reduce
    # the weights before W0.0 adds to them, so the pair stays split.
    behind = table("F0.0 F0.1 B0.0 B0.1 W0.1 W0.0")
    assert fused_weights(behind, reducing(behind), alone) == set()
    # Stage 1's B sends its input's gradient to stage 0 on another rank, which may wait: split; on one rank, merged.
    sends = table("F1.0 B1.0 W1.0")
    assert fused_weights(sends, reducing(sends), alone) == set()
    assert fused_weights(sends, reducing(sends), {0: 0, 1: 0}) == {(1, 0)}
    assert fused_weights(sends, reducing(sends), alone, across=True) == {(1, 0)}  # where the CPU is short: merged
    assert fused_weights(ahead, reducing(ahead), alone, across=True) == {(0, 0), (0, 3)}  # held W's: still split
    # ZB-V at pp2: rank 0's stage 0 and rank 1's stage 2 (the V's bottom, after stage 1 on the same rank).
    zbv = build("zbv", 2, 4)
    assert fused_weights(zbv[0], reducing(zbv[0]), owners(zbv)) == {(0, m) for m in range(4)}
    assert {s for s, _ in fused_weights(zbv[1], reducing(zbv[1]), owners(zbv))} == {2}


GROUPS = [(4, 10, 2, 5), (4, 6, 2, 4), (2, 3, 2, 3), (4, 16, 2, 8), (3, 7, 3, 3)]


@pytest.mark.parametrize("pp,mb,v,group", GROUPS, ids=[f"pp{p}-mb{m}-v{v}-mbg{g}" for p, m, v, g in GROUPS])
def test_interleaved_in_groups_runs_every_action_once_in_its_groups_and_holds_megatrons_warmup(pp, mb, v, group):
    table = build("interleaved", pp, mb, v, group)
    expected = {Action(phase, s, m) for phase in (Phase.FORWARD, Phase.BACKWARD) for s in range(pp * v)
                for m in range(mb)}
    seen = [a for actions in table for a in actions]
    assert len(seen) == len(expected) and set(seen) == expected
    simulate(table, pp)  # no rank waits forever
    # Rank 0's forwards: each chunk takes `group` microbatches in turn (the last group the rest)
    forwards = [(a.stage // pp, a.microbatch) for a in table[0] if a.phase is Phase.FORWARD]
    assert forwards == [(c, m) for start in range(0, mb, group) for c in range(v)
                        for m in range(start, min(start + group, mb))]
    # Megatron's warm-up, (pp - r - 1) x 2 + (v - 1) x group forwards, then one more before the first backward
    for r, actions in enumerate(table):
        assert peak_in_flight(actions) == min((pp - r - 1) * 2 + (v - 1) * group + 1, mb * v)


def test_a_group_of_pp_is_the_default_table_and_a_larger_group_holds_more():
    assert build("interleaved", 4, 8, 2, 4) == build("interleaved", 4, 8, 2)
    held = [peak_in_flight(build("interleaved", 4, 16, 2, g)[0]) for g in (4, 8, 16)]
    assert held == [11, 15, 23]
    assert ideal_bubble(4, 8, 2, "interleaved", 4) == ideal_bubble(4, 8, 2, "interleaved")


@pytest.mark.parametrize("pp,mb,group", [(16, 32, 5), (4, 8, 2), (8, 16, 6)])
def test_a_group_that_cannot_feed_the_ring_is_refused(pp, mb, group):
    # (16, 32, 5): Meta's N = 5 (the paper's figure, at pp 4) at pp 16: rank 0's warm-up needs a microbatch rank 15
    # sends only after the backward that waits on rank 0. A group below pp is checked by playing the table (4, 12, 3
    # runs); Megatron's rule, which the message gives, always runs:
    with pytest.raises(ValueError, match=f"groups of mbg{group} over pp{pp}.*at least pp"):
        build("interleaved", pp, mb, 2, group)
    for p, v, m in ((2, 2, 5), (4, 2, 10), (4, 3, 9), (8, 2, 20)):
        for g in range(p, m + 1):
            if m % g == 0 or m % g >= p:
                simulate(build("interleaved", p, m, v, g), p)


def test_a_group_belongs_to_the_interleaved_schedule():
    with pytest.raises(ValueError, match="mbg4: a group of microbatches per chunk is the interleaved schedule's"):
        build("1f1b", 4, 8, 1, 4)
