"""Which plans fit a model on given hardware, and which should be fastest: the estimator's figures ranked.

`stratpack plan --params 7e9` and the dashboard's Planner page show this ranking: every candidate plan
(`candidates`), its predicted memory per GPU against what the GPU holds, and a rough step time split into
compute, bubble, recompute and exposed communication (`step_time`), each with one line that says why.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strategies.measure.estimate import (
    BUCKET,
    DEFAULT_PRECISION,
    Estimate,
    ModelShape,
    async_pieces,
    attention_share,
    estimate,
    stage_blocks,
    stage_flops,
)
from strategies.measure.peak import Workspace
from strategies.plan import DataMode, ParallelPlan, PipelineSchedule
from strategies.runs.schema import MEMORY_CATEGORIES

if TYPE_CHECKING:
    from strategies.measure.calibrate import Calibration
    from strategies.measure.costs import Costs

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    """What the ranking assumes about the machines (GPU defaults: H100-class on NVLink, InfiniBand between)."""

    gpus: int
    memory: float  # bytes per GPU
    # The defaults are `published.CLUSTERS["h100-sxm"]`'s, whose sources docs/published-runs.md gives (a unit test
    # holds them equal): dense bf16 FLOP/s a GPU sustains, 989e12 at `published.EFFICIENCY` (0.580); nccl-tests' bus
    # bandwidth inside a node of 8 (NVLink), where tp runs; and per GPU between nodes (a 400 Gb/s NIC each), where
    # dp and pp run.
    flops: float = 989e12 * 0.580
    tp_bandwidth: float = 400e9
    dp_bandwidth: float = 46e9
    host_bandwidth: float = 20e9  # bytes/s to host memory (offload)
    usable: float = 0.9  # fraction of the memory a plan may fill (allocator, buffers, fragmentation)
    overlap: float = 0.5  # share of dp communication hidden behind backward (DDP / ZeRO buckets)
    calibration: Calibration | None = None  # measured links (`calibrate`): when set, every axis uses them
    costs: Costs | None = None  # measured pieces of a step at the shape planned for (`costs`): compute from them

    @classmethod
    def calibrated(cls, cal: Calibration, memory: float) -> Hardware:
        """This machine as `calibrate.measure` found it: its FLOP/s per rank and its links. On CPU ranks
        the collectives run on the cores that compute, so nothing is counted as hidden."""
        bandwidth = cal.link("all_reduce", cal.world)[1]
        return cls(gpus=cal.world, memory=memory, flops=cal.flops, tp_bandwidth=bandwidth, dp_bandwidth=bandwidth,
                   host_bandwidth=bandwidth, overlap=0.0, calibration=cal)

    def seconds(self, key: str, nbytes: float, calls: float, ranks: int) -> float:
        """Time of ``calls`` collectives of ``key`` (``kind/axis``) over ``ranks`` ranks sending ``nbytes`` in all."""
        kind, _, axis = key.partition("/")
        if self.calibration is not None:
            latency, bandwidth = self.calibration.link(kind, ranks)
            return nbytes / bandwidth + calls * latency
        return nbytes / (self.tp_bandwidth if axis == "tp" else self.dp_bandwidth)


@dataclass
class Ranked:
    label: str  # the plan as written (the estimate holds it resolved)
    estimate: Estimate
    seconds: float  # predicted step time
    parts: dict[str, float]  # where those seconds go
    fits: bool

    def explain(self, shape: ModelShape, best: Ranked | None) -> str:
        """One line: what dominates the memory and the communication, and why the plan ranks where it does."""
        peak = max(self.estimate.memory, key=lambda m: sum(v for k, v in m.items() if k != "host"))
        memory_top = max((k for k in MEMORY_CATEGORIES if k != "host"), key=lambda k: peak[k])
        comm = dict.fromkeys(("dp", "tp", "cp", "pp", "ep"), 0.0)
        for key, nbytes in self.estimate.comm.items():
            comm[_axis_of(key)] += nbytes
        axis = max(comm, key=comm.get)
        comm_text = f"comm mostly {axis} ({comm[axis] / GiB:.1f} GiB/step/GPU)" if comm[axis] else "no communication"
        extra = {k: self.parts.get(k, 0) - best.parts.get(k, 0) for k in set(self.parts) | set(best.parts)} \
            if best is not None else {}
        slowest = max(extra, key=extra.get) if extra else None
        if best is None or best is self:
            why = "fastest predicted"
        elif extra[slowest] <= 0.005 * best.seconds:
            mine, theirs = self.estimate.peak(), best.estimate.peak()
            why = "ties with the best on time"
            why += "" if mine == theirs else f"; {'less' if mine < theirs else 'more'} memory"
        else:
            why = f"+{self.seconds / best.seconds - 1:.0%} vs best, mostly {slowest} (+{extra[slowest]:.2f}s)"
        if not self.fits:
            why = "does not fit: " + why
        return (f"{self.label:<30} {self.estimate.peak() / GiB:6.1f} GiB/GPU (top: {memory_top} "
                f"{peak[memory_top] / GiB:.1f} GiB), {comm_text}; {self.seconds:.2f}s/step: {why}")


def _axis_of(key: str) -> str:
    """What a ``kind/axis`` key's bytes are for: the data group's reduction ("dp", over dp x cp too), cp's ring, tp,
    pp, ep's all-to-all (the experts' own reduction, over edp, is the data group's)."""
    kind, _, axis = key.partition("/")
    return "cp" if kind == "send" and axis == "cp" else "dp" if axis in ("dp", "dp_cp", "cp", "edp") else axis


