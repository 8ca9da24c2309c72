"""`run_ranks`: run a function on several gloo ranks on the CPU and collect what each returns.

For tests and benchmarks, the pack's and a user's own: a file-store rendezvous (no ports to collide on), a short
process-group timeout and a wall-clock limit, so a broken collective fails the test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks start from a fork server that has imported torch, Lightning and the pack once (~5 s a process),
# instead of a fresh interpreter per rank: a test that runs ranks many times pays the imports once. The
# server itself runs no torch code, so forking it is safe (no threads, no intra-op pool yet).
_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "strategies.lightning.named"]


_UNFORMED = "run_ranks: the process group did not form"


def _entry(rank: int, fn: Callable, world_size: int, store_path: str, out_dir: str, timeout_s: float, args: tuple):
    torch.set_num_threads(1)  # N ranks on a small CPU: one thread each, or they fight over cores
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except RuntimeError as err:
        raise RuntimeError(f"{_UNFORMED}: {err}") from err
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
              pg_timeout_s: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo processes; return their results.

    ``fn`` must be importable by name (defined at module level). Results travel through ``torch.save``,
    so tensors, numbers, lists and dicts of them come back. Raises if a rank fails or time runs out.
    ``pg_timeout_s``: the process group's collective timeout (default half of ``timeout_s``).
    A launch whose ranks could not connect their gloo mesh (``connectFullMesh``: a peer's connection closed while the
    group formed, before ``fn`` ran anywhere) is made again once, with a store of its own: seen once in CI's ~1,500
    tests on this 2-core host, beside the suite's second lane.
    """
    try:
        return _launch(fn, world_size, args, timeout_s, pg_timeout_s)
    except mp.ProcessRaisedException as err:
        if _UNFORMED not in str(err) or "connectFullMesh" not in str(err):
            raise
        return _launch(fn, world_size, args, timeout_s, pg_timeout_s)


def _launch(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float,
            pg_timeout_s: float | None) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="run_ranks_") as tmp:
        store = os.path.join(tmp, "store")
        multiprocessing.set_forkserver_preload(_PRELOAD)
        ctx = mp.start_processes(
            _entry, args=(fn, world_size, store, tmp, pg_timeout_s or timeout_s / 2, args), nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise TimeoutError(f"run_ranks: {fn.__name__} on {world_size} ranks ran past {timeout_s}s")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
