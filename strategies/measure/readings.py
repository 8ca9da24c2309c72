"""What the monitor reads off a Trainer at a step: model FLOP/s and MFU against the device's peak, this rank's
memory by category, the process's peak RSS, and the step's figures to wandb (`measure.monitor` calls these)."""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch

from strategies.measure.memory import LogitsMeter
from strategies.tensors import storage_id

# Dense peaks Lightning's table (lightning.fabric.utilities.throughput) lacks or mistakes (FLOP/s, by dtype).
_PEAKS = {"h200": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
          "b200": {torch.bfloat16: 2250e12, torch.float16: 2250e12, torch.float32: 80e12},
          "l40s": {torch.bfloat16: 362e12, torch.float16: 362e12, torch.float32: 91.6e12}}


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """The device's dense peak FLOP/s for ``dtype`` and where the figure comes from (None on CPU)."""
    if device.type != "cuda":
        return None, "no peak known for CPUs"
    name = torch.cuda.get_device_name(device)
    for key, peaks in _PEAKS.items():
        if key in name.lower().replace(" ", ""):
            return peaks.get(dtype), f"{name} (the pack's table)"
    from lightning.fabric.utilities.throughput import get_available_flops

    return get_available_flops(device, dtype), f"{name} (Lightning's table)"


def flops(trainer: L.Trainer, pl_module: L.LightningModule, tokens_per_s: float | None) -> dict[str, Any]:
    """Model FLOP/s per device (6N + 12·L·h·s per token, the module's ``flops_per_token``) and MFU: model
    FLOPs, not hardware FLOPs, so recomputation under ``ac`` does not count as useful work."""
    per_token = getattr(pl_module, "flops_per_token", None)
    if tokens_per_s is None or not callable(per_token):
        return {"flops_per_s": None, "mfu": None}
    flops = per_token() * tokens_per_s / trainer.world_size
    dtype = torch.bfloat16 if "bf16" in str(trainer.precision) else (
        torch.float16 if "16" in str(trainer.precision) else torch.float32)
    peak, source = device_peak_flops(trainer.strategy.root_device, dtype)
    return {"flops_per_s": flops, "mfu": flops / peak if peak else None, "peak_flops": peak, "peak_source": source}


def rank_memory(trainer: L.Trainer, pl_module: L.LightningModule, current: bool = False,
            logits: LogitsMeter | None = None, own: tuple[int, int] | None = None) -> dict[str, float]:
    """This rank's bytes by category: model states, activations saved for backward (this step's when
    ``current``, else the run's peak), the logits (the largest the output layer made, when the model has one),
    the process's peak RSS, and on CUDA the allocator's peaks."""
    strategy = trainer.strategy
    if hasattr(strategy, "model_state_bytes"):
        memory: dict[str, float] = dict(strategy.model_state_bytes())
        memory["activations_peak"] = strategy.activation_bytes if current else strategy.peak_activation_bytes
    else:  # another strategy (one process, Lightning's ddp): what the module and its optimizers hold
        from strategies.measure.memory import model_state_bytes

        memory = dict(model_state_bytes(pl_module, trainer.optimizers))
        if own is not None and own[1]:  # the monitor's own meter (`on_train_batch_start`): (this step, peak)
            memory["activations_peak"] = own[0] if current else own[1]
    if logits is not None:
        memory["logits"] = logits.bytes
    memory["peak_rss"] = peak_rss_bytes()
    device = strategy.root_device
    if device.type == "cuda":
        memory["max_allocated"] = torch.cuda.max_memory_allocated(device)
        memory["max_reserved"] = torch.cuda.max_memory_reserved(device)
    return memory


def wandb_run_dir(trainer: L.Trainer) -> str | None:
    """The folder of the Trainer's wandb run (``.../wandb/offline-run-...``), on the rank that logs; else None."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger) and trainer.global_rank == 0:
            files = getattr(logger.experiment, "dir", None)  # the run's files/ folder; its parent is the run's
            return os.path.dirname(os.path.abspath(files)) if isinstance(files, str) and files else None
    return None


def to_wandb(trainer: L.Trainer, record: dict[str, Any]) -> None:
    """The step's record, flattened, to every WandbLogger of the Trainer (rank 0)."""
    from lightning.pytorch.loggers import WandbLogger

    loggers = [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]
    if not loggers:
        return
    flat: dict[str, float] = {}
    for key in ("loss", "lr", "step_time_s", "samples_per_s", "tokens_per_s", "flops_per_s", "mfu", "bubble"):
        if isinstance(record.get(key), (int, float)):
            flat["pipeline/bubble" if key == "bubble" else key] = float(record[key])
    flat.update({f"memory/{k}": float(v) for k, v in record["memory"].items()})
    flat.update({f"time/{k}": float(v) for k, v in record.get("split", {}).items()})
    if record.get("checkpoint"):
        flat["checkpoint/stall_s"] = float(record["checkpoint"]["stall_s"])
    for key, rec in record["comm"].items():
        flat[f"comm/{key}/bytes_sent"] = float(rec["bytes_sent"])
        flat[f"comm/{key}/wait_s"] = float(rec["wait_s"])
    for logger in loggers:
        logger.log_metrics(flat, step=record["step"])


def current_rss_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm; elsewhere 0, so growth reads as the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def count_cpu_bytes(module: torch.nn.Module) -> int:
    """Bytes of the CPU storage ``module``'s parameters and buffers hold, each storage once."""
    seen: dict[int, int] = {}
    for t in (*module.parameters(), *module.buffers()):
        if t.device.type == "cpu":
            seen[storage_id(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def peak_rss_bytes() -> int:
    """This process's peak resident memory (what the OS saw: Python, torch, buffers and all)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