def step_time(shape: ModelShape, est: Estimate, plan: ParallelPlan, hw: Hardware) -> dict[str, float]:
    """A rough step time split into compute, bubble, recompute, the optimizer and the loop (with measured `costs`),
    and exposed communication (seconds)."""
    if hw.costs is not None:
        parts = costed_compute(shape, est, plan, hw)
    else:
        tokens = shape.batch * plan.dp * shape.seq  # the global batch's: cp ranks share their samples' tokens
        # matmuls + attention scores, at the pace of the busiest pipeline rank: every rank waits for it each microbatch
        work = stage_flops(shape, plan)
        compute = max(work) * plan.pp * tokens / hw.gpus / hw.flops
        # ac: one more forward
        parts = {"compute": compute, "recompute": compute / 3 * recompute_time_share(plan, shape)}
    calls = collective_calls(shape, plan, est)
    hidden = 0.0 if plan.data is DataMode.NAIVE else hw.overlap
    for axis in ("dp", "tp", "pp"):
        parts[f"{axis} comm"] = 0.0
    pieced = 0.0  # async TP's gathers and reduce-scatters, by pieces beside the matmuls
    for key, nbytes in est.comm.items():  # the data group's reduction partly hidden behind backward; the ring's not
        axis = _axis_of(key)
        ranks = plan.expert_data_ranks if key.endswith("/edp") else {"dp": plan.data_ranks, "tp": plan.tp,
                                                                      "ep": plan.ep}.get(axis, 2)
        seconds = hw.seconds(key, nbytes, calls.get(key, 1), ranks)
        if plan.async_tp and key in ASYNC_KEYS:
            pieced += seconds
            continue
        parts[f"{axis} comm"] = parts.get(f"{axis} comm", 0.0) + seconds * (1 - hidden if axis == "dp" else 1)
    parts["tp comm"] += async_exposed(pieced, async_pieces(shape.seq / plan.cp, plan),
                                      parts["compute"] + parts["recompute"], hw.overlap > 0)
    # The bubble is idle time in proportion to a stage's busy time, which holds its tp collectives as well as its
    # compute (a stage waits for its neighbour's whole microbatch, collectives included).
    busy = parts["compute"] + parts["recompute"] + parts["tp comm"]
    parts["bubble"] = busy * est.bubble / (1 - est.bubble) if est.bubble < 1 else math.inf
    if plan.offload:
        parts["offload"] = max(m["host"] for m in est.memory) / hw.host_bandwidth
    return parts


ASYNC_KEYS = ("all_gather/tp", "reduce_scatter/tp")  # what async TP cuts into pieces (`tensor_parallel.overlap`)


