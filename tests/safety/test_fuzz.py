"""Fuzzing the strategy-string grammar and PlanStrategy's arguments (issue #10: reliability and security).

The rule, for every input however malformed (random strings, mutated valid plans, junk of any type):

- ``ParallelPlan.parse(text)`` returns a plan that round-trips (``parse(str(p)) == p``), having read only tokens
  of the grammar, or raises ValueError whose message names the offending token (for tokens that do not
  combine, the tokens involved) beyond merely quoting the whole input. Any other exception is a failure.
- ``plan.resolve(world_size)`` returns a plan over exactly ``world_size`` ranks, or raises ValueError naming
  the world size (and, for arithmetic that does not fit, the degrees); it fails exactly when the arithmetic
  does not fit or ``world_size`` is not an int in 1..2**31 - 1.
- ``PlanStrategy(...)`` (and its subclasses, and plan names through Lightning's registry) constructs, or raises
  ValueError naming a bad argument. One rule for wrong types too: a value the user wrote wrong is a
  ValueError naming the argument whether its type or its range is wrong, as ParallelPlan already does for
  its degrees (``tp=2.0``). TypeError is left to Python's own calling errors (an unknown keyword). Building
  one is cheap and starts no process, thread or process group.

Settings: derandomized (the same examples on every run), no deadline, 300 examples per property.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import re
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry

import strategies
from strategies.lightning import PlanStrategy
from strategies.lightning.names import looks_like_plan
from strategies.lightning.options import TIMEOUT_ENV, collective_timeout
from strategies.plan import MAX_DEGREE, VALID_TOKENS, DataMode, ParallelPlan, PipelineSchedule
from strategies.tensor_parallel.plans import FUSED_QKV_PLAN, Colwise, Rowwise
from strategies.zero.stage3 import default_units

hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")

EXAMPLES = 300
SETTINGS = hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)
# Independent of plan.py: what a single token of the grammar looks like.
GRAMMAR = re.compile(
    r"naive|dp|zero[123]|gpipe|1f1b|interleaved|zb1p|zbv|dualpipev|auto|sp|vp|s?ac|offload|(dp|tp|pp|cp|v|mb|ac)[0-9]+")
WORDS = ["naive", "dp", "zero1", "zero2", "zero3", "gpipe", "1f1b", "interleaved", "zb1p", "zbv", "dualpipev", "sp",
         "ac", "sac", "offload"]
NEAR_MISSES = [
    "tp0", "pp-1", "zer03", "mb", "dp2_dp2", "zero4", "zero0", "zero30", "zero34", "naive2", "tp", "v", "v0", "v1",
    "tpx", "TP2", "Zero3", "tp 2", " tp2", "tp2 ", "tp\u0663", "\uff54\uff502", "tp\u00b2", "\u0130", "\u00df",
    "ddp", "fsdp", "deepspeed_stage_3", "ddp_spawn", "fsdp_cpu_offload", "ddp_notebook", "", "_", "__", "\t", "\n",
    "\x00", "1f2b", "gpipe1", "dp+2", "tp2.0", "tp1e3", "tp99999999999999999999", "tp" + "9" * 5000,
    "mb" + "0" * 50 + "4", f"dp{MAX_DEGREE}", f"dp{MAX_DEGREE + 1}", "_" * 40, "sp_sp", "offload1", "acac", "ac_sac",
]


# -- generators ------------------------------------------------------------------------------------------


def degree_token(draw, head: str, value: int) -> str:
    return f"{head}{'0' * draw(st.integers(0, 2))}{value}"  # leading zeros are allowed and dropped


@st.composite
def valid_texts(draw) -> tuple[str, ParallelPlan]:
    """A valid plan as a user might write it, with the plan it means: tokens in any order, any case, degrees
    with leading zeros, defaults sometimes spelled out (test_plan checks canonical strings; these are not)."""
    degrees = st.integers(1, 64) | st.integers(1, MAX_DEGREE)
    data, dp, tp, pp = (draw(st.sampled_from(list(DataMode))), draw(st.none() | degrees), draw(degrees),
                        draw(st.integers(1, 16)))
    schedule = draw(st.sampled_from(list(PipelineSchedule))) if pp > 1 else PipelineSchedule.AUTO
    virtual = draw(st.integers(2, 8)) if schedule is PipelineSchedule.INTERLEAVED else 1
    microbatches = None
    if pp > 1 and draw(st.booleans()):
        by_schedule = {PipelineSchedule.INTERLEAVED: pp * draw(st.integers(1, 8)),
                       PipelineSchedule.ONE_F_ONE_B: draw(st.integers(pp, pp + 64)),
                       PipelineSchedule.ZB1P: draw(st.integers(pp, pp + 64)),
                       PipelineSchedule.DUALPIPEV: draw(st.integers(2 * pp, 2 * pp + 64))}
        microbatches = by_schedule.get(schedule, draw(st.integers(1, 64)))
    recompute = draw(st.sampled_from(["", "ac", "sac", "ac2", "ac16"]))
    fields = dict(data=data, dp=dp, tp=tp, pp=pp, schedule=schedule, virtual=virtual, microbatches=microbatches,
                  sp=tp > 1 and draw(st.booleans()), ac=recompute.startswith("ac"), sac=recompute == "sac",
                  ac_every=int(recompute[2:] or 1) if recompute.startswith("ac") else 1,
                  offload=data.is_zero and draw(st.booleans()))
    tokens = [data.value] if data is not DataMode.DP or draw(st.booleans()) else []
    for head, value, default in (("dp", dp, None), ("tp", tp, 1), ("pp", pp, 1), ("mb", microbatches, None)):
        if value is not None and (value != default or draw(st.booleans())):
            tokens.append(degree_token(draw, head, value))
    if schedule is not PipelineSchedule.AUTO or draw(st.booleans()):  # "auto" may be spelled out
        tokens.append(schedule.value)
    if virtual > 2 or (virtual == 2 and draw(st.booleans())):
        tokens.append(degree_token(draw, "v", virtual))
    tokens += [name for name in ("sp", "sac", "offload") if fields[name]] + ([recompute] if fields["ac"] else [])
    tokens = [t.upper() if draw(st.booleans()) else t for t in draw(st.permutations(tokens or ["dp"]))]
    pad = draw(st.sampled_from(["", " ", "\t", "\n  "]))
    return pad + "_".join(tokens) + pad, ParallelPlan(**fields)


def token_strategy():
    letters = st.sampled_from(list("_dptzerovmbnaivgplfcs0123456789 -.")) | st.characters()
    digits = st.integers(0, 10**12).map(str) | st.text("0123456789", min_size=1, max_size=30)
    return st.one_of(
        st.sampled_from(WORDS), st.sampled_from(NEAR_MISSES),
        st.builds(lambda head, n: head + n, st.sampled_from(["dp", "tp", "pp", "v", "mb", "zero3", "naive"]), digits),
        st.text(letters, max_size=8), st.text(max_size=4),
    )


@st.composite
def random_texts(draw) -> str:
    tokens = draw(st.lists(token_strategy(), max_size=8))
    separator = draw(st.sampled_from(["_", "_", "_", "__", "-", " "]))
    return draw(st.sampled_from(["", " ", "\u00a0", "\n"])) + separator.join(tokens)


def _mutate(draw, text: str) -> str:
    tokens = text.split("_")
    i = draw(st.integers(0, max(len(text) - 1, 0)))
    t, u = draw(st.integers(0, len(tokens) - 1)), draw(st.integers(0, len(tokens) - 1))
    swapped = list(tokens)
    swapped[t], swapped[u] = swapped[u], swapped[t]
    char = draw(st.sampled_from(list("_0123456789 -xv")) | st.characters())
    return draw(st.sampled_from([
        text[:i] + text[i + 1:],  # drop a character
        text[:i] + text[i:i + 1] * 2 + text[i + 1:],  # duplicate one
        text[:i] + text[i + 1:i + 2] + text[i:i + 1] + text[i + 2:],  # swap two neighbours
        text[:i] + char + text[i:],  # insert one
        "_".join(swapped),  # swap two tokens
        "_".join(tokens[:t] + tokens[t:t + 1] * 2 + tokens[t + 1:]),  # duplicate a token
        "_".join(tokens[:t] + tokens[t + 1:]),  # drop a token
        "_".join(tokens[:t] + [draw(st.sampled_from(NEAR_MISSES))] + tokens[t + 1:]),  # a near miss for a token
        "_".join(tokens[:t] + [re.sub(r"[0-9]+", draw(st.sampled_from(["0", "00", "-1", "1", "9" * 30, "\u0663"])),
                                      tokens[t])] + tokens[t + 1:]),  # another degree for a token
    ]))


@st.composite
def mutated_texts(draw) -> str:
    text, plan = draw(valid_texts())
    text = str(plan) if draw(st.booleans()) else text  # canonical or as written
    for _ in range(draw(st.integers(1, 3))):
        text = _mutate(draw, text)
    return text


# -- the properties --------------------------------------------------------------------------------------


def _normalised(token: str) -> str:
    match = re.fullmatch(r"(dp|tp|pp|cp|v|mb)0*([0-9]{1,12})", token)
    return f"{match.group(1)}{int(match.group(2))}" if match else token


def check_parse(text) -> ParallelPlan | None:
    """parse(text) round-trips or raises ValueError naming a token; any other exception fails the test."""
    try:
        plan = ParallelPlan.parse(text)
    except ValueError as err:
        check_names_a_token(text, str(err))
        return None
    again = ParallelPlan.parse(str(plan))
    assert again == plan and str(again) == str(plan), f"{text!r} -> {plan!r} does not round-trip"
    outside = [t for t in text.strip().lower().split("_") if not GRAMMAR.fullmatch(t)]
    assert not outside, f"{text!r} parsed as '{plan}' though {outside} are not tokens of the grammar"
    return plan


def check_names_a_token(text, message: str) -> None:
    if not isinstance(text, str) or not text.strip():
        assert "non-empty string" in message, message
        return
    tokens = text.strip().lower().split("_")
    bad = [t for t in tokens if not GRAMMAR.fullmatch(t)]
    rest = message.replace(repr(text), "", 1).replace(VALID_TOKENS, "")  # what the message says beyond quoting
    if "unknown token" in message:
        assert any(f"unknown token {t!r}" in rest for t in bad), (text, message)
    elif "empty token" in message:
        assert "" in tokens, (text, message)
    elif "Lightning's own strategy name" in message:
        assert any(t and t in rest for t in bad), (text, message)
    else:
        named = {t for t in tokens if t} | {_normalised(t) for t in tokens if t}
        assert any(t in rest for t in named), f"{message!r} names none of the tokens of {text!r}"


def test_parse_random_strings():
    @SETTINGS
    @hypothesis.given(random_texts())
    def check(text):
        check_parse(text)

    check()


def test_parse_mutated_plans():
    @SETTINGS
    @hypothesis.given(mutated_texts())
    def check(text):
        check_parse(text)

    check()


def test_parse_valid_plans_in_any_spelling():
    @SETTINGS
    @hypothesis.given(valid_texts())
    def check(case):
        text, plan = case
        assert check_parse(text) == plan, text

    check()


@pytest.mark.parametrize("junk", [None, 3, 2.5, b"dp", ["dp"], {"dp": 1}, object(), "", " \t\n", "\u00a0"])
def test_parse_non_strings_and_blanks(junk):
    check_parse(junk)


WORLD_SIZES = st.integers(-4, 64) | st.sampled_from([0, -1, 2**31, 10**20])
JUNK_WORLD_SIZES = st.sampled_from([None, True, False, 8.0, 1.5, float("nan"), float("inf"), "8", b"8", [8]])


def check_resolve(plan: ParallelPlan, world_size) -> None:
    is_count = isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1
    fits = is_count and world_size <= MAX_DEGREE and (plan.dp * plan.tp * plan.pp == world_size if plan.dp is not None
                         else world_size % (plan.tp * plan.pp) == 0)
    try:
        resolved = plan.resolve(world_size)
    except ValueError as err:
        message = str(err)
        assert not fits, f"'{plan}'.resolve({world_size!r}) refused a world size that fits: {message}"
        if not is_count:
            assert f"world_size must be >= 1 (an integer number of ranks), got {world_size!r}" in message
        else:
            assert f"world_size {world_size}" in message, message
            assert world_size > MAX_DEGREE or f"tp({plan.tp}) * pp({plan.pp})" in message, message
        return
    assert fits, f"'{plan}'.resolve({world_size!r}) accepted a world size that does not fit"
    assert resolved.dp * resolved.tp * resolved.pp == world_size
    assert (resolved.microbatches is not None) == (resolved.pp > 1)
    assert resolved.resolve(world_size) == resolved
    assert ParallelPlan.parse(str(resolved)) == resolved


def test_resolve_any_world_size():
    @SETTINGS
    @hypothesis.given(valid_texts(), WORLD_SIZES | JUNK_WORLD_SIZES)
    def check(case, world_size):
        check_resolve(case[1], world_size)

    check()


def test_resolve_world_sizes_1_to_64_for_fitting_plans():
    # Drawn plans rarely fit a small world; these do, for some of 1..64, and fail clearly for the others.
    for text in ["dp", "zero3", "tp2", "pp4", "zero3_tp2_pp2", "dp3_tp2", "pp2_interleaved_mb4", "naive_dp8"]:
        for world_size in range(-1, 65):
            check_resolve(ParallelPlan.parse(text), world_size)


# -- PlanStrategy's arguments ------------------------------------------------------------------------------


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_timeout(v) -> bool:
    if isinstance(v, timedelta):
        return v.total_seconds() > 0
    if not _is_number(v) or not 0 < v <= timedelta.max.total_seconds():  # also False for nan
        return False
    try:
        return timedelta(seconds=float(v)) > timedelta(0)
    except OverflowError:  # just below timedelta.max, rounding up
        return False


# What each argument accepts, written independently of lightning.py.
VALID = {
    "bucket_cap_mb": lambda v: _is_number(v) and 0 < v and v * 2**20 < math.inf,  # megabytes, as bytes finite
    "find_unused_parameters": lambda v: isinstance(v, bool),
    "ring_all_reduce": lambda v: isinstance(v, bool),
    "server_rank": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "zero3_units": lambda v: v is None or callable(v),
    "tp_plan": lambda v: v is None or isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(s, (Colwise, Rowwise)) for k, s in v.items()),
    "pipeline_blocks": lambda v: v is None or isinstance(v, str) and v != "",
    "pipeline_balance": lambda v: isinstance(v, str) and v in ("params", "time"),
    "process_group_backend": lambda v: v is None or isinstance(v, str) and v != "",
    "timeout": lambda v: v is None or _is_timeout(v),
    "start_method": lambda v: isinstance(v, str) and v in ("popen", "spawn", "fork", "forkserver"),
}
GOOD = {
    "bucket_cap_mb": st.floats(1e-3, 1e6) | st.integers(1, 1000),
    "find_unused_parameters": st.booleans(),
    "ring_all_reduce": st.booleans(),
    "server_rank": st.integers(0, 64),
    "zero3_units": st.sampled_from([None, default_units, lambda module: []]),
    "tp_plan": st.sampled_from([None, FUSED_QKV_PLAN, {}, {"*.fc": Colwise(chunks=2)}]),
    "pipeline_blocks": st.none() | st.text(min_size=1, max_size=12),
    "pipeline_balance": st.sampled_from(["params", "time"]),
    "process_group_backend": st.sampled_from([None, "gloo", "nccl", "cpu:gloo,cuda:nccl"]),
    "timeout": st.none() | st.floats(1e-3, 1e6) | st.integers(1, 10**6) | st.timedeltas(min_value=timedelta(seconds=1)),
    "start_method": st.sampled_from(["popen", "spawn", "fork", "forkserver"]),
}
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8), st.binary(max_size=4),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers() | st.text(), max_size=2),
    st.timedeltas(),
    st.sampled_from([object(), float("nan"), float("inf"), -float("inf"), 1e308, -0.0, 0, -1, "25", "True", "False",
                     "params ", "PARAMS", "Spawn", "popen\n", "", {"*.fc": "colwise"}, {3: Rowwise()}, [Rowwise()],
                     timedelta(0), timedelta(seconds=-1), timedelta.max, 1e17, 2**64, 2.5, "0"]),
)


@st.composite
def constructor_calls(draw):
    kwargs = {}
    for name in GOOD:
        choice = draw(st.sampled_from(["leave out", "leave out", "good", "junk"]))
        if choice != "leave out":
            kwargs[name] = draw(GOOD[name] if choice == "good" else JUNK)
    cls = draw(st.sampled_from([PlanStrategy, strategies.DataParallelStrategy, strategies.NaiveDataParallelStrategy]))
    plan = "dp"
    if cls is PlanStrategy:
        plan = draw(st.one_of(st.sampled_from(["dp", "naive_dp2", "zero3_tp2_pp2", ParallelPlan(tp=2)]),
                              valid_texts().map(lambda case: case[0]), random_texts(), JUNK))
    return cls, plan, kwargs


def check_construct(cls, plan, kwargs) -> None:
    bad = [name for name, value in kwargs.items() if not VALID[name](value)]
    plan_error = None
    if cls is PlanStrategy and not isinstance(plan, ParallelPlan):
        try:
            ParallelPlan.parse(plan)
        except ValueError as err:
            plan_error = str(err)
    try:
        strategy = cls(plan, **kwargs) if cls is PlanStrategy else cls(**kwargs)
    except ValueError as err:
        message = str(err)
        if plan_error is not None:  # the plan is read first
            assert message == plan_error
        else:
            assert bad, f"{cls.__name__}({plan!r}, **{kwargs!r}) refused good arguments: {message}"
            assert any(name in message for name in bad), f"{message!r} names none of {bad}"
        return
    assert plan_error is None and not bad, f"{cls.__name__}({plan!r}, **{kwargs!r}) accepted bad {bad}"
    assert isinstance(strategy, PlanStrategy)


def test_constructor_arguments(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)

    @SETTINGS
    @hypothesis.given(constructor_calls())
    def check(call):
        check_construct(*call)

    check()


def test_timeout_from_the_environment(monkeypatch):
    text = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=12)

    @SETTINGS
    @hypothesis.given(text | st.sampled_from(["30", "0", "-5", "nan", "inf", "-inf", "1e300", "1e9", " 7 ", "1_0"]))
    def check(raw):
        monkeypatch.setenv(TIMEOUT_ENV, raw)
        try:
            timeout = collective_timeout()
        except ValueError as err:
            assert f"{TIMEOUT_ENV}={raw!r}" in str(err)
        else:
            assert timeout > timedelta(0) and timeout == timedelta(seconds=float(raw))

    check()


def test_registry_answers_plan_names_with_a_strategy_or_our_error():
    @SETTINGS
    @hypothesis.given(random_texts() | mutated_texts())
    def check(name):
        assert isinstance(name in StrategyRegistry.available_strategies(), bool)
        lowered = name.lower()
        if not looks_like_plan(name) or (lowered in StrategyRegistry and lowered not in ("dp", "naive")):
            return  # Lightning's own names, and names nothing like a plan, keep Lightning's meaning
        try:
            strategy = StrategyRegistry.get(name)
        except ValueError as err:
            with pytest.raises(ValueError) as info:
                ParallelPlan.parse(lowered)
            assert str(err) == str(info.value)
        else:
            assert isinstance(strategy, PlanStrategy) and strategy.plan == ParallelPlan.parse(name)

    check()


def _child_pids() -> set[str]:
    """This process's children, where Linux tells (/proc/self/task/*/children)."""
    pids: set[str] = set()
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        path = f"/proc/self/task/{task}/children"
        if os.path.exists(path):
            with open(path) as file:
                pids.update(file.read().split())
    return pids


