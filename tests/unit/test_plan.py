"""Pure unit tests of the strategy-string grammar (strategies/plan.py): parse, print, validate, resolve."""

import itertools
import random

import pytest

from strategies.plan import VALID_TOKENS, DataMode, ParallelPlan, PipelineSchedule

EXAMPLES = [
    "dp",
    "naive",
    "zero2",
    "zero3_tp2_pp2",
    "tp4",
    "pp4_gpipe_mb8",
    "zero1_pp2_interleaved_v2_mb8_ac",
    "zero3_offload",
    "dp4",
    "zero3_dp4",
    "zero3_tp8_sp_async_vp_ac",
    "naive_dp2",
]


def assert_round_trips(plan: ParallelPlan) -> None:
    text = str(plan)
    again = ParallelPlan.parse(text)
    assert again == plan, f"{text!r} parsed back as {again!r}, not {plan!r}"
    assert str(again) == text


# -- parse and print ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", EXAMPLES)
def test_examples_parse_and_round_trip(text):
    plan = ParallelPlan.parse(text)
    assert_round_trips(plan)
    # Every example is already written canonically.
    assert str(plan) == text


def test_examples_parse_to_the_intended_fields():
    assert ParallelPlan.parse("dp") == ParallelPlan()
    assert ParallelPlan.parse("naive") == ParallelPlan(data=DataMode.NAIVE)
    assert ParallelPlan.parse("zero3_tp2_pp2") == ParallelPlan(data=DataMode.ZERO3, tp=2, pp=2)
    assert ParallelPlan.parse("pp4_gpipe_mb8") == ParallelPlan(pp=4, schedule=PipelineSchedule.GPIPE, microbatches=8)
    assert ParallelPlan.parse("zero1_pp2_interleaved_v2_mb8_ac") == ParallelPlan(
        data=DataMode.ZERO1, pp=2, schedule=PipelineSchedule.INTERLEAVED, virtual=2, microbatches=8, ac=True
    )
    assert ParallelPlan.parse("zero3_offload") == ParallelPlan(data=DataMode.ZERO3, offload=True)
    assert ParallelPlan.parse("dp4") == ParallelPlan(dp=4)
    assert ParallelPlan.parse("zero3_dp4") == ParallelPlan(data=DataMode.ZERO3, dp=4)
    assert ParallelPlan.parse("naive_dp2") == ParallelPlan(data=DataMode.NAIVE, dp=2)


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("dp_tp2", "tp2"),  # dp is the default mode and is left out beside other tokens
        ("ac_zero3", "zero3_ac"),  # fixed token order
        ("pp2_interleaved", "pp2_interleaved_v2"),  # interleaved defaults to 2 virtual stages
        ("ZERO3_TP2", "zero3_tp2"),  # upper case accepted
        ("Dp4", "dp4"),
        ("  zero2_tp2  ", "zero2_tp2"),  # surrounding whitespace ignored
        ("pp2_1f1b", "pp2_1f1b"),  # a schedule given stays (pp2 alone: the run chooses one)
        ("pp2_auto", "pp2"),
        ("tp1_pp1", "dp"),  # degree 1 is the default
        ("mb4_pp2_zero1", "zero1_pp2_mb4"),
        ("offload_ac_pp2_tp2_dp2_zero3", "zero3_dp2_tp2_pp2_ac_offload"),
        ("sp_ac_tp4_naive", "naive_tp4_sp_ac"),
    ],
)
def test_canonical_forms(text, canonical):
    plan = ParallelPlan.parse(text)
    assert str(plan) == canonical
    assert ParallelPlan.parse(canonical) == plan


def test_token_order_does_not_matter():
    rng = random.Random(0)
    for text in EXAMPLES + ["zero3_dp2_tp2_pp4_interleaved_v3_mb8_ac_offload"]:
        plan = ParallelPlan.parse(text)
        tokens = text.split("_")
        for _ in range(10):
            rng.shuffle(tokens)
            assert ParallelPlan.parse("_".join(tokens)) == plan


def test_default_plan_prints_as_dp():
    assert str(ParallelPlan()) == "dp"
    assert ParallelPlan.parse(str(ParallelPlan())) == ParallelPlan()


# -- property: every valid plan round-trips ----------------------------------------------------------------


