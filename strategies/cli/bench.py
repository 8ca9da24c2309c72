"""``stratpack bench``: our engines against torch DDP, FSDP2, DTensor TP, torch's pipelining and DeepSpeed.

Every implementation (`bench_engines.ENGINES`) trains the same workload (the demo GPT by default) with the same
model, data, per-rank batch, optimizer and seed, in a plain training loop (no Lightning, so only the engines
differ), each run in fresh processes. A pair's runs go A B, B A, A B, ... so that a machine that drifts favours
neither side; the report gives the median of the per-pair ratios ours / peer, then each rank's peak memory from
separate short runs (`bench_report` writes it). Kept apart from the tests: speed is never a pass/fail test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from strategies.cli import bench_report
from strategies.pipeline.schedules import SCHEDULES as PIPELINE_SCHEDULES

# (ours, peer) pairs by name; a peer whose package is missing is reported as skipped.
PAIRS = {
    "dp": ("dp", "torch_ddp"),
    "zero1": ("zero1", "deepspeed1"),
    "zero2": ("zero2", "deepspeed2"),
    "zero3": ("zero3", "deepspeed3"),
    "zero3-fsdp2": ("zero3", "fsdp2"),
    "zero3-fsdp2-bf16": ("zero3_bf16", "fsdp2_bf16"),  # both under param_dtype=bf16, reduce_dtype=fp32
    "tp": ("tp", "dtensor_tp"),
    "tp-async": ("tp_sp_async", "tp_sp"),  # async TP against our own sp's whole collectives, the same session
    **{f"pp-{s}": (f"pp_{s}", f"torch_pp_{s}") for s in PIPELINE_SCHEDULES},
    "ep": ("ep", "deepspeed_moe"),  # the demo GPT's MoE (--experts; default 2 per rank), experts over every rank
}

# Every rank works on the same batch: tensor-parallel peers, and pipeline stages (one batch flows through).
TENSOR_PARALLEL = ("tp", "dtensor_tp", "tp_sp", "tp_sp_async",
                   *(f"{side}pp_{s}" for side in ("", "torch_") for s in PIPELINE_SCHEDULES))
MEMORY_STEPS = 3  # the optimizer states exist from the first step on; the peak is reached by the second
MEMORY_RUNS = 3  # the backward's peak moves by a few hundred KiB with the timing of async frees: median of 3


@dataclass(frozen=True)
class BenchConfig:
    world_size: int = 2
    steps: int = 30
    warmup_steps: int = 5
    batch_per_rank: int = 8
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    lr: float = 1e-3
    seed: int = 0
    workload: str = "gpt"
    experts: int = 0  # the demo GPT's MLPs as a mixture of this many experts (0: dense; the ep pair: 2 per rank)
    top_k: int = 2


def pair_config(ours: str, cfg: BenchConfig) -> BenchConfig:
    """``cfg`` for the pair whose side is ``ours``: the ep pair trains a mixture of experts, 2 per rank unless
    ``--experts`` says."""
    if ours == "ep" and not cfg.experts:
        return BenchConfig(**{**asdict(cfg), "experts": 2 * cfg.world_size})
    return cfg


def plan_of(impl: str, world_size: int) -> str:
    """The plan whose estimator figures stand beside ``impl``'s measurements (`bench_engines.plan_of`)."""
    from strategies.cli.bench_engines import plan_of as twin_plan

    return twin_plan(impl, world_size)


def replicas(impl: str, world: int) -> int:
    """How many different batches a step of ``impl`` trains on: one per rank, or one for all (tp, pp)."""
    return 1 if impl in TENSOR_PARALLEL else world


def _worker(rank: int, world: int, impl: str, cfg: BenchConfig, measure: str = "time") -> dict[str, Any]:
    """One rank of one run. ``measure="time"``: step times, nothing else running. ``measure="memory"``: a short run
    while `measure.memory.HeapSampler` reads the heap in use, from before the model is built: the peak above that is
    what this rank's model, engine and steps held at most (a sampling thread would disturb a timed run, hence the
    separate run)."""
    if measure == "memory":
        from strategies.measure.memory import HeapSampler

        cfg = BenchConfig(**{**asdict(cfg), "steps": MEMORY_STEPS, "warmup_steps": 0})
        with HeapSampler() as heap:
            _train(rank, world, impl, cfg)
        return {"impl": impl, "peak_allocated": heap.peak_above_start}
    return _train(rank, world, impl, cfg)


