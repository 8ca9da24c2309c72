"""Speed against the peers: our data-parallel engines vs torch DDP, FSDP2 and DeepSpeed, same loop.

Every implementation trains the demo GPT with the same model, data, per-rank batch, optimizer and seed,
in a plain training loop (no Lightning, so only the engines differ), each run in fresh processes. Runs
alternate A B A B ... so that a machine that drifts favours neither side; the report gives the median of
the per-pair ratios ours / peer. Kept apart from the tests: speed is never a pass/fail test.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from strategies.testing import run_ranks

# (ours, peer) pairs by name; a peer whose package is missing is reported as skipped.
PAIRS = {
    "dp": ("dp", "torch_ddp"),
    "zero1": ("zero1", "deepspeed1"),
    "zero2": ("zero2", "deepspeed2"),
    "zero3": ("zero3", "deepspeed3"),
    "zero3-fsdp2": ("zero3", "fsdp2"),
    "tp": ("tp", "dtensor_tp"),
    "pp-1f1b": ("pp_1f1b", "torch_pp_1f1b"),
    "pp-gpipe": ("pp_gpipe", "torch_pp_gpipe"),
    "pp-interleaved": ("pp_interleaved", "torch_pp_interleaved"),
}

# How each implementation is shown, and the plan whose estimate is its prediction (degrees filled in later).
NAMES = {
    "dp": "dp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "tp": "tp", "pp_1f1b": "pp 1F1B",
    "pp_gpipe": "pp GPipe", "pp_interleaved": "pp interleaved", "torch_ddp": "torch DDP",
    "deepspeed1": "DeepSpeed ZeRO-1", "deepspeed2": "DeepSpeed ZeRO-2", "deepspeed3": "DeepSpeed ZeRO-3",
    "fsdp2": "torch FSDP2", "dtensor_tp": "torch DTensor TP", "torch_pp_1f1b": "torch Schedule1F1B",
    "torch_pp_gpipe": "torch ScheduleGPipe", "torch_pp_interleaved": "torch ScheduleInterleaved1F1B",
}


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


# Every rank works on the same batch: tensor-parallel peers, and pipeline stages (one batch flows through).
TENSOR_PARALLEL = ("tp", "dtensor_tp", "pp_1f1b", "pp_gpipe", "pp_interleaved", "torch_pp_1f1b", "torch_pp_gpipe",
                   "torch_pp_interleaved")
MICROBATCHES = 4
VIRTUAL = 2  # stages per rank in the interleaved pair


def plan_of(impl: str, world_size: int) -> str:
    """The plan whose estimator figures stand beside ``impl``'s measurements (ours or the peer's twin)."""
    base = impl.removeprefix("torch_")
    if base.startswith("pp_"):
        schedule = base[3:]
        virtual = f"_v{VIRTUAL}" if schedule == "interleaved" else ""
        return f"pp{world_size}_{schedule}{virtual}_mb{MICROBATCHES}"
    twin = {"ddp": "dp", "deepspeed1": "zero1", "deepspeed2": "zero2", "deepspeed3": "zero3", "fsdp2": "zero3",
            "dtensor_tp": "tp"}.get(base, base)
    return f"tp{world_size}" if twin == "tp" else twin


def _model_and_data(cfg: BenchConfig, rank: int):
    from demos.data import CharDataset, CharTokenizer, load_corpus
    from demos.gpt import GPT, GPTConfig

    text = load_corpus(max_chars=200_000)
    tok = CharTokenizer(text)
    data = CharDataset(tok.encode(text), cfg.seq_len)
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                          seq_len=cfg.seq_len))
    g = torch.Generator().manual_seed(cfg.seed + 1)
    batches = []
    for _ in range(cfg.steps):
        idx = torch.randint(len(data), (cfg.batch_per_rank * cfg.world_size,), generator=g)
        idx = idx[rank * cfg.batch_per_rank : (rank + 1) * cfg.batch_per_rank]
        xs, ys = zip(*(data[int(i)] for i in idx))
        batches.append((torch.stack(xs), torch.stack(ys)))
    return model, batches


def _loss(model, batch):
    x, y = batch
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _engine(impl: str, model, cfg: BenchConfig):
    """(model, step function) for one implementation; step(batch) runs forward, backward and update."""
    opt_kwargs = dict(lr=cfg.lr, betas=(0.9, 0.95))
    if impl in ("dp", "zero1", "zero2", "zero3"):
        from strategies.comm import Axis, CommStats
        from strategies.data_parallel import BucketedDataParallel
        from strategies.zero import shard_model

        axis = Axis.of_group("dp", dist.group.WORLD, CommStats())
        opt = torch.optim.AdamW(model.parameters(), **opt_kwargs)
        sync = BucketedDataParallel(model, axis) if impl == "dp" else shard_model(model, opt, axis, int(impl[-1]))

        def step(batch):
            _loss(model, batch).backward()
            sync.finish()
            opt.step()
            if hasattr(sync, "after_step"):
                sync.after_step()
            opt.zero_grad(set_to_none=True)
        return step
    if impl == "tp":  # every rank on the tp axis: the whole world is one tensor-parallel group
        from strategies.comm import Axis, CommStats
        from strategies.tp_plan import apply_plan, detect_plan

        apply_plan(model, detect_plan(model), Axis.of_group("tp", dist.group.WORLD, CommStats()))
        return _plain_step(model, torch.optim.AdamW(model.parameters(), **opt_kwargs))
    if impl == "dtensor_tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        # The same layers split the same way (a fused qkv is split as one block here, which costs the same
        # compute and traffic; the per-rank head layout differs, which only matters for the numbers).
        style = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(),
                 "mlp.proj": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, mesh, style)
        return _plain_step(model, torch.optim.AdamW(model.parameters(), **opt_kwargs))
    if impl.startswith("pp_"):  # our pipeline engine in a plain loop: the step function is the loss
        from strategies.mesh import ParallelMesh
        from strategies.pipeline.engine import PipelineEngine
        from strategies.plan import ParallelPlan

        plan = ParallelPlan.parse(plan_of(impl, dist.get_world_size()))
        engine = PipelineEngine(model, plan.resolve(dist.get_world_size()), ParallelMesh(plan, "cpu"))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **opt_kwargs)

        def step(batch):
            engine.train_step(batch, 0, lambda mb, i: _loss(model, mb), torch.device("cpu"))
            opt.step()
            opt.zero_grad(set_to_none=True)
        step.finish = engine.finish  # the last loss is still on its way to the other stages
        return step
    if impl.startswith("torch_pp_"):
        return _torch_pipeline(impl[len("torch_pp_"):], model, opt_kwargs)
    if impl == "torch_ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), **opt_kwargs)
        return _plain_step(ddp, opt)
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), **opt_kwargs)
        return _plain_step(model, opt)
    if impl.startswith("deepspeed"):
        import os

        import deepspeed

        # DeepSpeed reads its ranks from the launcher's environment; run_ranks started the group itself.
        os.environ.update(LOCAL_RANK=str(dist.get_rank()), RANK=str(dist.get_rank()),
                          WORLD_SIZE=str(dist.get_world_size()))
        deepspeed.init_distributed(dist_backend="gloo")
        config = {"train_micro_batch_size_per_gpu": cfg.batch_per_rank, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": int(impl[-1])}, "steps_per_print": 10**9}
        opt = torch.optim.AdamW(model.parameters(), **opt_kwargs)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

        def step(batch):
            loss = _loss(engine, batch)
            engine.backward(loss)
            engine.step()
        return step
    raise ValueError(f"unknown implementation {impl!r}")


def _torch_pipeline(schedule: str, model, opt_kwargs):
    """torch.distributed.pipelining on the same cut as ours: the blocks split evenly over the stages, the
    embeddings on the first, the final norm and head on the last; stage s on rank s mod world (looped)."""
    from torch import nn
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    from strategies.pipeline.stages import plan_stages

    rank, world = dist.get_rank(), dist.get_world_size()
    virtual = VIRTUAL if schedule == "interleaved" else 1
    stages = world * virtual
    layout = plan_stages(model, stages)

    class Stage(nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.first, self.last = index == 0, index == stages - 1
            self.blocks = nn.ModuleList(model.blocks[layout.ranges[index].start : layout.ranges[index].stop])
            if self.first:
                self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
            if self.last:
                self.ln_f, self.head = model.ln_f, model.head

        def forward(self, x):
            if self.first:
                x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x)) if self.last else x

    mine = [Stage(c * world + rank) for c in range(virtual)]
    pipe_stages = [PipelineStage(m, c * world + rank, stages, torch.device("cpu")) for c, m in enumerate(mine)]
    loss_fn = lambda logits, y: torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    if schedule == "interleaved":
        runner = ScheduleInterleaved1F1B(pipe_stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    else:
        cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        runner = cls(pipe_stages[0], n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    opt = torch.optim.AdamW([p for m in mine for p in m.parameters()], **opt_kwargs)
    holds_first, holds_last = any(m.first for m in mine), any(m.last for m in mine)

    def step(batch):
        x, y = batch
        runner.step(*([x] if holds_first else []), **({"target": y} if holds_last else {}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _plain_step(model, opt):
    def step(batch):
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


MEMORY_STEPS = 3  # the optimizer states exist from the first step on; the peak is reached by the second


def _worker(rank: int, world: int, impl: str, cfg: BenchConfig, measure: str = "time") -> dict[str, Any]:
    """One rank of one run. ``measure="time"``: step times, nothing else running. ``measure="memory"``: a
    short run while `memory.HeapSampler` reads the heap in use, from before the model is built: the peak
    above that is what this rank's model, engine and steps held at most (a sampling thread would disturb a
    timed run, hence the separate run)."""
    if measure == "memory":
        from strategies.memory import HeapSampler

        cfg = BenchConfig(**{**asdict(cfg), "steps": MEMORY_STEPS, "warmup_steps": 0})
        with HeapSampler() as heap:
            _train(rank, world, impl, cfg)
        return {"impl": impl, "peak_allocated": heap.peak_above_start}
    return _train(rank, world, impl, cfg)


def _replicas(impl: str, world: int) -> int:
    """How many different batches a step of ``impl`` trains on: one per rank, or one for all (tp, pp)."""
    return 1 if impl in TENSOR_PARALLEL else world


def _train(rank: int, world: int, impl: str, cfg: BenchConfig) -> dict[str, Any]:
    replicas = _replicas(impl, world)
    model, batches = _model_and_data(cfg, rank if replicas > 1 else 0)
    step = _engine(impl, model, cfg)
    times, ends = [], []
    for batch in batches:
        start = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - start)
        ends.append(time.time())
    getattr(step, "finish", lambda: None)()
    timed = times[cfg.warmup_steps :]
    tokens = cfg.batch_per_rank * cfg.seq_len * replicas * len(timed)
    return {"impl": impl, "tokens_per_s": tokens / sum(timed), "step_s": statistics.median(timed),
            "step_times": times, "step_ends": ends, "tokens_per_step": cfg.batch_per_rank * cfg.seq_len * replicas}


def available(impl: str) -> bool:
    if impl.startswith("deepspeed"):
        try:
            import deepspeed  # noqa: F401
        except Exception:
            return False
    return True


def run_pair(ours: str, peer: str, cfg: BenchConfig, pairs: int = 5) -> dict[str, Any]:
    """Alternate ``pairs`` runs of each (A B B A ...); median of the per-pair throughput ratios. Then one
    memory run of each (see `_worker`)."""
    ratios, rows = [], []
    for k in range(pairs):
        order = (ours, peer) if k % 2 == 0 else (peer, ours)
        got = {impl: run_ranks(_worker, cfg.world_size, impl, cfg, timeout_s=600) for impl in order}
        rows.append(got)
        ratios.append(got[ours][0]["tokens_per_s"] / got[peer][0]["tokens_per_s"])
    memory = {impl: peak_memory(impl, cfg) for impl in (ours, peer)}
    prediction = predict(ours, cfg)
    median_pair = rows[sorted(range(pairs), key=lambda k: ratios[k])[pairs // 2]]
    return {
        "ours": ours, "peer": peer, "pairs": pairs, "median_ratio": statistics.median(ratios), "ratios": ratios,
        "ours_tokens_per_s": statistics.median(r[ours][0]["tokens_per_s"] for r in rows),
        "peer_tokens_per_s": statistics.median(r[peer][0]["tokens_per_s"] for r in rows),
        "ours_peak_bytes": memory[ours], "peer_peak_bytes": memory[peer],
        "predicted": prediction,  # the estimator's, for ours and for the peer (the same plan)
        "predicted_peak_bytes": [sum(m[k] for k in ("params", "grads", "optimizer", "host", "activations"))
                                 for m in prediction["memory"]] if prediction else None,
        "runs": median_pair,  # every rank's step times in the pair whose ratio is the median
        "config": asdict(cfg),
    }


MEMORY_RUNS = 3  # the backward's peak moves by a few hundred KiB with the timing of async frees: median of 3


def peak_memory(impl: str, cfg: BenchConfig) -> list[int]:
    """Each rank's peak allocated bytes, the median of `MEMORY_RUNS` profiled runs."""
    runs = [run_ranks(_worker, cfg.world_size, impl, cfg, "memory", timeout_s=600) for _ in range(MEMORY_RUNS)]
    return [int(statistics.median(run[rank]["peak_allocated"] for run in runs)) for rank in range(cfg.world_size)]