# What a collective hidden beside a matmul still costs, as a share of its time: its kernels take SMs and memory
# bandwidth from the matmul beside it, and a piece's matmul runs less efficiently than the whole one. Fitted to
# torchtitan's published async TP gains on 256 and 64 H100s (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md:
# Llama 3.1 70B FSDP 32 x TP 8, full AC, 1.09x; 8B FSDP 8 x TP 8, op SAC, 1.10x, bf16): 0.46 fits the first, 0.64
# the second; at 0.55 the model gives 1.075x and 1.13x (docs/published-runs.md). Without it, 1.18x and 1.33x.
ASYNC_COST = 0.55


def async_exposed(seconds: float, k: int, matmuls: float, overlaps: bool) -> float:
    """The seconds of async TP's collectives (``seconds``, in ``k`` pieces each) the step pays for: each layer's
    first gather piece or last reduce-scatter piece (1/k); of the rest, `ASYNC_COST` of what the matmuls beside it
    hide, and all of what they cannot. Where the collectives run on the cores that compute (``overlaps`` False: CPU
    ranks), all of it. Approximations, both optimistic where tp's collectives outlast the compute: ``matmuls`` is the
    step's compute and recompute (not only the split linears'), and the gathers entering and leaving the blocks
    (whole, one or two a microbatch against four a block) are counted among the pieces."""
    if not overlaps:
        return seconds
    beside = seconds * (1 - 1 / k)
    return seconds / k + ASYNC_COST * min(beside, matmuls) + max(0.0, beside - matmuls)


# sac makes again every second matmul (Llama's k, o and up projections: 37% of a block's matmul FLOPs; the demo's two
# row-parallel ones, 42%) and what a block does outside its matmuls and attention (norms, activations, casts, residual
# adds): taken as this share of the block's forward time. An assumption, not measured: elementwise work is
# memory-bound, a larger share on small models than on large ones.
SELECTIVE_SHARE = 0.4


def recompute_time_share(plan: ParallelPlan, shape: ModelShape) -> float:
    """The share of the blocks' forward made again in backward: all of it under ``ac``, 1/N under ``ac<N>``,
    `SELECTIVE_SHARE` under ``sac``, none without. Under ``sac`` with cp attention as well: the ring's kernel is not
    one sac keeps (`estimate._block_saved`), so it runs again, its messages too."""
    if not plan.sac:
        return plan.recomputed
    return SELECTIVE_SHARE + (attention_share(shape) if plan.cp > 1 else 0.0)


def costed_compute(shape: ModelShape, est: Estimate, plan: ParallelPlan, hw: Hardware) -> dict[str, float]:
    """Compute, recompute, optimizer and loop from the measured pieces (`costs.Costs`): each microbatch through the
    slowest pipeline rank's blocks (and the embedding on the first, the head and loss on the last), recompute's
    forwards again, AdamW over this rank's tensors (ZeRO steps a few flats of 1/N of the parameters), and Lightning's
    own work per step, with the broadcast its loop makes every step on several ranks."""
    c = hw.costs
    micro = (plan.microbatches or 1) * shape.accumulate
    tokens = shape.batch / micro * shape.seq / plan.cp
    blocks = max(stage_blocks(shape, plan))  # the busiest rank's (the cut's and the schedule's placement)
    block = blocks * c.block_seconds(plan.tp, tokens)
    ends = [c.embedding[0] + c.embedding[1] * tokens, c.head[0] + c.head[1] * tokens]
    stage = block + (sum(ends) if plan.pp == 1 else max(ends))  # per microbatch, on the slowest rank
    psi = est.params_per_stage[0]
    if plan.data.stage == 3:
        tensors = blocks + 4  # a flat per unit: the blocks, embeddings, final norm, head
    elif plan.data.is_zero:
        tensors = math.ceil(psi * 4 / BUCKET) + 1
    else:
        tensors = 12 * blocks + 4
    elements = psi / plan.data_ranks if plan.data.is_zero else psi
    world = plan.dp * plan.tp * plan.cp * plan.pp
    broadcast = hw.seconds("all_reduce/world", 4, 1, world) if world > 1 and hw.calibration is not None else 0.0
    # Recompute: what checkpointing measured per block (its forward again, and the checkpoint's own work), the block's
    # forward share where it was not measured.
    again = blocks * (c.recompute[0] + c.recompute[1] * tokens) if any(c.recompute) else block * c.forward
    return {"compute": micro * stage, "recompute": micro * again * recompute_time_share(plan, shape),
            "optimizer": tensors * c.optimizer[0] + elements * c.optimizer[1], "loop": c.loop + broadcast}


