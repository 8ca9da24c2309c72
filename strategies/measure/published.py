"""Published large training runs beside the planner's answer for the same model, cluster and batch.

Each `Published` row is a run someone measured and wrote down (sources in ``docs/published-runs.md``): the model's
shape, the cluster (`CLUSTERS`: memory, peak FLOP/s, and the links' bus bandwidth as nccl-tests measures it), the
global batch, the plan as the pack writes it, and the throughput reported. `compare` asks the planner three things
of it: where the published plan ranks among the planner's candidates (by predicted time, among those that fit),
its predicted time per step against the published one, and its predicted memory per GPU.

The time model has one constant that is not a published figure: `EFFICIENCY`, the share of peak FLOP/s a whole
step's compute sustains (matmuls, and the norms, softmax and elementwise work around them). It is the efficiency at
which the model gives one row's published time (`implied_efficiency`): Megatron-LM's 18.4B, tp8 inside a node and no
pipeline, so that besides compute the step holds only tp's collectives (whose bytes the rehearsals prove) and dp's
overlapped all-reduce. It is used unchanged for every other row and for both GPUs; bubble, recomputation and exposed
communication come from the planner's model. Each row's own implied efficiency is reported beside it: where it
departs from `EFFICIENCY`, the row's time is not predicted as well.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from strategies.measure.estimate import ModelShape
from strategies.measure.planner import GiB, Hardware, choose_schedule, rank_plans, step_time
from strategies.plan import ParallelPlan

EFFICIENCY = 0.580  # `implied_efficiency` of Megatron-LM Table 1's 18.4B row (tests/unit/test_published.py)


@dataclass(frozen=True)
class Cluster:
    name: str
    memory: float  # GiB per GPU
    peak: float  # dense 16-bit FLOP/s per GPU
    tp_bandwidth: float  # bytes/s: nccl-tests all_reduce bus bandwidth inside a node of 8, at tp's message sizes
    dp_bandwidth: float  # bytes/s per GPU between nodes (one NIC per GPU): nccl-tests ring bus bandwidth per NIC

    def hardware(self, gpus: int, efficiency: float = EFFICIENCY) -> Hardware:
        return Hardware(gpus=gpus, memory=self.memory * GiB, flops=self.peak * efficiency,
                        tp_bandwidth=self.tp_bandwidth, dp_bandwidth=self.dp_bandwidth)


# Bus bandwidths (docs/published-runs.md has the sources): H100 SXM in a node of 8, 400.6 GB/s at 128 MB (Azure ND
# H100 v5, NCCL 2.18.5; 479 at 8 GB), 46 GB/s per 400 Gb/s NDR NIC (NVIDIA, nccl-tests #290); A100 SXM 174-228 GB/s
# at 128 MB-1 GB (Azure ND A100 v4), 24 GB/s per 200 Gb/s HDR NIC (NVIDIA, nccl-tests #119).
CLUSTERS = {
    "h100-sxm": Cluster("H100 SXM 80 GB, NVLink in nodes of 8, 400 Gb/s per GPU", 80, 989e12, 400e9, 46e9),
    "h100-96g": Cluster("H100 96 GB HBM2e at 500 W (torchtitan's Grand Teton hosts), 400 Gb/s per GPU", 96, 989e12,
                        400e9, 46e9),
    "a100-80g": Cluster("A100 SXM 80 GB, NVLink in nodes of 8, 200 Gb/s per GPU", 80, 312e12, 200e9, 24e9),
}


@dataclass(frozen=True)
class Published:
    source: str  # who ran it: the row's name in the table
    shape: ModelShape  # batch: sequences per data-parallel rank per step
    cluster: str  # a key of CLUSTERS
    gpus: int
    plan: str  # as the pack writes it (the closest it has: docs/published-runs.md says where it differs)
    precision: str
    tflops: float  # per GPU, as published (for Megatron-LM counting recomputation's forward)
    counts_recompute: bool = False  # the published FLOP/s count the recomputed forward (Megatron-LM's convention)

    def global_batch(self) -> int:
        return self.shape.batch * ParallelPlan.parse(self.plan).resolve(self.gpus).dp

    def published_seconds(self) -> float:
        """Time per step implied by the published FLOP/s, in the convention they were published in."""
        s = self.shape
        per_token = 6 * s.total() + 12 * s.layers * s.hidden * s.seq
        if self.counts_recompute:
            per_token = per_token * 4 / 3  # a forward again: 4 passes for 3
        return per_token * self.global_batch() * s.seq / (self.gpus * self.tflops * 1e12)


def _gpt(layers: int, hidden: int, heads: int, batch: int) -> ModelShape:
    return ModelShape(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200, batch=batch)


def _llama405(seq: int, batch: int) -> ModelShape:
    """Llama 3 405B's own block (`ModelShape.family`: grouped keys, the gated MLP), as `demos.sizes` builds it."""
    return ModelShape(layers=126, hidden=16384, heads=128, seq=seq, vocab=128256, batch=batch, family="llama",
                      ffn=53248, kv_heads=8)