def test_round_trip_over_a_grid_of_plans():
    grid = itertools.product(
        list(DataMode),
        (None, 1, 2),  # dp
        (1, 2, 4),  # tp
        (1, 2, 3, 4),  # pp
        list(PipelineSchedule),
        (1, 2, 3),  # virtual
        (None, 1, 2, 4, 6, 8),  # microbatches
        (False, True),  # sp
        (False, True),  # ac
        (False, True),  # offload
    )
    checked = rejected = 0
    for data, dp, tp, pp, schedule, virtual, microbatches, sp, ac, offload in grid:
        try:
            plan = ParallelPlan(
                data=data, dp=dp, tp=tp, pp=pp, schedule=schedule, virtual=virtual,
                microbatches=microbatches, sp=sp, ac=ac, offload=offload,
            )
        except ValueError:
            rejected += 1
            continue
        assert_round_trips(plan)
        checked += 1
    assert checked >= 100, checked
    assert rejected > 0  # the grid does reach the constructor's checks


def test_round_trip_with_hypothesis():
    hypothesis = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")

    degrees = st.integers(min_value=1, max_value=64)

    @st.composite
    def valid_plans(draw):
        # Draw only plans the constructor's rules allow, so no input is filtered out.
        data = draw(st.sampled_from(list(DataMode)))
        pp = draw(degrees)
        schedule = draw(st.sampled_from(list(PipelineSchedule))) if pp > 1 else PipelineSchedule.AUTO
        virtual = draw(st.integers(min_value=2, max_value=8)) if schedule is PipelineSchedule.INTERLEAVED else 1
        if pp == 1:
            microbatches = None
        elif schedule is PipelineSchedule.INTERLEAVED:
            microbatches = draw(st.none() | st.integers(1, 8).map(lambda k: k * pp))
        elif schedule in (PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.ZB1P):
            microbatches = draw(st.none() | st.integers(pp, pp + 64))
        elif schedule is PipelineSchedule.DUALPIPEV:
            microbatches = draw(st.none() | st.integers(2 * pp, 2 * pp + 64))
        else:
            microbatches = draw(st.none() | degrees)
        tp = draw(degrees)
        return ParallelPlan(
            data=data, dp=draw(st.none() | degrees), tp=tp, pp=pp, schedule=schedule,
            virtual=virtual, microbatches=microbatches, sp=tp > 1 and draw(st.booleans()),
            ac=draw(st.booleans()),
            offload=data.is_zero and draw(st.booleans()),
        )

    @hypothesis.settings(max_examples=200, deadline=None, derandomize=True)
    @hypothesis.given(valid_plans())
    def check(plan):
        assert_round_trips(plan)

    check()


# -- errors ------------------------------------------------------------------------------------------------


def parse_error(text) -> str:
    with pytest.raises(ValueError) as info:
        ParallelPlan.parse(text)
    return str(info.value)


@pytest.mark.parametrize("text, token", [("zero4", "zero4"), ("foo", "foo"), ("tp2_foo", "foo"), ("dp_tpx", "tpx")])
def test_unknown_token_is_named_and_valid_tokens_listed(text, token):
    message = parse_error(text)
    assert f"unknown token {token!r}" in message
    assert VALID_TOKENS in message
    assert repr(text) in message


def test_degree_zero():
    message = parse_error("tp0")
    assert "tp must be a positive integer, got 0" in message
    assert "'tp0'" in message
    assert "dp must be a positive integer" in parse_error("zero3_dp0")


@pytest.mark.parametrize(
    "text, token, field",
    [("dp_ac_ac", "ac", "ac"), ("zero1_zero2", "zero2", "data"), ("tp2_tp4", "tp4", "tp"),
     ("pp2_gpipe_1f1b", "1f1b", "schedule")],
)
def test_repeated_token(text, token, field):
    message = parse_error(text)
    assert f"{token!r} repeats the {field}" in message


@pytest.mark.parametrize("text", ["tp2_gpipe", "mb4", "interleaved_v2", "tp2_1f1b_mb2"])
def test_schedule_or_microbatches_without_pipeline(text):
    message = parse_error(text)
    assert "need pipeline parallelism (pp<N> with N > 1)" in message
    assert "accumulate_grad_batches" in message


