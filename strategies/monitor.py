"""StrategyMonitor: what a run cost, measured per step on every rank.

This first version records step times, the global mean loss, throughput and the communication counters of
the pack's strategies; the run store, memory and wandb arrive with the measurement issue (#7).
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from typing_extensions import override


class StrategyMonitor(L.Callback):
    """Per-step wall times and losses; tokens/s after ``warmup_steps``; comm bytes per step.

    Losses are kept locally and averaged over the ranks once, at the end, so that measuring adds no
    collective to the steps being timed.
    """

    def __init__(self, warmup_steps: int = 3, tokens_per_sample: int | None = None) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.tokens_per_sample = tokens_per_sample
        self.step_ends: list[float] = []
        self.local_losses: list[float] = []
        self.samples_per_step = 0
        self._pending_loss = 0.0
        self.bubbles: list[float] = []  # pipeline: this rank's measured idle fraction, per step
        self.summary: dict[str, Any] = {}

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stats = getattr(trainer.strategy, "comm_stats", None)
        if stats is not None:
            stats.reset()  # leave out the set-up broadcast: count training steps only
        self.step_ends = [time.perf_counter()]
        self.local_losses = []
        self.bubbles = []
        self._pending_loss = 0.0

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        pipeline = getattr(trainer.strategy, "pipeline", None)
        if pipeline is not None and pipeline.last_step is not None:
            self.bubbles.append(pipeline.last_step.bubble)
        self._pending_loss += float(loss.detach())  # Lightning already divided it by accumulate_grad_batches
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        self.local_losses.append(self._pending_loss)
        self._pending_loss = 0.0
        self.step_ends.append(time.perf_counter())
        if not self.samples_per_step:
            x = batch[0] if isinstance(batch, (list, tuple)) else batch
            replicas = trainer.strategy.distributed_sampler_kwargs["num_replicas"] if trainer.world_size > 1 else 1
            self.samples_per_step = len(x) * replicas * trainer.accumulate_grad_batches

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stats = getattr(trainer.strategy, "comm_stats", None)
        snapshot = stats.snapshot() if stats is not None else {}  # before the loss reduce below adds to it
        losses = torch.tensor(self.local_losses, dtype=torch.float64)
        losses = trainer.strategy.reduce(losses, reduce_op="mean") if trainer.world_size > 1 else losses
        steps = len(self.local_losses)
        timed = self.step_ends[self.warmup_steps :]
        seconds = timed[-1] - timed[0] if len(timed) > 1 else float("nan")
        timed_steps = len(timed) - 1
        samples_per_s = timed_steps * self.samples_per_step / seconds if timed_steps > 0 else float("nan")
        tokens = self.tokens_per_sample or getattr(pl_module, "tokens_per_sample", None)
        comm = {key: {k: v / steps for k, v in rec.items()} for key, rec in snapshot.items()} if steps else {}
        memory: dict[str, float] = {}
        if hasattr(trainer.strategy, "model_state_bytes"):
            memory = dict(trainer.strategy.model_state_bytes())
            memory["activations_peak"] = trainer.strategy.peak_activation_bytes
        else:  # another strategy (one process, Lightning's ddp): what the module and its optimizers hold
            from strategies.memory import model_state_bytes

            memory = dict(model_state_bytes(pl_module, trainer.optimizers))
        memory["peak_rss"] = _peak_rss_bytes()
        per_rank = _gather_per_rank(trainer, memory)
        self.summary = {
            "steps": steps,
            "world_size": trainer.world_size,
            "losses": [float(x) for x in losses],
            "step_time_s": seconds / timed_steps if timed_steps > 0 else float("nan"),
            "samples_per_s": samples_per_s,
            "tokens_per_s": samples_per_s * tokens if tokens else None,
            "comm_per_step": comm,
            "memory_bytes": memory,  # this rank's (rank 0's in the result files)
            "memory_bytes_per_rank": per_rank,  # every rank's, in rank order
        }
        pipeline = getattr(trainer.strategy, "pipeline", None)
        if pipeline is not None:
            self.summary["pipeline"] = self._pipeline_summary(trainer, pipeline)

    def _pipeline_summary(self, trainer: L.Trainer, pipeline: Any) -> dict[str, Any]:
        """The measured bubble (mean over the ranks of each rank's median over the timed steps) beside the
        schedule's theory, the partition, and this rank's timeline of the last step."""
        timed = self.bubbles[self.warmup_steps :] or self.bubbles
        mine = torch.tensor(float(torch.tensor(timed).median()) if timed else float("nan"), dtype=torch.float64)
        measured = trainer.strategy.reduce(mine, reduce_op="mean") if trainer.world_size > 1 else mine
        last = pipeline.last_step
        return {
            "bubble_ideal": pipeline.ideal_bubble,
            "bubble_measured": float(measured),
            "partition": pipeline.layout.describe().splitlines(),
            "timeline": [vars(e) for e in last.timeline] if last is not None else [],
        }


def _peak_rss_bytes() -> int:
    """This process's peak resident memory (what the OS saw: Python, torch, buffers and all)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _gather_per_rank(trainer: L.Trainer, values: dict[str, float]) -> list[dict[str, float]]:
    """``values`` of every rank (the same keys on each), gathered in rank order."""
    keys = sorted(values)
    mine = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=trainer.strategy.root_device)
    rows = trainer.strategy.all_gather(mine) if trainer.world_size > 1 else mine.unsqueeze(0)
    return [{k: int(v) for k, v in zip(keys, row.tolist())} for row in rows.reshape(trainer.world_size, len(keys))]