MEGATRON = "Megatron-LM Table 1"
RUNS = [
    Published(f"{MEGATRON}, 1.7B", _gpt(24, 2304, 24, 16), "a100-80g", 32, "dp_ac", "16-mixed", 137, True),
    Published(f"{MEGATRON}, 3.6B", _gpt(30, 3072, 32, 16), "a100-80g", 64, "dp_tp2_ac", "16-mixed", 138, True),
    Published(f"{MEGATRON}, 7.5B", _gpt(36, 4096, 32, 16), "a100-80g", 128, "dp_tp4_ac", "16-mixed", 142, True),
    Published(f"{MEGATRON}, 18.4B", dataclasses.replace(_gpt(40, 6144, 48, 32), accumulate=4), "a100-80g", 256,
              "dp_tp8_ac", "16-mixed", 135, True),
    Published(f"{MEGATRON}, 39.1B", _gpt(48, 8192, 64, 48), "a100-80g", 512, "dp_tp8_pp2_1f1b_mb12_ac", "16-mixed",
              138, True),
    Published(f"{MEGATRON}, 76.1B", _gpt(60, 10240, 80, 56), "a100-80g", 1024, "dp_tp8_pp4_interleaved_v3_mb28_ac",
              "16-mixed", 140, True),
    Published(f"{MEGATRON}, 145.6B", _gpt(80, 12288, 96, 96), "a100-80g", 1536, "dp_tp8_pp8_interleaved_v2_mb48_ac",
              "16-mixed", 148, True),
    Published(f"{MEGATRON}, 310.1B", _gpt(96, 16384, 128, 144), "a100-80g", 1920,
              "dp_tp8_pp16_interleaved_v2_mb144_ac", "16-mixed", 155, True),
    Published(f"{MEGATRON}, 529.6B", _gpt(105, 20480, 128, 280), "a100-80g", 2520,
              "dp_tp8_pp35_interleaved_v3_mb280_ac", "16-mixed", 163, True),
    Published(f"{MEGATRON}, 1008B", _gpt(128, 25600, 160, 512), "a100-80g", 3072, "dp_tp8_pp64_1f1b_mb512_ac",
              "16-mixed", 163, True),
    Published("Llama 3 405B, 8K GPUs", _llama405(8192, 32), "h100-sxm", 8192, "zero2_tp8_sp_pp16_interleaved_v2_mb32",
              "bf16-mixed", 430),
    Published("Llama 3 405B, 16K GPUs", _llama405(8192, 16), "h100-sxm", 16384,
              "zero2_tp8_sp_pp16_interleaved_v2_mb16", "bf16-mixed", 400),
    Published("Llama 3 405B, 16K GPUs, 131K context", _llama405(131072, 16), "h100-sxm", 16384,
              "zero2_tp8_sp_cp16_pp16_interleaved_v2_mb16", "bf16-mixed", 380),
]


def predicted_seconds(run: Published, efficiency: float = EFFICIENCY) -> tuple[float, object]:
    """The planner's time per step for ``run``'s own plan, and its estimate."""
    hw = CLUSTERS[run.cluster].hardware(run.gpus, efficiency)
    chosen = choose_schedule(run.shape, ParallelPlan.parse(run.plan).resolve(run.gpus), hw, run.precision)
    return sum(step_time(run.shape, chosen.estimate, chosen.plan, hw).values()), chosen.estimate


def implied_efficiency(run: Published) -> float:
    """The compute efficiency at which the planner's time for ``run`` equals the published one (bisection: the
    time falls as the efficiency rises)."""
    low, high = 0.05, 2.0
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if predicted_seconds(run, mid)[0] > run.published_seconds() else (low, mid)
    return (low + high) / 2


def compare(run: Published) -> dict:
    """The planner on ``run``: the published plan's predicted seconds per step, memory per GPU and whether it fits,
    its rank among the planner's candidates that fit (by predicted time; 1 is the planner's pick), the planner's own
    pick, and the ratio of predicted to published time."""
    cluster = CLUSTERS[run.cluster]
    hw = cluster.hardware(run.gpus)
    seconds, est = predicted_seconds(run)
    whole = dataclasses.replace(run.shape, batch=run.global_batch(), accumulate=1)
    ranked = [r for r in rank_plans(whole, hw, run.global_batch(), run.precision) if r.fits]
    faster = sum(r.seconds < seconds for r in ranked)
    return {"run": run.source, "gpus": run.gpus, "plan": run.plan, "cluster": cluster.name,
            "predicted_s": seconds, "published_s": run.published_seconds(), "ratio": seconds / run.published_seconds(),
            "memory_gib": est.peak() / GiB, "fits": est.setup_peak() <= hw.usable * hw.memory,
            "rank": faster + 1, "candidates": len(ranked), "pick": ranked[0].label if ranked else None,
            "pick_s": ranked[0].seconds if ranked else None}