@pytest.mark.parametrize("text", ["pp2_v2", "pp2_gpipe_v2", "pp2_interleaved_v1"])
def test_virtual_stages_need_interleaved(text):
    message = parse_error(text)
    assert "interleaved" in message and "v" in message
    assert repr(text) in message


def test_interleaved_microbatches_must_be_a_multiple_of_pp():
    message = parse_error("pp4_interleaved_mb6")
    assert "mb6 % pp4 != 0" in message
    assert str(ParallelPlan.parse("pp4_interleaved_mb8")) == "pp4_interleaved_v2_mb8"


@pytest.mark.parametrize("text", ["pp4_1f1b_mb2", "pp4_1f1b_mb3", "zero1_pp8_1f1b_mb4"])
def test_1f1b_needs_at_least_pp_microbatches(text):
    with pytest.raises(ValueError, match=r"1F1B needs at least as many microbatches as stages: mb\d < pp\d"):
        ParallelPlan.parse(text)
    ParallelPlan.parse(text.replace("_1f1b", "") + "_gpipe")  # GPipe takes any number


@pytest.mark.parametrize("text", ["sp", "dp_sp", "zero2_pp2_sp", "tp1_sp"])
def test_sequence_parallel_needs_tp(text):
    with pytest.raises(ValueError, match=r"sp \(sequence parallel\).*needs tp<N> with N > 1 \(e.g. 'tp2_sp'\)"):
        ParallelPlan.parse(text)


@pytest.mark.parametrize("text, says", [("tp2_async", "it needs sp (e.g. 'tp2_sp_async')"),
                                        ("tp2_sp_async_pp2_zbv", "defer them to W"),
                                        ("tp2_sp_async_pp2_dualpipev", "defer them to W"),
                                        ("tp2_sp_async_cp2", "context parallel")])
def test_async_tp_needs_sp_and_refuses_what_it_does_not_compose_with(text, says):
    assert says in parse_error(text)


@pytest.mark.parametrize("text", ["dp_offload", "naive_offload", "offload"])
def test_offload_needs_zero(text):
    message = parse_error(text)
    assert "offload" in message and "zero1, zero2 or zero3" in message
    assert "'zero3_offload'" in message


@pytest.mark.parametrize("text, suggestion",
                         [("zero34", "zero3_dp4"), ("naive2", "naive_dp2"), ("tp2_zero18", "zero1_dp8")])
def test_mode_with_glued_degree_suggests_dp_token(text, suggestion):
    message = parse_error(text)
    assert f"'{suggestion}'" in message
    assert repr(text.split("_")[-1]) in message


@pytest.mark.parametrize("text", ["", "   ", None, 3])
def test_empty_or_not_a_string(text):
    message = parse_error(text)
    assert "non-empty string" in message
    assert VALID_TOKENS in message


@pytest.mark.parametrize(
    "text, lightning_name, suggestion",
    [
        ("ddp_tp2", "ddp", "dp_tp2"),
        ("fsdp_tp2", "fsdp", "zero3_tp2"),
        ("deepspeed_stage_3_tp2", "deepspeed_stage_3", "zero3_tp2"),
        ("ddp_spawn_pp2", "ddp_spawn", "dp_pp2"),
        ("DDP_TP2", "ddp", "dp_tp2"),
        ("ddp", "ddp", "dp"),
    ],
)
def test_lightning_names_inside_a_plan_suggest_ours(text, lightning_name, suggestion):
    message = parse_error(text)
    assert f"{lightning_name!r} is Lightning's own strategy name" in message
    assert f"Did you mean '{suggestion}'?" in message
    assert VALID_TOKENS in message
    # ...and the suggestion itself is a valid plan.
    ParallelPlan.parse(suggestion)


def test_constructor_rejects_bad_types():
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        ParallelPlan(tp=True)
    with pytest.raises(ValueError, match="pp must be a positive integer"):
        ParallelPlan(pp=2.0)
    with pytest.raises(TypeError, match="ParallelPlan.parse"):
        ParallelPlan(data="zero3")


# -- resolve -----------------------------------------------------------------------------------------------


