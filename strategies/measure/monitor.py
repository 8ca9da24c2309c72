"""StrategyMonitor: what a run cost, measured per optimizer step on every rank, into the run store and wandb.

Each rank appends one record per optimizer step to its own file of the run store (`strategies.runs`): step time,
its loss, learning rate, throughput, memory by category (the tensors it really holds, the activations
autograd saved, the process's peak RSS, and on CUDA the allocator's peaks), the bytes and waiting time of
every collective during the step (comm.py's counters), where the step's time went (``split``: compute by phase and
the pipeline's bubble, `measure.split`), and under pipeline parallel its idle fraction. At
the end rank 0 writes the run's summary (global mean losses, per-rank memory, the pipeline timeline); a
run that crashed has no summary and reads as incomplete, with every step logged before the crash.

Long runs stay bounded (`keep_record`): every step is recorded up to ``full_steps`` (1,000), then every 2nd
step up to 2,000, every 4th up to 4,000, and so on, so a run of a million steps writes about 6,000 records per
rank, and what the monitor holds in memory grows the same way. A record that stands for several steps says so
(``steps``) and its collective counts are per step, averaged over them. The pipeline timeline is the last
step's only.

Rank 0 also logs the same figures to any WandbLogger of the Trainer (keys ``loss``, ``memory/params``,
``comm/all_reduce/dp/bytes_sent``, ``pipeline/bubble``...).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from strategies import comm, runs
from strategies.measure import readings
from strategies.measure.memory import LogitsMeter
from strategies.measure.split import StepSplit
from strategies.pipeline import schedules
from strategies.runs.restarts import note_sigterm, restart_entry, stop_noting
from strategies.tensor_parallel.families import vocab_layers


class StrategyMonitor(L.Callback):
    """Per-step records on every rank; tokens/s after ``warmup_steps``; a summary at the end.

    Args:
        warmup_steps: steps left out of the throughput figures.
        tokens_per_sample: tokens in one sample (default: the module's ``tokens_per_sample``).
        runs_dir: the run store (default ``$STRATPACK_RUNS`` or ``./runs``); ``store=False`` writes nothing.
        run_id, comparison, label: the run's folder name (default: made up), the id shared by the runs of
            one comparison, and the name shown for it (default: the strategy).
        meta: more fields for the run's meta.json (model config, seed...).
        full_steps: steps recorded one by one before the records thin out (`keep_record`).
        heap: also sample this process's C heap through the run (`measure.memory.HeapSampler`, CPU). The summary's
            ``memory_bytes`` get ``heap_peak``: the most the heap held in the steps after the first, above what it
            held after the first less the model states it held then (counted from the tensors): what the states,
            activations and a step's temporaries take at most, as the estimator predicts it (needs 2 steps or more);
            ``heap_first_step``: the first step's peak above what the heap held before the model was built (it
            includes set-up work done inside that step, e.g. the pipeline's cut); ``heap_setup``: what the set-up
            left in the heap beyond the model's states before training (process groups, Lightning's objects: not
            modelled). A sampling thread slows the run: off by default. Or a sampler of one's own with
            `HeapSampler`'s interface: a rehearsal's `meta_heap.MetaHeap`, read by the same rules.
        continue_run: a fit resumed from a checkpoint this monitor saved goes on in the same run of the store, the
            restart recorded (`runs.restarts`); False: each fit is a run of its own.
    """

    def __init__(self, warmup_steps: int = 3, tokens_per_sample: int | None = None, *,
                 runs_dir: str | os.PathLike | None = None, store: bool = True, run_id: str | None = None,
                 comparison: str | None = None, label: str | None = None, meta: dict | None = None,
                 full_steps: int = 1000, heap: Any = False, continue_run: bool = True) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if full_steps < 1:
            raise ValueError(f"full_steps must be >= 1, got {full_steps}")
        self.warmup_steps, self.full_steps = warmup_steps, full_steps
        self.tokens_per_sample = tokens_per_sample
        self.runs_dir, self.store, self.run_id = runs_dir, store, run_id
        self._given_run_id = run_id  # otherwise each fit is a new run, with an id of its own
        self.comparison, self.label, self.extra_meta = comparison, label, dict(meta or {})
        self.writer: runs.RunWriter | None = None
        self.steps = 0  # optimizer steps so far
        self._t_last = self._t_warm = 0.0  # perf_counter at the last step's end, and at the warm-up's end
        self.local_losses: list[float] = []  # this rank's loss at each recorded step (`keep_record`)
        self._since_record = 0  # steps since the last record
        self._unrecorded: tuple | None = None  # the last step, while no record holds it
        self.samples_per_step = 0
        self._pending_loss = 0.0
        self._head_name: str | None = None  # the model's output layer (`vocab_layers`), found before any split
        self._logits: LogitsMeter | None = None  # on that layer, from the start of training
        self._last_comm: dict[str, dict[str, float]] = {}
        self._tokens: dict[str, list[int]] = {}  # expert parallel: tokens per expert by layer, over the run
        self._routed: list[tuple[int, float]] = []  # ... and (step, routed bytes per step) of each record
        self.bubbles: list[float] = []  # pipeline: this rank's measured idle fraction, per step
        self.summary: dict[str, Any] = {}
        self.heap, self.continue_run = heap, continue_run
        self._resumed: dict[str, Any] | None = None  # the monitor's state in the checkpoint a fit resumed from
        self.attempt, self._redo_until = 1, 0  # this attempt of the run; the last step an earlier one recorded
        self._sigterm: Any = None  # where a SIGTERM leaves its mark (`runs.restarts.note_sigterm`)
        self._stalls_seen = 0  # the strategy's save stalls already in a record
        self._heap: Any = None  # the running HeapSampler, and what the heap held before the model (`setup`)
        self._heap_base = self._heap_floor = self._heap_setup = self._heap_first = 0
        self._rss_base = self._setup_peak = 0  # resident memory before the model was built; the set-up's peak
        self._heap_built = 0  # the heap's peak before training started (the build and the techniques' set-up)
        self._act_meter, self._act = None, (0, 0)
        self._split = StepSplit(lambda: (0.0, 0.0))

    # -- start --------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Before the strategy splits the model (tp slices, pipeline placeholders): the model's own size.
        # (A model built in configure_model has none yet: the strategy counts it before its split, `on_train_start`.)
        self._num_params = sum(p.numel() for p in pl_module.parameters())
        found = vocab_layers(pl_module)  # by name: a tensor-parallel split replaces the layer, under the same name
        self._head_name = found[0] if found is not None else None
        if self.heap and self._heap is None:
            self._heap_base, self._heap = start_heap_sampler(pl_module, None if self.heap is True else self.heap)
        # Set-up memory, from here (before configure_model builds a model) to the end of the first step: resident
        # memory above what the process held, less a model already built (CPU tensors, as the heap's base).
        self._rss_base = readings.current_rss_bytes() - readings.count_cpu_bytes(pl_module)
        self._setup_peak = 0

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._num_params:  # built in configure_model: counted by the strategy before its split
            self._num_params = getattr(trainer.strategy, "built_num_params", 0)
            found = vocab_layers(pl_module)
            self._head_name = found[0] if found is not None else None
        stats = getattr(trainer.strategy, "comm_stats", None)
        if stats is not None:
            stats.reset()  # leave out the set-up broadcast: count training steps only
        self._t_last = self._t_warm = time.perf_counter()
        self.steps, self._since_record, self._unrecorded = 0, 0, None
        self._stalls_seen = len(_save_stalls(trainer.strategy))
        self.local_losses, self.bubbles, self._pending_loss, self._last_comm = [], [], 0.0, {}
        self._tokens, self._routed = {}, []
        self._logits = LogitsMeter(pl_module.get_submodule(self._head_name)) if self._head_name else None
        self._act_meter, self._act = None, (0, 0)  # activations of Lightning's own strategies: (this step, peak)
        self._split = StepSplit(_blocked_seconds(stats))
        if self._heap is not None:
            held = self._states_in_heap(readings.rank_memory(trainer, pl_module))
            self._heap_built, now = self._heap.restart()  # the peak of the set-up so far: the build, the splits
            self._heap_setup = now - self._heap_base - held
        if self.store:
            self._open_run(trainer, pl_module)

    def _open_run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """This rank's writer: a new run, or, resumed from a checkpoint of a run in the store, that run going on
        (`runs.restarts`): rank 0 decides, and records the restart."""
        label = self.label or _strategy_label(trainer)
        run_id, restart = None, None
        if trainer.global_rank == 0:
            restart = self._restart(trainer)
            run_id = restart[0] if restart else self._given_run_id or runs.new_run_id(label)
        if trainer.world_size > 1:
            run_id, restart = trainer.strategy.broadcast((run_id, restart), src=0)
        self.run_id, entry = run_id, restart[1] if restart else None
        self.attempt = entry["attempt"] if entry else 1
        lasts = entry["last_steps"] if entry else []  # how far each rank got before: its redone steps
        self._redo_until = lasts[trainer.global_rank] if trainer.global_rank < len(lasts) else 0
        self.writer = runs.RunWriter(self.runs_dir, self.run_id, trainer.global_rank)
        self._sigterm = note_sigterm(self.writer.path, trainer.global_rank, self.attempt)
        if trainer.global_rank == 0 and entry:
            self.writer.add_restart(entry)
            print(f"[stratpack] run {self.run_id} goes on: attempt {entry['attempt']} from step "
                  f"{entry['resumed_step']}; the last stopped because {entry['cause']}", file=sys.stderr, flush=True)
        elif trainer.global_rank == 0:
            self.writer.write_meta(self._meta(trainer, pl_module, label))

    def _restart(self, trainer: L.Trainer) -> tuple[str, dict[str, Any]] | None:
        """Rank 0: (the run, its restart entry) where this fit resumed from a checkpoint of a run in the store, under
        its plan and world size (and the caller named no other run); else None, and the new run's meta names the run
        it resumed from."""
        resumed, self._resumed = self._resumed, None
        run_id = (resumed or {}).get("run_id")
        if not run_id or self._given_run_id not in (None, run_id) or not self.continue_run:
            return None
        self.extra_meta.setdefault("resumed_from", run_id)  # (where it is a run of its own)
        path = runs.runs_dir(self.runs_dir) / run_id
        try:
            run = runs.read_run(path)
        except (runs.RunError, OSError):
            return None  # not in this store (moved, another machine's): a new run
        plan = getattr(trainer.strategy, "resolved_plan", None)
        now = (str(plan) if plan is not None else None, trainer.world_size)
        if (run["meta"].get("plan"), run["meta"].get("world_size")) != now:
            return None  # resumed under another plan or world size (resharded): a run of its own
        return run_id, restart_entry(run, trainer.global_step, checkpoint=str(trainer.ckpt_path or "") or None)

    @override
    def state_dict(self) -> dict[str, Any]:
        # A checkpoint names its run: a fit resumed from it goes on in the same run of the store (`_restart`).
        return {"run_id": self.run_id} if self.store and self.run_id else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = dict(state_dict)

    # -- each step ----------------------------------------------------------------------------------------

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._split.enter("forward")
        # The pack's strategies count what autograd saves in their training_step; for Lightning's own (one
        # process, ddp) the same meter runs around the whole batch, so both sides report activations alike.
        if not hasattr(trainer.strategy, "model_state_bytes") and self._act_meter is None:
            from strategies.measure.memory import SavedTensorsMeter

            self._act_meter = SavedTensorsMeter(pl_module).__enter__()

    @override
    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._split.enter("backward")

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._split.enter("optimizer")

    def _stop_meter(self) -> None:
        if self._act_meter is not None:
            self._act_meter.__exit__(None, None, None)
            self._act = (self._act_meter.bytes, max(self._act[1], self._act_meter.bytes))
            self._act_meter = None

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._stop_meter()
        self._split.enter(None)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        pipeline = getattr(trainer.strategy, "pipeline", None)
        bubble = pipeline.last_step.bubble if pipeline is not None and pipeline.last_step is not None else None
        if bubble is not None:
            self._split.add_pipeline(pipeline.last_step.timeline)
        stepped = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        # Read the memory before the loss: reading the loss waits for the device to finish the step, and on a GPU
        # whatever the host does after that (this reading: ~2-9 ms of Python at 1B parameters) leaves it idle.
        memory = self._memory(trainer, pl_module) if stepped and keep_record(self.steps + 1, self.full_steps) else None
        self._pending_loss += float(loss.detach())  # Lightning already divided it by accumulate_grad_batches
        if not stepped:
            return
        now = time.perf_counter()
        step_time, self._t_last = now - self._t_last, now
        self.steps += 1
        if self.steps == 1:
            self._setup_peak = self._first_step_peak(trainer)
        if self._heap is not None:
            self._heap_steady(trainer, pl_module)
        if self.steps == self.warmup_steps:
            self._t_warm = now
        self._since_record += 1
        step_loss, self._pending_loss = self._pending_loss, 0.0
        self._unrecorded = (step_loss, bubble, step_time, batch)
        if keep_record(self.steps, self.full_steps):
            self._write_record(trainer, pl_module, memory)

    def _first_step_peak(self, trainer: L.Trainer) -> int:
        """The most this rank held from set-up to the end of the first step: the allocator's peak on a GPU, else the
        heap's (with ``heap``) or the resident memory's growth."""
        device = trainer.strategy.root_device
        if self._heap is not None:  # (on a GPU too: `memory.CudaHeap` restarts the allocator's peak at the start)
            return int(max(self._heap_built, self._heap.peak) - self._heap_base)
        if device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(device))
        return max(0, readings.peak_rss_bytes() - self._rss_base)

    def _heap_steady(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After the first optimizer step: its peak holds set-up work (a pipeline is cut inside it, after forwards of
        the whole model on every rank), and the optimizer's state exists from here on. The steady peak is measured
        from here, above the floor: the least the heap held at the end of a step less the model states it held then
        (counted from the tensors). The least over the steps, since a step can end with a buffer still held (a
        message in flight, a thread's cache): read once, such a buffer made one rank's peak 0.42 MiB (2%) low."""
        if self.steps == 1:
            self._heap_first, now = self._heap.restart()
            self._heap_floor = now - self._states_in_heap(readings.rank_memory(trainer, pl_module))
        else:
            now = self._heap.in_use()
            states = self._states_in_heap(readings.rank_memory(trainer, pl_module))
            self._heap_floor = min(self._heap_floor, now - states)

    def _states_in_heap(self, memory: dict[str, float], heap: Any = None) -> float:
        """The model states the heap holds: all of them, but a device's heap (``device_only``: a GPU's allocator, a GPU
        rehearsed) holds none of offload's host copies."""
        device_only = getattr(heap or self._heap, "device_only", False)
        return memory["total"] - (memory.get("host", 0) if device_only else 0)

    def _heap_figures(self, memory: dict[str, int]) -> dict[str, int]:
        """Stop the sampler: the steady peak (one step: none) and what of it is neither ``memory``'s states nor its
        saved activations (the estimator's temporaries), the first step's and the set-up's (see ``heap``)."""
        heap, self._heap = self._heap, None
        heap.__exit__(None, None, None)
        out = {"heap_peak": heap.peak - self._heap_floor} if self.steps > 1 else {}
        if out:
            states = self._states_in_heap(memory, heap)
            out["temporaries"] = max(0, out["heap_peak"] - states - memory.get("activations_peak", 0))
        first = self._heap_first if self.steps > 1 else heap.peak
        return {**out, "heap_first_step": first - self._heap_base, "heap_setup": self._heap_setup}

    def _memory(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """This rank's memory by category as a step ends (`readings.rank_memory`)."""
        return readings.rank_memory(trainer, pl_module, current=True, logits=self._logits, own=self._act)

    def _write_record(self, trainer: L.Trainer, pl_module: L.LightningModule,
                      memory: dict[str, float] | None = None) -> None:
        """The record of the last step (`keep_record` chose it, or it is the run's last); ``memory``: read as it
        ended (else now)."""
        (step_loss, bubble, step_time, batch), self._unrecorded = self._unrecorded, None
        self.local_losses.append(step_loss)
        if bubble is not None:
            self.bubbles.append((self.steps, bubble))
        if not self.samples_per_step:
            x = batch[0] if isinstance(batch, (list, tuple)) else batch
            replicas = trainer.strategy.distributed_sampler_kwargs["num_replicas"] if trainer.world_size > 1 else 1
            self.samples_per_step = len(x) * replicas * trainer.accumulate_grad_batches
        record = self._record(trainer, pl_module, bubble, step_time, memory or self._memory(trainer, pl_module))
        if self.writer is not None:
            self.writer.append(record)
        if trainer.global_rank == 0:
            readings.to_wandb(trainer, record)

    def _record(self, trainer: L.Trainer, pl_module: L.LightningModule, bubble: float | None,
                step_time: float, memory: dict[str, float]) -> dict[str, Any]:
        covered, self._since_record = self._since_record, 0
        samples_per_s = self.samples_per_step / step_time if step_time > 0 else None
        tokens = self.tokens_per_sample or getattr(pl_module, "tokens_per_sample", None)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        tokens_per_s = samples_per_s * tokens if samples_per_s and tokens else None
        return {
            "step": trainer.global_step, "time": time.time(), "step_time_s": step_time,
            "loss": self.local_losses[-1], "lr": optimizer.param_groups[0].get("lr") if optimizer else None,
            "samples_per_s": samples_per_s, "tokens_per_s": tokens_per_s,
            **readings.flops(trainer, pl_module, tokens_per_s),
            "memory": memory,
            "comm": self._comm_delta(trainer, covered),
            "bubble": bubble, "steps": covered,
            "split": self._split.take(covered),  # seconds per step by phase (`measure.split`)
            **self._attempt_fields(trainer.global_step), **self._saves(trainer), **self._routing(trainer, covered),
        }

    def _routing(self, trainer: L.Trainer, steps: int) -> dict[str, Any]:
        """Under expert parallel, since the last record: each MoE layer's tokens per expert (this rank's choices,
        summed over the record's steps) and, per step, what the all-to-alls send for that routing
        (`expert_parallel.cost`), beside the ``all_to_all/ep`` bytes measured. Totals kept for the summary."""
        experts = [t for t in getattr(trainer.strategy, "techniques", []) if hasattr(t, "take_routing")]
        if not experts:
            return {}
        routing = experts[0].take_routing()
        for layer, counts in routing["tokens"].items():
            total = self._tokens.setdefault(layer, [0] * len(counts))
            self._tokens[layer] = [a + b for a, b in zip(total, counts)]
        self._routed.append((steps, routing["routed_bytes"]))
        return {"experts": {"tokens": routing["tokens"], "routed_bytes": routing["routed_bytes"] / max(steps, 1)}}

    def _saves(self, trainer: L.Trainer) -> dict[str, Any]:
        """The checkpoint saves since the last record (the pack's strategies time them: `async_save.SaveStalls`):
        how long training waited on them. Lightning saves after this callback's batch end, so a save shows in the
        record of the step whose time holds it: the next one."""
        stalls = _save_stalls(trainer.strategy)
        new, self._stalls_seen = stalls[self._stalls_seen:], len(stalls)
        return {"checkpoint": {"saves": len(new), "stall_s": sum(new)}} if new else {}

    def _attempt_fields(self, step: int) -> dict[str, Any]:
        """After a restart: the attempt, and whether the step was recorded by an earlier one (`runs.restarts`)."""
        if self.attempt == 1:
            return {}
        return {"attempt": self.attempt, **({"redone": True} if step <= self._redo_until else {})}

    def _comm_delta(self, trainer: L.Trainer, steps: int) -> dict[str, dict[str, float]]:
        """Per step, over the ``steps`` since the last record."""
        stats = getattr(trainer.strategy, "comm_stats", None)
        if stats is None:
            return {}
        now = stats.snapshot()
        delta = {key: {k: (v - self._last_comm.get(key, {}).get(k, 0)) / steps for k, v in rec.items()}
                 for key, rec in now.items()}
        self._last_comm = now
        return {key: rec for key, rec in delta.items() if rec["calls"] or rec["bytes_sent"] or rec["wait_s"]}

    # -- end ----------------------------------------------------------------------------------------------

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._unrecorded is not None:  # a thinned-out run still ends on a record of its last step
            self._write_record(trainer, pl_module)
        stats = getattr(trainer.strategy, "comm_stats", None)
        snapshot = stats.snapshot() if stats is not None else {}  # before the loss reduce below adds to it
        losses = torch.tensor(self.local_losses, dtype=torch.float64)
        losses = trainer.strategy.reduce(losses, reduce_op="mean") if trainer.world_size > 1 else losses
        steps = self.steps
        timed_steps = steps - self.warmup_steps
        seconds = self._t_last - self._t_warm if timed_steps > 0 else float("nan")
        samples_per_s = timed_steps * self.samples_per_step / seconds if timed_steps > 0 else float("nan")
        tokens = self.tokens_per_sample or getattr(pl_module, "tokens_per_sample", None)
        per_step = {key: {k: v / steps for k, v in rec.items()} for key, rec in snapshot.items()} if steps else {}
        memory = readings.rank_memory(trainer, pl_module, logits=self._logits, own=self._act)
        memory["setup_peak"] = self._setup_peak if self.steps else self._first_step_peak(trainer)
        if self._heap is not None:
            memory.update(self._heap_figures(memory))
        if self._logits is not None:
            self._logits.remove()
        self.summary = {
            "steps": steps,  # this attempt's (a run that went on after a restart: `runs.restarts`)
            "attempt": self.attempt,
            "world_size": trainer.world_size,
            "losses": [float(x) for x in losses],  # the recorded steps' (`keep_record`), as the records
            "step_time_s": seconds / timed_steps if timed_steps > 0 else float("nan"),
            "samples_per_s": samples_per_s,
            "tokens_per_s": samples_per_s * tokens if tokens else None,
            **readings.flops(trainer, pl_module, samples_per_s * tokens if tokens else None),
            "comm_per_step": per_step,
            "memory_bytes": memory,  # this rank's (rank 0's in the result files)
            "memory_bytes_per_rank": _gather_per_rank(trainer, memory),  # every rank's, in rank order
        }
        self._summary_parts(trainer)
        self._finish_store(trainer)

    def _summary_parts(self, trainer: L.Trainer) -> None:
        """What only some runs have: their checkpoints' stalls, the pipeline's timeline, the experts' routing."""
        saves = checkpoint_summary(trainer.strategy)
        if saves:
            self.summary["checkpoint"] = saves
        pipeline = getattr(trainer.strategy, "pipeline", None)
        if pipeline is not None:
            self.summary["pipeline"] = self._pipeline_summary(trainer, pipeline)
        if self._tokens:
            self.summary["experts"] = routing_summary(self._tokens, self._routed)

    def _finish_store(self, trainer: L.Trainer) -> None:
        stop_noting(self._sigterm)
        self._sigterm = None
        if self.writer is not None:
            self.writer.finish(self.summary if trainer.global_rank == 0 else None)
            self.summary["run_dir"] = str(self.writer.path)
            self.writer = None

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # Every step so far is already on disk (flushed per step); without a summary the run reads incomplete. The
        # last line says why this rank stopped and what it was doing (the flight recorder's last calls).
        self._stop_meter()
        if self.writer is not None:
            from strategies.comm.recorder import RECORDER

            self.writer.append({"error": f"{type(exception).__name__}: {exception}"[-4000:],
                                "last_calls": [f"{c.describe()} ({c.state})" for c in RECORDER.calls],
                                "time": time.time(), "step": trainer.global_step,
                                **({"attempt": self.attempt} if self.attempt > 1 else {})})
            self.writer.finish(None)
            self.writer = None

    def _meta(self, trainer: L.Trainer, pl_module: L.LightningModule, label: str) -> dict[str, Any]:
        import platform

        device = trainer.strategy.root_device
        config = getattr(pl_module, "config", None)
        meta = runs.run_meta(
            run_id=self.run_id, label=label, comparison=self.comparison, world_size=trainer.world_size,
            devices=[torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"],
            plan=getattr(trainer.strategy, "resolved_plan", None),
            model=vars(config) if config is not None and hasattr(config, "__dict__") else None,
            num_params=sum(p.numel() for p in pl_module.parameters()),
            accumulate=trainer.accumulate_grad_batches, precision=str(trainer.precision),
            param_dtype=str(getattr(getattr(trainer.strategy, "options", None), "param_dtype", None) or "") or None)
        meta["wandb_run"] = readings.wandb_run_dir(trainer)  # where `wandb sync` finds it (None: not logged)
        meta.update(self.extra_meta)  # the caller's fields win, but for the count made before the split and the id
        if hasattr(self, "_num_params"):  # counted in `setup`, before the strategy split the model
            meta["num_params"] = self._num_params
        return {**meta, "run_id": self.run_id}

    def _pipeline_summary(self, trainer: L.Trainer, pipeline: Any) -> dict[str, Any]:
        """The measured bubble (mean over the ranks of each rank's median over the timed steps) beside the
        schedule's theory, the partition, and this rank's timeline of the last step."""
        timed = [b for step, b in self.bubbles if step > self.warmup_steps] or [b for _, b in self.bubbles]
        mine = torch.tensor(float(torch.tensor(timed).median()) if timed else float("nan"), dtype=torch.float64)
        measured = trainer.strategy.reduce(mine, reduce_op="mean") if trainer.world_size > 1 else mine
        last = pipeline.last_step
        mine_timeline = [vars(e) for e in last.timeline] if last is not None else []
        mesh = getattr(trainer.strategy, "mesh", None)
        every = comm.all_gather_object(mine_timeline, mesh.world) if mesh is not None else [mine_timeline]
        plan = trainer.strategy.resolved_plan
        table = schedules.build(plan.schedule.value, plan.pp, plan.microbatches, plan.virtual, plan.group)
        return {
            "schedule": plan.schedule.value,
            "schedule_choice": getattr(trainer.strategy, "schedule_choice", None),  # why, where the plan named none
            "bubble_ideal": pipeline.ideal_bubble,
            "bubble_measured": float(measured),
            "partition": pipeline.layout.describe().splitlines(),
            "timeline": mine_timeline,  # this rank's last step
            "timelines": {str(rank): events for rank, events in enumerate(every)},  # every rank's
            # The schedule's table run on stages of equal cost (F 1, B 2 or, split from its W, 1, W 1) and free
            # communication: what the measured timelines would be (pp rank -> [action, start, end]).
            "ideal": {str(r): [[str(a), start, end] for a, start, end in actions] for r, actions in
                      enumerate(schedules.timeline(table))},
        }


def keep_record(step: int, full_steps: int = 1000) -> bool:
    """Whether step ``step`` (1-based) gets a record: every step up to ``full_steps``, then every 2nd up to twice
    that, every 4th up to four times that, ...: about ``full_steps / 2`` more records per doubling of the run."""
    if step <= full_steps:
        return True
    stride = 1 << (((step - 1) // full_steps).bit_length())
    return step % stride == 0


def _save_stalls(strategy: Any) -> list[float]:
    """How long training waited on each save so far (the pack's strategies: `async_save.SaveStalls`; else none)."""
    return getattr(getattr(strategy, "save_stalls", None), "stalls", [])


def checkpoint_summary(strategy: Any) -> dict[str, Any] | None:
    """This rank's saves of the fit: how many, how long training waited on each (mean, most), asynchronous or not,
    and the background writes' mean time (asynchronous)."""
    stalls = _save_stalls(strategy)
    if not stalls:
        return None
    saver = getattr(strategy, "_saver", None)
    writes = saver.writes_s if saver is not None else []
    later = stalls[1:]  # (an asynchronous save's first allocates its host copies)
    return {"saves": len(stalls), "async": saver is not None, "stall_s": sum(stalls) / len(stalls),
            "stall_s_max": max(stalls), "stall_s_first": stalls[0],
            "stall_s_later": sum(later) / len(later) if later else None,
            "write_s": sum(writes) / len(writes) if writes else None}


def routing_summary(tokens: dict[str, list[int]], routed: list[tuple[int, float]]) -> dict[str, Any]:
    """This rank's tokens per expert over the run, by layer; their imbalance (the busiest expert's tokens over the
    mean, per layer: 1 is balanced, E the whole layer on one expert); the bytes the routing sent, per step over the
    run (as ``comm_per_step``). ``routed``: (steps, bytes) of each record."""
    steps = sum(n for n, _ in routed)
    imbalance = {layer: max(c) * len(c) / sum(c) for layer, c in tokens.items() if sum(c)}
    return {"tokens": tokens, "imbalance": imbalance, "imbalance_max": max(imbalance.values(), default=None),
            "routed_bytes_per_step": sum(sent for _, sent in routed) / steps if steps else None}


def _strategy_label(trainer: L.Trainer) -> str:
    plan = getattr(trainer.strategy, "resolved_plan", None)
    return str(plan) if plan is not None else type(trainer.strategy).__name__


def start_heap_sampler(module: torch.nn.Module, sampler: Any = None) -> tuple[int, Any]:
    """A running `HeapSampler` (or ``sampler``, started), and what the heap held before ``module`` was built: in use
    now, less the storage of the module's parameters and buffers (tensors of the sampler's device the user's code
    made, each counted once)."""
    from strategies.measure.memory import HeapSampler, count_bytes

    if sampler is None and not HeapSampler.available():
        raise RuntimeError("heap sampling needs glibc's mallinfo2 (Linux): run without --heap")
    device = getattr(sampler, "device", "cpu")
    own = count_bytes({"model": [t for t in (*module.parameters(), *module.buffers()) if t.device.type == device]})
    sampler = (sampler or HeapSampler()).__enter__()
    return sampler.start - own["model"], sampler


def _blocked_seconds(stats: Any):
    """The seconds this process has been blocked in collectives so far, all of them and the pipeline axis's (zero
    without the pack's counters: Lightning's own strategies)."""
    if stats is None:
        return lambda: (0.0, 0.0)
    return lambda: (stats.total().wait_s, stats.total(axis="pp").wait_s)


def _gather_per_rank(trainer: L.Trainer, values: dict[str, float]) -> list[dict[str, float]]:
    """``values`` of every rank (the same keys on each), gathered in rank order."""
    keys = sorted(values)
    mine = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=trainer.strategy.root_device)
    rows = trainer.strategy.all_gather(mine) if trainer.world_size > 1 else mine.unsqueeze(0)
    return [{k: int(v) for k, v in zip(keys, row.tolist())} for row in rows.reshape(trainer.world_size, len(keys))]