def model_config(cfg: BenchConfig) -> dict[str, Any]:
    """The bench model's config, as the run store and the estimator take it."""
    from demos.data import CharTokenizer, load_corpus

    vocab = CharTokenizer(load_corpus(max_chars=200_000)).vocab_size
    return {"vocab_size": vocab, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
            "seq_len": cfg.seq_len}


def predict(impl: str, cfg: BenchConfig) -> dict | None:
    """What `estimate.predict_run` expects of ``impl``'s plan (per-rank memory by category, bytes, bubble)."""
    from strategies.estimate import predict_run

    return predict_run(plan_of(impl, cfg.world_size), cfg.world_size, model_config(cfg),
                       cfg.batch_per_rank * _replicas(impl, cfg.world_size))


def format_report(results: list[dict[str, Any]]) -> str:
    """Markdown: throughput and its ratio, then each rank's peak memory for both sides and the estimate."""
    mib = lambda xs: " / ".join(f"{x / 2**20:.1f}" for x in xs) if xs else "-"
    lines = ["| ours | peer | ours tokens/s | peer tokens/s | median ratio | pairs | peak MiB/rank ours | peer | "
             "estimate |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {NAMES[r['ours']]} | {NAMES[r['peer']]} | - | - | skipped: {r['skipped']} | 0 | - | - | - |")
            continue
        lines.append(f"| {NAMES[r['ours']]} | {NAMES[r['peer']]} | {r['ours_tokens_per_s']:,.0f} "
                     f"| {r['peer_tokens_per_s']:,.0f} | {r['median_ratio']:.3f} | {r['pairs']} "
                     f"| {mib(r['ours_peak_bytes'])} | {mib(r['peer_peak_bytes'])} | {mib(r['predicted_peak_bytes'])} |")
    return "\n".join(lines)