def test_resolve_fills_dp():
    resolved = ParallelPlan.parse("tp2_pp2").resolve(8)
    assert resolved.dp == 2
    assert str(resolved) == "dp2_tp2_pp2_mb2"
    assert ParallelPlan.parse("zero3").resolve(8).dp == 8
    assert ParallelPlan.parse("tp4").resolve(4).dp == 1


def test_resolve_fills_microbatches_only_with_a_pipeline():
    assert ParallelPlan.parse("pp4").resolve(8).microbatches == 4
    assert ParallelPlan.parse("pp4_mb16").resolve(8).microbatches == 16
    assert ParallelPlan.parse("tp2").resolve(8).microbatches is None
    assert str(ParallelPlan.parse("zero3_tp2_pp2").resolve(8)) == "zero3_dp2_tp2_pp2_mb2"
    assert str(ParallelPlan.parse("pp2_interleaved").resolve(4)) == "dp2_pp2_interleaved_v2_mb2"


def test_resolve_is_idempotent_and_round_trips():
    for text in EXAMPLES:
        plan = ParallelPlan.parse(text)
        world_size = (plan.dp or 2) * plan.tp * plan.pp
        resolved = plan.resolve(world_size)
        assert resolved.dp * resolved.tp * resolved.pp == world_size
        assert resolved.resolve(world_size) == resolved
        assert_round_trips(resolved)


def test_resolve_explicit_dp_mismatch_shows_the_arithmetic():
    with pytest.raises(ValueError) as info:
        ParallelPlan.parse("dp3_tp2_pp2").resolve(8)
    assert "dp(3) * tp(2) * pp(2) = 12 != world_size 8" in str(info.value)
    assert "'dp3_tp2_pp2'" in str(info.value)
    with pytest.raises(ValueError, match=r"dp\(4\) \* tp\(1\) \* pp\(1\) = 4 != world_size 2"):
        ParallelPlan.parse("dp4").resolve(2)


def test_resolve_tp_pp_must_divide_world_size():
    with pytest.raises(ValueError) as info:
        ParallelPlan.parse("zero3_tp3").resolve(8)
    assert "tp(3) * pp(1) = 3 does not divide world_size 8" in str(info.value)
    with pytest.raises(ValueError, match=r"tp\(2\) \* pp\(4\) = 8 does not divide world_size 4"):
        ParallelPlan.parse("tp2_pp4").resolve(4)


def test_resolve_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        ParallelPlan().resolve(0)


# -- coordinates -------------------------------------------------------------------------------------------


def test_coordinates_layout():
    plan = ParallelPlan.parse("tp2_pp2").resolve(8)
    coords = [plan.coordinates(rank) for rank in range(8)]
    tuples = [(c["pp"], c["dp"], c["tp"]) for c in coords]
    assert len(set(tuples)) == 8
    assert set(tuples) == set(itertools.product(range(2), range(2), range(2)))
    # tp innermost: neighbouring ranks differ only in tp.
    assert tuples[0] == (0, 0, 0) and tuples[1] == (0, 0, 1)
    # then dp, and pp outermost: the first half of the ranks is stage 0.
    assert tuples[2] == (0, 1, 0)
    assert [t[0] for t in tuples] == [0, 0, 0, 0, 1, 1, 1, 1]
    # The documented formula inverts it.
    for rank, c in enumerate(coords):
        assert (c["pp"] * plan.dp + c["dp"]) * plan.tp + c["tp"] == rank


def test_coordinates_need_a_resolved_plan():
    with pytest.raises(ValueError, match="resolve"):
        ParallelPlan.parse("tp2_pp2").coordinates(0)


# -- regressions: suggestions are always valid plans; v1, out-of-range ranks ------------------------------


@pytest.mark.parametrize(
    "text,suggested",
    [("tp2_ddp", "tp2_dp"), ("ddp_notebook_tp2", None), ("ddp_tp0", None),
     ("deepspeed_stage_3_offload_nvme_tp2", None)],
)
def test_lightning_name_suggestion_is_a_valid_plan_or_absent(text, suggested):
    with pytest.raises(ValueError) as info:
        ParallelPlan.parse(text)
    message = str(info.value)
    assert "Lightning's own strategy name" in message
    if suggested is None:
        assert "Did you mean" not in message and "Our equivalent" in message
    else:
        assert f"Did you mean '{suggested}'?" in message
        ParallelPlan.parse(suggested)


