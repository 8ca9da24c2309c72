"""What the pieces of a training step cost on this machine, measured with every rank busy, for the planner's step time.

A step on small models or CPU ranks is not its FLOPs at a large matmul's rate: every operator has a fixed cost
(dispatch, autograd, Python), the optimizer one per tensor, and Lightning's loop, callbacks and the monitor one per
step. So, at the planner's transformer shape (`estimate.ModelShape`), ``measure`` times on ``world`` ranks at once
(the cores they share, with the threads Lightning gives each), each rank on its own:

- a block's forward and backward (the estimator's block: two norms, fused qkv, SDPA, a 4h GELU MLP) with its
  matrices split over each tp degree, at two token counts: seconds per call plus seconds per token; its forward
  alone; and what checkpointing it adds (recompute, and torch's checkpoint machinery around it);
- the embedding (first stage) and the final norm, head and cross-entropy (last stage), likewise;
- the optimizer (AdamW): seconds per tensor plus seconds per element (many small tensors against one flat);
- Lightning's own work per step: a Trainer with the pack's `StrategyMonitor` on a one-layer model, less that model.

`Costs` is cached beside the calibration (`calibrate.cache_path`), per host, world size, torch and shape.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

Fit = tuple[float, float]  # seconds per call, seconds per unit (token, element)


@dataclass(frozen=True)
class Costs:
    world: int
    shape: tuple[int, int, int, int]  # hidden, heads, seq, vocab
    loop: float  # Lightning's own seconds per step
    block: dict[int, Fit]  # tp degree -> a block's forward and backward: per call, per token
    forward: float  # the forward's share of a block's forward and backward
    embedding: Fit
    head: Fit  # final norm, output layer and cross-entropy
    optimizer: Fit  # AdamW: per tensor, per element
    recompute: Fit = (0.0, 0.0)  # what checkpointing a block adds to its forward and backward (tp1)

    def block_seconds(self, tp: int, tokens: float) -> float:
        call, per_token = self.block[min(self.block, key=lambda t: abs(t - tp))]
        return call + per_token * tokens


def measure(world: int, hidden: int, heads: int, seq: int, vocab: int, tps: tuple[int, ...] = (1, 2, 4),
            cache: bool = True) -> Costs:
    """Measure (tens of seconds) and cache the costs at ``world`` ranks for this shape."""
    from strategies.testing import run_ranks

    tps = tuple(t for t in tps if t <= world and heads % t == 0)
    results = run_ranks(_rank, world, hidden, heads, seq, vocab, tps, timeout_s=600)
    pick = lambda key: max(results, key=lambda r: r[key][0] + r[key][1] * seq * 8)[key]  # noqa: E731 - slowest
    costs = Costs(world, (hidden, heads, seq, vocab), max(r["loop"] for r in results),
                  {t: pick(f"block{t}") for t in tps}, max(r["forward"] for r in results), pick("embedding"),
                  pick("head"), max(results, key=lambda r: sum(r["optimizer"]))["optimizer"],
                  # a difference of two timings: the ranks' median, not the slowest
                  sorted((r["recompute"] for r in results), key=lambda f: f[0] + f[1] * seq * 8)[len(results) // 2])
    if cache:
        _save(costs)
    return costs


def load(world: int, hidden: int, heads: int, seq: int, vocab: int) -> Costs | None:
    try:
        with open(_path()) as f:
            entry = json.load(f).get(_key(world, (hidden, heads, seq, vocab)))
    except (OSError, ValueError):
        return None
    if entry is None:
        return None
    fits = {k: tuple(entry[k]) for k in ("shape", "embedding", "head", "optimizer", "recompute") if k in entry}
    return Costs(**{**entry, **fits, "block": {int(k): tuple(v) for k, v in entry["block"].items()}})


def _path() -> str:
    from strategies.measure.calibrate import cache_path

    return os.path.join(os.path.dirname(cache_path()), "costs.json")


def _key(world: int, shape: tuple[int, ...]) -> str:
    return f"{socket.gethostname()}|cpu|{world}|torch {torch.__version__}|{shape}"


def _save(costs: Costs) -> None:
    from strategies.measure.calibrate import write_entry

    write_entry(_path(), _key(costs.world, costs.shape), asdict(costs))


# -- on each rank --------------------------------------------------------------------------------------------------


class _Block(nn.Module):
    """The estimator's block with its matrices split over ``tp`` (this rank's share of the work; no communication)."""

    def __init__(self, hidden: int, heads: int, tp: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads // tp, hidden // heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden // tp), nn.Linear(hidden // tp, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden // tp), nn.Linear(4 * hidden // tp, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in self.qkv(self.ln1(x)).chunk(3, -1))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(y)
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


def _rank(rank: int, world: int, hidden: int, heads: int, seq: int, vocab: int, tps: tuple[int, ...]) -> dict:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as Lightning sets it for its ranks
    torch.manual_seed(rank)
    out: dict[str, Any] = {}
    for tp in tps:
        block = _Block(hidden, heads, tp)
        out[f"block{tp}"] = _fit(lambda b, m=block: _backward(m(torch.randn(b, seq, hidden, requires_grad=True))), seq)
    with torch.no_grad():
        forward = _seconds(lambda: block(torch.randn(8, seq, hidden)))
    out["forward"] = forward / (out[f"block{tps[-1]}"][0] + out[f"block{tps[-1]}"][1] * 8 * seq)
    from torch.utils.checkpoint import checkpoint

    plain = _Block(hidden, heads, 1)
    checkpointed = _fit(lambda b: _backward(checkpoint(plain, torch.randn(b, seq, hidden, requires_grad=True),
                                                       use_reentrant=False)), seq)
    out["recompute"] = tuple(max(c - p, 0.0) for c, p in zip(checkpointed, out["block1"]))
    tok, pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
    out["embedding"] = _fit(lambda b: _backward(tok(torch.randint(vocab, (b, seq))) + pos(torch.arange(seq))), seq)
    norm, head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab)

    def loss(b: int) -> None:
        logits = head(norm(torch.randn(b, seq, hidden, requires_grad=True)))
        nn.functional.cross_entropy(logits.view(-1, vocab), torch.randint(vocab, (b * seq,))).backward()
    out["head"] = _fit(loss, seq)
    out["optimizer"] = _optimizer_fit()
    out["loop"] = _loop_seconds()
    return out


def _backward(y: torch.Tensor) -> None:
    y.sum().backward()


def _seconds(fn, reps: int = 5, rounds: int = 5) -> float:
    """Seconds a call of ``fn`` takes: the median of ``rounds`` means over ``reps`` calls (ranks sharing cores make
    single timings noisy)."""
    fn()
    means = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        means.append((time.perf_counter() - start) / reps)
    return sorted(means)[len(means) // 2]


def _fit(run, seq: int) -> Fit:
    """(seconds per call, seconds per token): a least-squares line through 1, 2, 4 and 8 samples of ``seq``."""
    sizes = (1, 2, 4, 8)
    times = [_seconds(lambda b=b: run(b)) for b in sizes]
    xs = [b * seq for b in sizes]
    mean_x, mean_t = sum(xs) / len(xs), sum(times) / len(times)
    slope = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, times)) / sum((x - mean_x) ** 2 for x in xs)
    per_token = max(slope, 0.0)
    return max(mean_t - per_token * mean_x, 0.0), per_token


def _optimizer_fit() -> Fit:
    """AdamW on 64 tensors of 1,000 elements, then one of 64,000: the difference is 63 tensors' fixed cost."""
    def step_of(params: list[nn.Parameter]) -> float:
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3)
        return _seconds(opt.step)
    many = step_of([nn.Parameter(torch.randn(1000)) for _ in range(64)])
    one = step_of([nn.Parameter(torch.randn(64000))])
    per_tensor = max(many - one, 0.0) / 63
    return per_tensor, max(one - per_tensor, 0.0) / 64000


def _loop_seconds() -> float:
    """Lightning's seconds per step beyond the model: a one-layer model fitted with the pack's monitor."""
    import tempfile
    import warnings

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from strategies.measure.monitor import StrategyMonitor

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).pow(2).mean()
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    steps = 24
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitor = StrategyMonitor(warmup_steps=4, runs_dir=tmp, label="loop")
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor])
        trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(steps * 2, 4)), batch_size=2))
    return float(monitor.summary["step_time_s"])