def write_runs(results: list[dict[str, Any]], cfg: BenchConfig, root: str | None = None) -> str:
    """Each measured side of each pair as one run in the run store, all under one comparison id ("bench-..."),
    so the dashboard shows them side by side. A run's records are every rank's step times from the pair whose
    ratio was the median; its memory is ``max_allocated`` (the profiled peak, see `_worker`); ``meta.bench``
    and ``summary.bench`` hold the pair, the ratios and both sides' figures."""
    import platform
    import sys

    from strategies import runstore
    from strategies.estimate import ModelShape
    from strategies.plan import ParallelPlan

    comparison = runstore.new_comparison_id("bench")
    model = model_config(cfg)
    num_params = ModelShape.from_config(model).total()  # exact for the demo GPT (tests/unit/test_estimate.py)
    for result in results:
        if "skipped" in result:
            continue
        bench = {key: result[key] for key in ("ours", "peer", "pairs", "median_ratio", "ratios",
                                              "ours_tokens_per_s", "peer_tokens_per_s", "ours_peak_bytes",
                                              "peer_peak_bytes", "predicted_peak_bytes")}
        for role in ("ours", "peer"):
            impl = result[role]
            plan = ParallelPlan.parse(plan_of(impl, cfg.world_size)).resolve(cfg.world_size)
            run_id = runstore.new_run_id(f"bench-{impl}")
            writers = [runstore.RunWriter(root, run_id, rank) for rank in range(cfg.world_size)]
            writers[0].write_meta({
                "run_id": run_id, "comparison": comparison, "label": NAMES[impl],
                "plan": str(plan) if role == "ours" else None,
                "degrees": {k: getattr(plan, k) for k in ("dp", "tp", "pp", "microbatches", "virtual")},
                "world_size": cfg.world_size, "devices": [platform.processor() or "cpu"],
                "versions": {"torch": torch.__version__, "stratpack": runstore.pack_version(),
                             "python": sys.version.split()[0]},
                "model": model, "num_params": num_params, "seed": cfg.seed, "started": time.time(),
                "predicted": result["predicted"],
                "bench": {**bench, "role": role, "config": asdict(cfg)},
            })
            peaks = result[f"{role}_peak_bytes"]
            for rank, writer in enumerate(writers):
                got = result["runs"][impl][rank]
                for step, (seconds, end) in enumerate(zip(got["step_times"], got["step_ends"]), start=1):
                    writer.append({"step": step, "time": end, "step_time_s": seconds, "loss": None, "lr": cfg.lr,
                                   "tokens_per_s": got["tokens_per_step"] / seconds,
                                   "memory": {"max_allocated": peaks[rank]}, "comm": {}, "bubble": None,
                                   "warmup": step <= cfg.warmup_steps})
                writer.finish({"steps": cfg.steps, "world_size": cfg.world_size,
                               "tokens_per_s": result[f"{role}_tokens_per_s"],
                               "memory_bytes_per_rank": [{"max_allocated": p} for p in peaks],
                               "bench": {**bench, "role": role}} if rank == 0 else None)
    return comparison