def test_constructing_is_cheap_and_starts_nothing():
    threads, children, pids = threading.active_count(), multiprocessing.active_children(), _child_pids()
    start = time.perf_counter()
    for plan in ["dp", "naive_dp2", "zero3_tp2_pp2", "pp2_interleaved_mb4"]:
        for start_method in ("popen", "spawn", "fork", "forkserver"):
            for _ in range(10):
                PlanStrategy(plan, start_method=start_method, timeout=5)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"160 PlanStrategy constructions took {elapsed:.2f} s"
    assert not dist.is_initialized()
    assert threading.active_count() == threads and multiprocessing.active_children() == children
    assert _child_pids() <= pids


# -- the fixes these properties found, as examples ---------------------------------------------------------


@pytest.mark.parametrize(
    "text, says",
    [
        ("tp" + "9" * 5000, "tp must be at most 2147483647"),  # was int()'s digit-limit error, naming no token
        (f"dp{MAX_DEGREE + 1}", "dp must be at most 2147483647"),  # was accepted: no run has 2**31 ranks
        ("zero3" + "9" * 5000, "dp must be at most"),
        ("tp\u0663", "unknown token 'tp\u0663'"),  # an Arabic-Indic 3: was read as tp3
        ("tp2__pp2", "empty token"),  # was "unknown token ''"
        ("foo_ddp", "unknown token 'foo'"),  # was the advice on 'ddp', not naming 'foo'
        ("zero3_tp0_pp2", "'tp0': tp must be a positive integer, got 0"),
        ("tp2_gpipe_mb4", "'gpipe' and 'mb4': a pipeline schedule"),
        ("pp2_gpipe_v3", "'gpipe' with 'v3'"),
    ],
)
def test_found_by_fuzzing(text, says):
    with pytest.raises(ValueError) as info:
        ParallelPlan.parse(text)
    assert says in str(info.value)