def _train(rank: int, world: int, impl: str, cfg: BenchConfig) -> dict[str, Any]:
    from strategies.cli.bench_engines import build_engine
    from strategies.cli.workload import find_workload

    workload = find_workload(cfg.workload)
    shared = replicas(impl, world)
    model = workload.bench_model(cfg)
    batches = workload.bench_batches(cfg, rank if shared > 1 else 0)
    step = build_engine(impl, workload, model, cfg)
    times, ends, moved = [], [], []
    for batch in batches:
        with _counted() as sent:
            start = time.perf_counter()
            step(batch)
            times.append(time.perf_counter() - start)
        ends.append(time.time())
        moved.append(sent)
    timed = times[cfg.warmup_steps :]
    tokens_per_step = cfg.batch_per_rank * cfg.seq_len * shared
    return {"impl": impl, "tokens_per_s": tokens_per_step * len(timed) / sum(timed),
            "step_s": statistics.median(timed), "step_times": times, "step_ends": ends,
            "tokens_per_step": tokens_per_step,  # (and what its collectives sent, as its time: the timed steps')
            "bytes_per_step": {k: statistics.mean(m.get(k, 0.0) for m in moved[cfg.warmup_steps :]) for k in moved[-1]}}


@contextlib.contextmanager
def _counted() -> Iterator[dict[str, float]]:
    """The bytes this rank sends per collective kind while inside, counted the same way for ours and the peers (at
    torch.distributed's flat gathers, scatters and all-reduce, where both sides call them; ring volumes: (N-1)/N of
    the whole tensor, twice for an all-reduce)."""
    import torch
    import torch.distributed as dist

    from strategies.comm import ops

    moved: dict[str, float] = {}

    def wrap(kind: str, real: Any, factor: int = 1) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            n = dist.get_world_size(kwargs.get("group"))
            # the whole tensor: a gather's output, a scatter's input (the larger of the two), an all-reduce's one
            whole = max((t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)), key=torch.numel)
            moved[kind] = moved.get(kind, 0.0) + factor * (n - 1) / n * whole.numel() * whole.element_size()
            return real(*args, **kwargs)
        return call

    # (torch 2.13's names, else the older ones: one of each, as a deprecated name may call the new one)
    names = [("all_gather", "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor",
              1), ("reduce_scatter", "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
                   else "reduce_scatter_tensor", 1), ("all_reduce", "all_reduce", 2)]
    patched = [(dist, name, wrap(kind, getattr(dist, name), factor)) for kind, name, factor in names]
    patched += [(ops, "_ALL_GATHER", wrap("all_gather", ops._ALL_GATHER)),
                (ops, "_REDUCE_SCATTER", wrap("reduce_scatter", ops._REDUCE_SCATTER))]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    for owner, name, fn in patched:
        setattr(owner, name, fn)
    try:
        yield moved
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def available(impl: str) -> bool:
    if impl.startswith("deepspeed"):
        try:
            import deepspeed  # noqa: F401
        except Exception:
            return False
    return True


