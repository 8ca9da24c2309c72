"""Where a GPU step's time goes, from torch's profiler: a few optimizer steps traced, then read back as the device saw
them.

`ProfileWindow` traces optimizer steps ``first`` to ``first + count - 1`` (counted from 0) of a loop, the hand-written
one or the Trainer's (`ProfileSteps`, a callback), and writes three files to its folder: the trace (Chrome's format,
gzipped, for chrome://tracing or Perfetto), the operators' table (``torch.profiler``'s ``key_averages``, by device
time) and ``split.json``, what `device_split` reads off the trace. Put the window inside the steps a run leaves out
of its timing: the trace's export takes seconds.

`device_split` is the step-time split as the device saw it, per step: the wall time, the time at least one kernel or
copy ran (``busy``; the rest is ``idle``: the device waiting on the host, a launch, a sync), and the busy time by
kind of kernel (matrix products, attention, the optimizer, copies, collectives, compiled kernels, the rest). The
monitor's own split (`measure.split`) times host-side windows, which on a GPU measure launches, not work.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import time
from typing import Any

import lightning as L
import torch

# Kernel names by kind, first match wins (lower case). cuBLAS's Hopper kernels are "nvjet_*" and "sm90_xmma_*";
# CUTLASS's "cutlass_*"; SDPA's flash and memory-efficient kernels "flash_*" / "fmha_*" / "*attention*", cuDNN's
# "cudnn_*sdpa*"; the fused AdamW "*adam*", the foreach ones "multi_tensor_apply_kernel".
KINDS = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "wgmma", "splitk")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "_fused_sgd")),
    ("collective", ("nccl",)),
    ("copy", ("memcpy", "memset", "copy", "cat_", "catarray")),
    ("compiled", ("triton_",)),
)
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(key in low for key in keys):
            return kind
    return "other"


def device_split(trace: dict[str, Any], steps: int, wall_s: float) -> dict[str, Any]:
    """Per step (the window's figures over ``steps``): ``wall_s`` as timed, ``busy_s`` (the union of the device
    events' intervals: two kernels at once count once), ``idle_s``, and ``kinds`` (seconds of device events by
    kind, summed: overlapping streams can make them exceed busy), with the 12 kernels that took the most time."""
    spans, kinds, names = [], {}, {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in DEVICE_CATEGORIES:
            continue
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))  # microseconds
        spans.append((start, start + dur))
        kind = "copy" if e["cat"] != "kernel" else kind_of(e.get("name", ""))
        kinds[kind] = kinds.get(kind, 0.0) + dur
        names[e.get("name", "?")] = names.get(e.get("name", "?"), 0.0) + dur
    busy, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    per = max(steps, 1)
    busy_s = busy / 1e6 / per
    top = sorted(names.items(), key=lambda kv: -kv[1])[:12]
    return {"steps": steps, "wall_s": wall_s / per, "busy_s": busy_s, "idle_s": max(wall_s / per - busy_s, 0.0),
            "busy_fraction": busy_s / (wall_s / per) if wall_s > 0 else None, "events": len(spans),
            "kinds": {k: v / 1e6 / per for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": n[:160], "s": v / 1e6 / per, "kind": kind_of(n)} for n, v in top]}


class ProfileWindow:
    """Trace optimizer steps ``first`` .. ``first + count - 1`` (from 0): call `before(step)` as a step starts and
    `after(step)` when it has ended; the files go to ``folder`` (see the module's docstring)."""

    def __init__(self, folder: str, first: int = 2, count: int = 2) -> None:
        self.folder, self.first, self.count = folder, first, count
        self._prof: Any = None
        self._start = 0.0
        self.split: dict[str, Any] | None = None

    def before(self, step: int) -> None:
        if step != self.first or self._prof is not None:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._prof = profile(activities=activities, record_shapes=False, with_stack=False)
        self._prof.__enter__()
        self._start = time.perf_counter()

    def after(self, step: int) -> None:
        if self._prof is None or step != self.first + self.count - 1:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._start
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.split = write_profile(prof, self.folder, self.count, wall)


def write_profile(prof: Any, folder: str, steps: int, wall_s: float) -> dict[str, Any]:
    """The trace (gzipped), the operators' table and the device split of a finished profile, in ``folder``."""
    os.makedirs(folder, exist_ok=True)
    raw = os.path.join(folder, "trace.json")
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        split = device_split(json.load(f), steps, wall_s)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    try:
        table = prof.key_averages().table(sort_by=by, row_limit=40, max_name_column_width=70)
    except Exception as err:  # noqa: BLE001 - the table is a convenience; the trace and the split are kept
        table = f"(no table: {type(err).__name__}: {err})"
    with open(os.path.join(folder, "ops.txt"), "w") as f:
        f.write(table)
    with open(os.path.join(folder, "split.json"), "w") as f:
        json.dump(split, f, indent=1)
    return split


class ProfileSteps(L.Callback):
    """`ProfileWindow` over a Trainer's optimizer steps (``stratpack train --profile DIR``): each rank's files in
    ``DIR/rank<r>`` where the job has several (one process: in ``DIR``)."""

    def __init__(self, folder: str, first: int = 2, count: int = 2) -> None:
        self.folder = folder
        self.window = ProfileWindow(folder, first, count)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.world_size > 1:  # (the ranks would write, and remove, the same trace.json)
            self.window.folder = os.path.join(self.folder, f"rank{trainer.global_rank}")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:  # the first micro-step of an optimizer step
            self.window.before(trainer.global_step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.window.after(trainer.global_step - 1)  # (the step just taken)