def test_largest_degree_and_world_size():
    plan = ParallelPlan.parse(f"dp{MAX_DEGREE}")
    assert plan.dp == MAX_DEGREE and plan.resolve(MAX_DEGREE) == plan
    with pytest.raises(ValueError, match=f"world_size {MAX_DEGREE + 1} is more ranks"):
        ParallelPlan.parse("dp").resolve(MAX_DEGREE + 1)  # was resolved to dp2147483648, which no parse accepts


@pytest.mark.parametrize("world_size", ["8", None, 1.5, 8.0, True])  # were TypeError, or resolved as a float/1
def test_resolve_rejects_world_sizes_that_are_not_counts(world_size):
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        ParallelPlan.parse("dp").resolve(world_size)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(bucket_cap_mb=float("nan")), "bucket_cap_mb"), (dict(bucket_cap_mb="25"), "bucket_cap_mb"),
        (dict(bucket_cap_mb=1e308), "bucket_cap_mb"), (dict(server_rank=-1), "server_rank"),
        (dict(server_rank=1.5), "server_rank"), (dict(find_unused_parameters="False"), "find_unused_parameters"),
        (dict(start_method="bad"), "start_method"), (dict(tp_plan="*.fc"), "tp_plan"),
        (dict(zero3_units=5), "zero3_units"), (dict(pipeline_blocks=5), "pipeline_blocks"),
        (dict(process_group_backend=5), "process_group_backend"), (dict(timeout="x"), "timeout"),
        (dict(timeout=float("nan")), "timeout"), (dict(timeout=float("inf")), "timeout"),
        (dict(timeout=1e300), "timeout"), (dict(timeout=-1), "timeout"),
    ],
)
def test_bad_argument_is_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PlanStrategy("dp", **kwargs)


def test_server_rank_outside_the_data_parallel_axis_fails_at_trainer_construction(tmp_path):
    import lightning as L

    with pytest.raises(ValueError, match=r"server_rank=2 is not on the data-parallel axis of 'naive_dp2'"):
        L.Trainer(strategy=strategies.NaiveDataParallelStrategy(server_rank=2), accelerator="cpu", devices=2,
                  logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