def run_pair(ours: str, peer: str, cfg: BenchConfig, pairs: int = 5) -> dict[str, Any]:
    """``pairs`` runs of each, the order swapped every pair (A B, B A, ...); the median of the per-pair throughput
    ratios. Then `MEMORY_RUNS` memory runs of each (see `_worker`)."""
    from strategies.runs import MEMORY_CATEGORIES
    from strategies.testing import run_ranks

    ratios, rows = [], []
    for k in range(pairs):
        order = (ours, peer) if k % 2 == 0 else (peer, ours)
        got = {impl: run_ranks(_worker, cfg.world_size, impl, cfg, timeout_s=600) for impl in order}
        rows.append(got)
        ratios.append(got[ours][0]["tokens_per_s"] / got[peer][0]["tokens_per_s"])
    memory = {impl: peak_memory(impl, cfg) for impl in (ours, peer)}
    prediction = predict(ours, cfg)
    return {
        "ours": ours, "peer": peer, "pairs": pairs, "median_ratio": statistics.median(ratios), "ratios": ratios,
        "ours_tokens_per_s": statistics.median(r[ours][0]["tokens_per_s"] for r in rows),
        "peer_tokens_per_s": statistics.median(r[peer][0]["tokens_per_s"] for r in rows),
        "ours_peak_bytes": memory[ours], "peer_peak_bytes": memory[peer],
        "predicted": prediction,  # the estimator's, for ours and for the peer (the same plan)
        "predicted_peak_bytes": [sum(m[k] for k in MEMORY_CATEGORIES) for m in prediction["memory"]]
        if prediction else None,
        "runs": rows[sorted(range(pairs), key=lambda k: ratios[k])[pairs // 2]],  # the median pair's step times
        "config": asdict(cfg),
    }


def peak_memory(impl: str, cfg: BenchConfig) -> list[int]:
    """Each rank's peak allocated bytes, the median of `MEMORY_RUNS` profiled runs."""
    from strategies.testing import run_ranks

    runs = [run_ranks(_worker, cfg.world_size, impl, cfg, "memory", timeout_s=600) for _ in range(MEMORY_RUNS)]
    return [int(statistics.median(run[rank]["peak_allocated"] for run in runs)) for rank in range(cfg.world_size)]


def model_config(cfg: BenchConfig) -> dict[str, Any]:
    """The bench model's config, as the run store and the estimator take it."""
    from strategies.cli.workload import find_workload

    return find_workload(cfg.workload).model_config(cfg)


def predict(impl: str, cfg: BenchConfig) -> dict | None:
    """What `measure.predict.predict_run` expects of ``impl``'s plan (per-rank memory by category, bytes, bubble), on
    the CPU ranks the bench runs (gloo: its buffers, the kernels' workspace, a pipeline's receives posted ahead)."""
    from strategies.cli.bench_engines import HALF
    from strategies.measure.estimate import with_param_dtype
    from strategies.measure.predict import predict_run

    precision = with_param_dtype("bf16-mixed", True) if impl.endswith(HALF) else "32-true"
    return predict_run(plan_of(impl, cfg.world_size), cfg.world_size, model_config(cfg),
                       cfg.batch_per_rank * replicas(impl, cfg.world_size), precision=precision,
                       accelerator="cpu")  # gloo ranks, as run


def describe(cfg: BenchConfig, names: tuple[str, ...] = ()) -> str:
    from strategies.cli.bench_engines import microbatches

    experts = pair_config("ep", cfg) if "ep" in names or cfg.experts else None
    moe = (f" The MLPs are a mixture of {experts.experts} experts, top {experts.top_k}"
           f"{' (the ep pair)' if not cfg.experts else ''}." if experts else "")
    return (f"Workload {cfg.workload!r} {cfg.n_layer} layers x {cfg.n_embd} wide, sequence {cfg.seq_len}, "
            f"{cfg.batch_per_rank} samples per rank (tp/pp: one batch of {cfg.batch_per_rank} through all ranks, "
            f"{microbatches(cfg.world_size)} microbatches), AdamW, {cfg.world_size} gloo ranks on CPU; {cfg.steps} "
            f"steps per run, the first {cfg.warmup_steps} not timed; tokens/s is the median over pairs of runs in "
            f"alternating order, the ratio the median of the per-pair ratios ours/peer; peak MiB is each rank's most "
            f"heap in use above what it held before the model was built (glibc, sampled every 0.2 ms; median of "
            f"{MEMORY_RUNS} runs of {MEMORY_STEPS} steps), beside the estimator's model states + activations.{moe}")


# -- the command line ---------------------------------------------------------------------------------------



def add_parser(sub: argparse._SubParsersAction) -> None:
    from strategies.cli import bench_gpu

    p = sub.add_parser("bench", help="our engines vs torch DDP, FSDP2, DeepSpeed: alternating pairs, median ratio; "
                                     "--accelerator gpu: our plans vs Lightning's single device and a plain loop")
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: the pairs on gloo ranks; gpu: one GPU, our plans beside Lightning and a plain loop "
                        "(`bench_gpu`)")
    p.add_argument("--pairs", default=None, help=f"comma-separated comparisons (default: all of {', '.join(PAIRS)})")
    p.add_argument("--repeat", type=int, default=None, help="pairs of runs per comparison (default 5; gpu: runs "
                                                            "per row, default 1)")
    for name in ("world_size", "steps", "n_layer", "n_embd", "seq_len", "batch_per_rank", "experts", "top_k"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--warmup-steps", type=int, default=None, help="steps of each run not timed")
    p.add_argument("--workload", default=BenchConfig.workload, help="a registered workload or module:object")
    p.add_argument("--out", default=None, help="also write the results as JSON")
    p.add_argument("--report", action="append", help="write the table here: .md for markdown, else CSV (repeatable)")
    p.add_argument("--runs-dir", default=None, help="the run store (default $STRATPACK_RUNS or ./runs)")
    p.add_argument("--no-store", action="store_true", help="do not write the runs to the run store")
    bench_gpu.add_arguments(p)
    p.set_defaults(func=command)


def _cpu_defaults(args: argparse.Namespace) -> None:
    """The pairs' sizes where the command line gives none (the GPU bench has its own)."""
    defaults = BenchConfig()
    for name in ("world_size", "steps", "n_layer", "n_embd", "seq_len", "batch_per_rank", "experts", "top_k",
                 "warmup_steps"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(defaults, name))
    args.repeat = args.repeat or 5


def _refusal(args: argparse.Namespace, names: list[str]) -> str | None:
    """Why the CPU pairs cannot run as asked, in one line (before any rank starts), or None."""
    from strategies.cli.bench_engines import microbatches

    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        return f"unknown pair(s) {', '.join(unknown)}; choose from {', '.join(PAIRS)}"
    if not 0 <= args.warmup_steps < args.steps:
        return f"--warmup-steps must be at least 0 and below --steps ({args.steps})"
    split = microbatches(args.world_size)
    if any(n.startswith("pp-") for n in names) and args.batch_per_rank % split:
        return (f"the pipeline pairs run {split} microbatches: --batch-per-rank {args.batch_per_rank} does not split "
                f"into them (give a multiple of {split})")
    return None


def command(args: argparse.Namespace) -> int:
    if args.accelerator == "gpu" or args.rows is not None:  # one device: plain loop, Lightning, our plans
        from strategies.cli import bench_gpu

        args.repeat = args.repeat or 1
        return bench_gpu.command(args)
    _cpu_defaults(args)
    names = [n.strip() for n in args.pairs.split(",") if n.strip()] if args.pairs else list(PAIRS)
    refused = _refusal(args, names)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    cfg = BenchConfig(world_size=args.world_size, steps=args.steps, warmup_steps=args.warmup_steps,
                      n_layer=args.n_layer, n_embd=args.n_embd, seq_len=args.seq_len,
                      batch_per_rank=args.batch_per_rank, workload=args.workload, experts=args.experts,
                      top_k=args.top_k)
    results = []
    for ours, peer in (PAIRS[name] for name in names):
        if not available(peer):
            results.append({"ours": ours, "peer": peer, "skipped": f"{peer} is not installed"})
            continue
        print(f"bench {ours} vs {peer}: {args.repeat} pairs of runs...", file=sys.stderr, flush=True)
        results.append(run_pair(ours, peer, pair_config(ours, cfg), pairs=args.repeat))
    print(describe(cfg, tuple(names)) + "\n\n" + bench_report.format_report(results))
    for path in args.report or []:
        bench_report.write_report(results, describe(cfg, tuple(names)), path)
        print(f"report: {path}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if any("skipped" not in r for r in results) and not args.no_store:
        comparison = bench_report.write_runs(results, cfg, model_config(cfg), args.runs_dir)
        print(f"comparison id: {comparison} (in the run store; `stratpack dashboard` shows it)")
    return 0