def collective_calls(shape: ModelShape, plan: ParallelPlan, est: Estimate) -> dict[str, float]:
    """About how many collectives of each ``kind/axis`` rank 0 issues a step (each costs a latency): buckets
    for dp and ZeRO-1/2, units per microbatch forward and backward for ZeRO-3's gathers, four per block per
    microbatch for tp (two in forward, two in backward; with sp four gathers and four scatters; recompute repeats
    the forward's up to its last saved tensor), for pp the sends on the critical path (`send/pp` below), and cp's
    ring hops."""
    m = (plan.microbatches or 1) * shape.accumulate
    blocks = shape.layers / plan.pp  # rank 0's, over its virtual chunks
    buckets = math.ceil(est.params_per_stage[0] * 4 / BUCKET) if est.params_per_stage else 1
    # ZeRO-3's units: the blocks, and the token and position embeddings, final norm and head where they are; each is
    # gathered for every microbatch's forward and again for its backward (but the last one, kept), and
    # reduce-scattered once, from its own flat.
    units = blocks + (4 if plan.pp == 1 else 2)
    k = async_pieces(shape.seq / plan.cp, plan) if plan.async_tp else 1  # async TP: a block's collectives in pieces
    data = plan.data_axis  # dp, or dp x cp
    calls = {f"all_reduce/{data}": buckets, f"reduce_scatter/{data}": units if plan.data.stage == 3 else buckets,
             f"send/{data}": plan.data_ranks - 1,
             f"all_gather/{data}": m * (2 * units - 1) if plan.data.stage == 3 else buckets,
             # sp: each block's two gathers and two scatters forward, and their conjugates backward; entering and
             # leaving the sequence split one gather each (forward at the end, backward at the start)
             "all_reduce/tp": (4 + plan.recomputed) * blocks * m,
             "all_gather/tp": ((4 + 2 * plan.recomputed) * blocks * k + (2 if plan.pp == 1 else 1)) * m,
             "reduce_scatter/tp": (4 + plan.recomputed) * blocks * k * m,
             # A pipeline's sends overlap the other stages' work: one hop per microbatch and chunk is on the
             # critical path, and the fill and the drain's hops, 2(pp-1)
             "send/pp": m * plan.chunks + 2 * (plan.pp - 1)}
    if plan.ep > 1:  # per MoE block and microbatch: counts, rows out and back forward (again under recompute), two back
        calls["all_to_all/ep"] = blocks * m * (5 + 3 * plan.recomputed)
        for key in [k for k in calls if k.endswith(f"/{data}")]:  # the experts' reduction: as the data group's
            calls[key.replace(f"/{data}", "/edp")] = calls[key]
    if plan.cp > 1:  # the ring: n - 1 hops forward (again under recompute), n backward, per block and microbatch;
        #              the loss's mean once per training_step
        calls["send/cp"] = blocks * m * ((1 + plan.recomputed) * (plan.cp - 1) + plan.cp)
        calls["all_reduce/cp"] = calls.get("all_reduce/cp", 0) + shape.accumulate
    return {k: v for k, v in calls.items() if k in est.comm}