@pytest.mark.parametrize("text", ["pp2_gpipe_v1", "pp2_v1", "pp2_interleaved_v1"])
def test_v1_is_rejected_everywhere(text):
    with pytest.raises(ValueError, match="N >= 2"):
        ParallelPlan.parse(text)


def test_zero_mode_with_degree_zero_is_unknown_not_a_bad_suggestion():
    with pytest.raises(ValueError, match="unknown token 'zero30'"):
        ParallelPlan.parse("zero30")


@pytest.mark.parametrize("rank", [-1, 8])
def test_coordinates_reject_ranks_outside_the_plan(rank):
    with pytest.raises(ValueError, match="outside plan"):
        ParallelPlan.parse("tp2_pp2").resolve(8).coordinates(rank)


def test_the_mesh_says_when_tp_spans_nodes():
    from strategies.mesh import tp_across_nodes

    assert tp_across_nodes([0, 0, 1, 1], 2) is None  # two ranks per node: each tp pair inside one
    assert tp_across_nodes([0, 0, 1, 1], 1) is None
    advice = tp_across_nodes([0, 0, 0, 1, 1, 1], 2)  # three per node: ranks 2 and 3 straddle
    assert advice is not None and advice.startswith("tp2 spans nodes: the tensor-parallel group of ranks [2, 3] is on "
                                                    "2 nodes") and "use a tp that divides 3" in advice
    assert "divides 2" in tp_across_nodes([0, 0, 1, 1], 4)


def test_nccl_gets_hang_diagnosis_settings():
    from strategies.comm.recorder import nccl_environment

    normal, debug = nccl_environment(False), nccl_environment(True)
    assert normal["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and normal["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert "TORCH_NCCL_BLOCKING_WAIT" not in normal and debug["TORCH_NCCL_BLOCKING_WAIT"] == "1"


def test_cp_is_an_axis_between_tp_and_dp():
    plan = ParallelPlan.parse("cp2_tp2_zero3")
    assert str(plan) == "zero3_tp2_cp2" and ParallelPlan.parse(str(plan)) == plan
    resolved = plan.resolve(8)
    assert resolved.dp == 2
    coords = [resolved.coordinates(rank) for rank in range(8)]
    # tp innermost, then cp: a cp group's ranks are tp apart, a dp group's tp * cp apart.
    assert [(c["dp"], c["cp"], c["tp"]) for c in coords[:4]] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert coords[4]["dp"] == 1
    with pytest.raises(ValueError, match=r"dp\(3\) \* tp\(2\) \* pp\(1\) \* cp\(2\) = 12 != world_size 8"):
        ParallelPlan.parse("dp3_tp2_cp2").resolve(8)
    with pytest.raises(ValueError, match="cp must be a positive integer"):
        ParallelPlan(cp=0)


def test_ep_is_carved_out_of_the_data_ranks():
    plan = ParallelPlan.parse("ep2_pp2_zero3_tp2")
    assert str(plan) == "zero3_tp2_ep2_pp2" and ParallelPlan.parse(str(plan)) == plan
    resolved = plan.resolve(16)  # not a factor of the world size: dp fills what tp and pp leave
    assert resolved.dp == 4 and resolved.expert_data_ranks == 2
    assert ParallelPlan.parse("dp_cp2_ep4").resolve(4).expert_data_ranks == 1  # ep over dp x cp
    with pytest.raises(ValueError, match=r"ep\(4\) must divide the data ranks dp\(2\) \* cp\(1\) = 2"):
        ParallelPlan.parse("ep4_tp2").resolve(4)
    with pytest.raises(ValueError, match="parameter server"):
        ParallelPlan.parse("naive_ep2")


def test_the_interleaved_group_of_microbatches_is_a_token_that_frees_the_count():
    plan = ParallelPlan.parse("pp4_interleaved_mb10_mbg5")
    assert plan.group == 5 and str(plan) == "pp4_interleaved_v2_mb10_mbg5"
    assert_round_trips(plan)
    assert "mbg4" in parse_error("pp4_interleaved_mb6")  # the refusal says how to run 6
    assert "the interleaved schedule's" in parse_error("pp4_1f1b_mb8_mbg4")