def write_report(results: list[dict[str, Any]], cfg: BenchConfig, path: str) -> None:
    """The table as markdown (``.md``) or CSV (any other suffix), with how it was measured."""
    import csv

    if not path.endswith(".md"):
        with open(path, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["ours", "peer", "pairs", "ours_tokens_per_s", "peer_tokens_per_s", "median_ratio",
                          "ratios", "ours_peak_MiB_per_rank", "peer_peak_MiB_per_rank", "predicted_peak_MiB_per_rank",
                          "skipped"])
            for r in results:
                if "skipped" in r:
                    out.writerow([r["ours"], r["peer"], 0, "", "", "", "", "", "", "", r["skipped"]])
                    continue
                mib = lambda xs: " ".join(f"{x / 2**20:.2f}" for x in xs) if xs else ""
                out.writerow([r["ours"], r["peer"], r["pairs"], f"{r['ours_tokens_per_s']:.1f}",
                              f"{r['peer_tokens_per_s']:.1f}", f"{r['median_ratio']:.4f}",
                              " ".join(f"{x:.4f}" for x in r["ratios"]), mib(r["ours_peak_bytes"]),
                              mib(r["peer_peak_bytes"]), mib(r["predicted_peak_bytes"]), ""])
        return
    with open(path, "w") as f:
        f.write(f"# stratpack bench, {time.strftime('%Y-%m-%d %H:%M')}\n\n{describe(cfg)}\n\n{format_report(results)}\n")


def describe(cfg: BenchConfig) -> str:
    return (f"Demo GPT {cfg.n_layer} layers x {cfg.n_embd} wide, sequence {cfg.seq_len}, {cfg.batch_per_rank} samples "
            f"per rank (tp/pp: one batch of {cfg.batch_per_rank} through all ranks, {MICROBATCHES} microbatches), "
            f"AdamW, {cfg.world_size} {dist.Backend.GLOO} ranks on CPU; {cfg.steps} steps per run, the first "
            f"{cfg.warmup_steps} not timed; tokens/s is the median over alternating pairs, the ratio the median of "
            f"the per-pair ratios ours/peer; peak MiB is each rank's most heap in use above what it held before the "
            f"model was built (glibc, sampled every 0.2 ms; median of {MEMORY_RUNS} runs of {MEMORY_STEPS} steps), "
            f"beside the estimator's model states + activations.")
