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

from strategies.measure.estimate import DEFAULT_PRECISION, Estimate, ModelShape, estimate
from strategies.plan import DataMode, ParallelPlan
from strategies.runs.schema import MEMORY_CATEGORIES

if TYPE_CHECKING:
    from strategies.measure.calibrate import Calibration

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    """What the ranking assumes about the machines (GPU defaults: H100-class on NVLink, InfiniBand between)."""

    gpus: int
    memory: float  # bytes per GPU
    flops: float = 400e12  # dense bf16 FLOP/s a GPU sustains (about 40% of an H100's peak)
    tp_bandwidth: float = 150e9  # bytes/s per GPU inside a node (NVLink), where tp runs
    dp_bandwidth: float = 25e9  # bytes/s per GPU between nodes, where dp and pp run
    host_bandwidth: float = 20e9  # bytes/s to host memory (offload)
    usable: float = 0.9  # fraction of the memory a plan may fill (allocator, buffers, fragmentation)
    overlap: float = 0.5  # share of dp communication hidden behind backward (DDP / ZeRO buckets)
    calibration: Calibration | None = None  # measured links (`calibrate`): when set, every axis uses them

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
        comm = {axis: sum(v for k, v in self.estimate.comm.items() if k.endswith("/" + axis))
                for axis in ("dp", "tp", "pp")}
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


def step_time(shape: ModelShape, est: Estimate, plan: ParallelPlan, hw: Hardware) -> dict[str, float]:
    """A rough step time split into compute, bubble, recompute and exposed communication (seconds)."""
    tokens = shape.batch * plan.dp * shape.seq
    per_token = 6 * shape.total() + 12 * shape.layers * shape.hidden * shape.seq  # matmuls + attention scores
    compute = per_token * tokens / hw.gpus / hw.flops
    parts = {"compute": compute, "bubble": compute * est.bubble / (1 - est.bubble) if est.bubble < 1 else math.inf}
    if plan.ac:
        parts["recompute"] = compute / 3  # one more forward
    calls = collective_calls(shape, plan, est)
    hidden = 0.0 if plan.data is DataMode.NAIVE else hw.overlap
    for axis in ("dp", "tp", "pp"):
        ranks = 2 if axis == "pp" else getattr(plan, axis)
        seconds = sum(hw.seconds(k, v, calls.get(k, 1), ranks) for k, v in est.comm.items() if k.endswith("/" + axis))
        parts[f"{axis} comm"] = seconds * (1 - hidden if axis == "dp" else 1)
    if plan.offload:
        parts["offload"] = max(m["host"] for m in est.memory) / hw.host_bandwidth
    return parts


def collective_calls(shape: ModelShape, plan: ParallelPlan, est: Estimate) -> dict[str, float]:
    """About how many collectives of each ``kind/axis`` rank 0 issues a step (each costs a latency): buckets
    for dp and ZeRO-1/2, units per microbatch forward and backward for ZeRO-3's gathers, four per block per
    microbatch for tp (two in forward, two in backward), two sends per microbatch and chunk for pp."""
    from strategies.data_parallel import DEFAULT_BUCKET_CAP_MB  # DDP's buckets, and ZeRO-1/2's flats

    m = (plan.microbatches or 1) * shape.accumulate
    blocks = shape.layers / plan.pp  # rank 0's, over its virtual chunks
    buckets = math.ceil(est.params_per_stage[0] * 4 / (DEFAULT_BUCKET_CAP_MB * 2**20)) if est.params_per_stage else 1
    calls = {"all_reduce/dp": buckets, "reduce_scatter/dp": buckets, "send/dp": plan.dp - 1,
             "all_gather/dp": 2 * m * (blocks + 2) if plan.data.stage == 3 else buckets,
             "all_reduce/tp": 4 * blocks * m, "all_gather/tp": 2 * blocks * m + 1, "reduce_scatter/tp": 2 * blocks * m,
             "send/pp": 2 * m * plan.virtual}
    return {k: v for k, v in calls.items() if k in est.comm}


def candidates(shape: ModelShape, gpus: int) -> list[str]:
    """Every plan worth trying on ``gpus``: data modes x tp (<= 8, dividing the heads) x pp x ac x offload."""
    out = []
    for tp in (t for t in (1, 2, 4, 8) if gpus % t == 0 and shape.heads % t == 0):
        for pp in (p for p in range(1, gpus // tp + 1) if (gpus // tp) % p == 0 and p <= shape.layers):
            for data in ("dp", "zero1", "zero2", "zero3"):
                for ac in ("", "_ac"):
                    for offload in ("", "_offload") if data != "dp" else ("",):
                        parts = [data] + ([f"tp{tp}", "sp"] if tp > 1 else []) + (
                            [f"pp{pp}", f"mb{4 * pp}"] if pp > 1 else [])
                        out.append("_".join(parts) + ac + offload)
    return out


def rank_plans(shape: ModelShape, hw: Hardware, global_batch: int, precision: str = DEFAULT_PRECISION) -> list[Ranked]:
    """Every candidate plan for ``global_batch`` samples per step, predicted; those that fit first, fastest
    first (plans whose dp or microbatches do not divide the batch are left out)."""
    ranked = []
    for text in candidates(shape, hw.gpus):
        plan = ParallelPlan.parse(text).resolve(hw.gpus)
        per_rank = global_batch // plan.dp
        if global_batch % plan.dp or per_rank % (plan.microbatches or 1):
            continue
        local = dataclasses.replace(shape, batch=per_rank)
        est = estimate(local, plan, hw.gpus, precision)
        parts = step_time(local, est, plan, hw)
        ranked.append(Ranked(text, est, sum(parts.values()), parts, est.peak() <= hw.usable * hw.memory))
    return sorted(ranked, key=lambda r: (not r.fits, r.seconds))