def candidates(shape: ModelShape, gpus: int) -> list[str]:
    """Every plan worth trying on ``gpus``: data modes x tp (<= 8, dividing the heads; with sp, and vp where the
    vocabulary divides) x cp (<= 8, its 2 x cp chunks dividing the sequence) x pp x ep (a mixture of experts: dividing
    the experts and the data ranks) x recompute (none, sac, ac) x offload."""
    out = []
    for tp in (t for t in (1, 2, 4, 8) if gpus % t == 0 and shape.heads % t == 0):
        for cp in (c for c in (1, 2, 4, 8) if (gpus // tp) % c == 0 and shape.seq % (2 * c) == 0):
            rest = gpus // tp // cp
            for pp in (p for p in range(1, rest + 1) if rest % p == 0 and p <= shape.layers):
                for ep, tensor in ((e, t) for e in _expert_degrees(shape, rest // pp * cp)
                                   for t in _tensor_tokens(shape, tp, e, cp)):
                    model = tensor + ([f"cp{cp}"] if cp > 1 else []) + ([f"ep{ep}"] if ep > 1 else []) + (
                        [f"pp{pp}", f"mb{4 * pp}"] if pp > 1 else [])
                    out += [_candidate(data, model, ac, offload) for data in ("dp", "zero1", "zero2", "zero3")
                            for ac in ("", "_sac", "_ac") for offload in (("", "_offload") if data != "dp" else ("",))]
    return out


def _tensor_tokens(shape: ModelShape, tp: int, ep: int, cp: int) -> list[list[str]]:
    """The tp tokens to try: none without tp; tp alone with experts split (ep); else sequence parallel and the
    vocabulary split (`_sequence_and_vocab`), and without cp the same with async TP."""
    if tp == 1:
        return [[]]
    if ep > 1:
        return [[f"tp{tp}"]]
    plain = [f"tp{tp}", *_sequence_and_vocab(shape, tp)]
    return [plain] if cp > 1 else [plain, plain[:2] + ["async"] + plain[2:]]


def _sequence_and_vocab(shape: ModelShape, tp: int) -> list[str]:
    """What a dense model's tp plans add: sequence parallel, and the vocabulary split where it divides (torchtitan's
    loss parallel, Megatron's vocab-parallel head: without it each tp rank holds the whole batch's logits, 125 GiB
    for Llama 3 70B at torchtitan's 16 x 8,192 tokens per rank)."""
    return ["sp"] + (["vp"] if shape.vocab % tp == 0 else [])


def _expert_degrees(shape: ModelShape, data_ranks: int) -> list[int]:
    """ep degrees to try: 1, and for a mixture of experts each power of two dividing the experts and the data ranks."""
    return [1] + [e for e in (2, 4, 8, 16, 32, 64) if shape.experts and shape.experts % e == 0 and data_ranks % e == 0]


def _candidate(data: str, model: list[str], ac: str, offload: str) -> str:
    return "_".join([data, *model]) + ac + offload


def rank_plans(shape: ModelShape, hw: Hardware, global_batch: int, precision: str = DEFAULT_PRECISION) -> list[Ranked]:
    """Every candidate plan for ``global_batch`` samples per step, predicted; those that fit first, fastest
    first (plans whose dp or microbatches do not divide the batch are left out). A pipeline plan gets the schedule
    `choose_schedule` picks, as a run of it would."""
    ranked = []
    for text in candidates(shape, hw.gpus):
        plan = ParallelPlan.parse(text).resolve(hw.gpus)
        per_rank = global_batch // plan.dp
        if global_batch % plan.dp or per_rank % (plan.microbatches or 1):
            continue
        local = dataclasses.replace(shape, batch=per_rank)
        chosen = choose_schedule(local, plan, hw, precision)
        label = text if plan.pp == 1 else str(dataclasses.replace(  # canonical, with the schedule it chose
            ParallelPlan.parse(text), schedule=chosen.plan.schedule, virtual=chosen.plan.virtual))
        # It fits when its set-up does too: the model built in configure_model, each rank making its slice
        # (`estimate.setup_peaks`); a model built whole on every rank needs `Estimate.setup_whole`.
        ranked.append(Ranked(label, chosen.estimate, sum(chosen.parts.values()), chosen.parts,
                             chosen.estimate.setup_peak() <= hw.usable * hw.memory))
    # Ties on time (a layout's dp, zero1 and zero2 often move the same bytes): the one holding least first.
    return sorted(ranked, key=lambda r: (not r.fits, r.seconds, r.estimate.peak()))


@dataclass
class Layout:
    """A layout (its axes, schedule and recompute) with the variants ranked of it: its data mode (dp, ZeRO 1-3) and
    offload, which trade memory for little or no time. ``shown`` is the first of them in the ranking (the fastest,
    least memory among ties), ``others`` the rest in order."""

    shown: Ranked
    others: list[Ranked]

    def also(self) -> str:
        """The other variants, those with the same time and memory together: ``; also zero2 (+0.00s, 61.1 GiB),
        zero1/zero2 offload (+0.38s, 58.7 GiB)``; empty where there are none."""
        alike: dict[tuple[str, str], list[str]] = {}
        for r in self.others:
            plan = ParallelPlan.parse(r.label)
            figures = (f"{r.seconds - self.shown.seconds:+.2f}s", f"{r.estimate.peak() / GiB:.1f} GiB")
            alike.setdefault(figures, []).append(plan.data.value + (" offload" if plan.offload else ""))
        if not alike:
            return ""
        return "; also " + ", ".join(f"{_names(names)} ({s}, {m})" for (s, m), names in alike.items())


def _names(variants: list[str]) -> str:
    """``zero1 offload``, ``zero2 offload`` as ``zero1/zero2 offload``; others joined by a slash."""
    if len(variants) > 1 and all(v.endswith(" offload") for v in variants):
        return "/".join(v.removesuffix(" offload") for v in variants) + " offload"
    return "/".join(variants)


def layout_of(label: str) -> str:
    """``label`` without its data mode and offload: what its variants (`Layout`) share."""
    return str(dataclasses.replace(ParallelPlan.parse(label), data=DataMode.DP, offload=False))


def by_layout(ranked: list[Ranked]) -> list[Layout]:
    """``ranked`` (`rank_plans`' order) a row per layout, in the order of each layout's first variant: a list a person
    reads for its distinct choices, where the plans ranked can hold one layout's five variants in a row."""
    rows: dict[str, Layout] = {}
    for r in ranked:
        key = layout_of(r.label)
        if key in rows:
            rows[key].others.append(r)
        else:
            rows[key] = Layout(r, [])
    return list(rows.values())


# The schedules `choose_schedule` weighs, where the plan and the model allow them.
SCHEDULE_CANDIDATES = ("1f1b", "zb1p", "zbv", "dualpipev", "interleaved", "gpipe")


@dataclass(frozen=True)
class Choice:
    plan: ParallelPlan  # resolved, with a schedule
    estimate: Estimate
    parts: dict[str, float]  # the predicted step time's parts
    why: str


def choose_schedule(shape: ModelShape, plan: ParallelPlan, hw: Hardware, precision: str = DEFAULT_PRECISION,
                    backend: str = "nccl", workspace: Workspace = Workspace(),
                    names: tuple[str, ...] = SCHEDULE_CANDIDATES, crowded: bool = False,
                    optimizer: str = "adamw") -> Choice:
    """``plan`` (resolved) with a schedule: its own, or for ``pp<N>`` without one (AUTO), the candidate of ``names``
    with the smallest predicted step time whose peak memory fits ``hw`` (the one holding least if none fits), and
    why. ``crowded``: `estimate`'s."""
    options, refusals = [], []
    auto = plan.pp > 1 and plan.schedule is PipelineSchedule.AUTO
    for name in names if auto else ("",):
        try:
            cand = dataclasses.replace(plan, schedule=PipelineSchedule(name), virtual=2 if name == "interleaved"
                                       else 1) if auto else plan
            est = estimate(shape, cand, hw.gpus, precision, backend=backend, workspace=workspace, crowded=crowded,
                           optimizer=optimizer)
        except ValueError as err:  # a schedule the microbatches or the blocks do not allow
            refusals.append(f"{name or plan.schedule.value}: {err}")
            continue
        options.append(Choice(cand, est, step_time(shape, est, cand, hw), ""))
    if not options:
        raise ValueError(f"plan '{plan}': no pipeline schedule fits the model; " + "; ".join(refusals))
    fitting = [o for o in options if o.estimate.peak() <= hw.usable * hw.memory] or \
        [min(options, key=lambda o: o.estimate.peak())]
    best = min(fitting, key=lambda o: sum(o.parts.values()))
    if not auto:
        return best
    seconds = sum(best.parts.values())
    others = ", ".join(f"{o.plan.schedule.value} {sum(o.parts.values()):.3g}" for o in options if o is not best)
    why = (f"{best.plan.schedule.value}: the fastest predicted of the schedules that fit ({seconds:.3g} s/step, "
           f"bubble {best.estimate.bubble:.0%}, peak {best.estimate.peak() / GiB:.3g} GiB of "
           f"{hw.usable * hw.memory / GiB:.3g}); others, s/step: {others}")
    return dataclasses.replace(best, why=why)
