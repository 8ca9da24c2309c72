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
TENSOR_PARALLEL = ("tp", "dtensor_tp", "pp_1f1b", "pp_gpipe", "torch_pp_1f1b", "torch_pp_gpipe")
MICROBATCHES = 4


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

        plan = ParallelPlan.parse(f"pp{dist.get_world_size()}_{impl[3:]}_mb{MICROBATCHES}")
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
    """torch.distributed.pipelining on the same cut as ours (embeddings + first blocks | last blocks + head)."""
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from strategies.pipeline.stages import plan_stages

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = plan_stages(model, world).ranges[rank]
    blocks = model.blocks[mine.start : mine.stop]

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(blocks)
            if rank == 0:
                self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
            if rank == world - 1:
                self.ln_f, self.head = model.ln_f, model.head

        def forward(self, x):
            if rank == 0:
                x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x)) if rank == world - 1 else x

    stage_module = Stage()
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    loss_fn = lambda logits, y: torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    runner = cls(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage_module.parameters(), **opt_kwargs)

    def step(batch):
        x, y = batch
        if rank == 0:
            runner.step(x)
        elif rank == world - 1:
            runner.step(target=y)
        else:
            runner.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _plain_step(model, opt):
    def step(batch):
        _loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _worker(rank: int, world: int, impl: str, cfg: BenchConfig) -> dict[str, Any]:
    replicas = 1 if impl in TENSOR_PARALLEL else world
    model, batches = _model_and_data(cfg, rank if replicas > 1 else 0)
    step = _engine(impl, model, cfg)
    times = []
    for batch in batches:
        start = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - start)
    getattr(step, "finish", lambda: None)()
    timed = times[cfg.warmup_steps :]
    tokens = cfg.batch_per_rank * cfg.seq_len * replicas * len(timed)
    return {"impl": impl, "tokens_per_s": tokens / sum(timed), "step_s": statistics.median(timed)}


def available(impl: str) -> bool:
    if impl.startswith("deepspeed"):
        try:
            import deepspeed  # noqa: F401
        except Exception:
            return False
    return True


def run_pair(ours: str, peer: str, cfg: BenchConfig, pairs: int = 5) -> dict[str, Any]:
    """Alternate ``pairs`` runs of each (A B B A ...); median of the per-pair throughput ratios."""
    ratios, rows = [], []
    for k in range(pairs):
        order = (ours, peer) if k % 2 == 0 else (peer, ours)
        got = {impl: run_ranks(_worker, cfg.world_size, impl, cfg, timeout_s=600)[0] for impl in order}
        rows.append(got)
        ratios.append(got[ours]["tokens_per_s"] / got[peer]["tokens_per_s"])
    return {
        "ours": ours, "peer": peer, "pairs": pairs, "median_ratio": statistics.median(ratios), "ratios": ratios,
        "ours_tokens_per_s": statistics.median(r[ours]["tokens_per_s"] for r in rows),
        "peer_tokens_per_s": statistics.median(r[peer]["tokens_per_s"] for r in rows),
        "config": asdict(cfg),
    }


def format_report(results: list[dict[str, Any]]) -> str:
    lines = ["| ours | peer | ours tokens/s | peer tokens/s | median ratio | pairs |", "|---|---|---|---|---|---|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['ours']} | {r['peer']} | - | - | skipped: {r['skipped']} | 0 |")
            continue
        lines.append(f"| {r['ours']} | {r['peer']} | {r['ours_tokens_per_s']:,.0f} | {r['peer_tokens_per_s']:,.0f} "
                     f"| {r['median_ratio']:.3f} | {r['pairs']} |")
    return "\n".join(lines)
