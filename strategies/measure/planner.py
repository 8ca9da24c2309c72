"""Which plans fit a model on given hardware, and which should be fastest: the estimator's figures ranked.

`stratpack plan --params 7e9` and the dashboard's Planner page show this ranking: every candidate plan
(`candidates`), its predicted memory per GPU against what the GPU holds, and a rough step time split into
compute, bubble, recompute and exposed communication (`step_time`), each with one line that says why.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from strategies.measure.estimate import DEFAULT_PRECISION, Estimate, ModelShape, estimate
from strategies.plan import DataMode, ParallelPlan
from strategies.runs.schema import MEMORY_CATEGORIES

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
    compute = 6 * shape.total() * tokens / hw.gpus / hw.flops
    parts = {"compute": compute, "bubble": compute * est.bubble / (1 - est.bubble) if est.bubble < 1 else math.inf}
    if plan.ac:
        parts["recompute"] = compute / 3  # one more forward
    comm = est.comm
    dp_bytes = sum(v for k, v in comm.items() if k.endswith("/dp"))
    hidden = 0.0 if plan.data is DataMode.NAIVE else 0.5  # DDP / ZeRO overlap about half of it with backward
    parts["dp comm"] = dp_bytes / hw.dp_bandwidth * (1 - hidden)
    parts["tp comm"] = sum(v for k, v in comm.items() if k.endswith("/tp")) / hw.tp_bandwidth
    parts["pp comm"] = comm.get("send/pp", 0.0) / hw.dp_bandwidth
    if plan.offload:
        parts["offload"] = max(m["host"] for m in est.memory) / hw.host_bandwidth
    return parts


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
