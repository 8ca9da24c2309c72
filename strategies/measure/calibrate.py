"""What this machine does, measured once: the FLOP/s a rank sustains while every rank computes, and each
collective's latency and bandwidth over the ranks, so that the planner's step times are this machine's, not an
H100's (`stratpack plan --calibrate`).

`measure(world)` runs ``world`` ranks (gloo on CPU; the figures include the cores they share) and times:
- compute: forward and backward of a transformer MLP's two matmuls at the workload's width, on every rank at once;
- communication: all_reduce, all_gather, reduce_scatter over all ranks, and over pairs of ranks (every pair at
  once, as the axes of a plan run), and a send between two, each at a small and a large payload: latency is the
  small one's time, bandwidth the large one's extra bytes over its extra time, in the bytes a rank sends (the
  estimator's convention: ring all_reduce 2(N-1)/N, gathers and scatters (N-1)/N).

The result is cached per host, world size and torch version in ``~/.cache/stratpack/calibration.json``
(``STRATPACK_CALIBRATION`` moves it); `load` returns it, `measure` refreshes it.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

CACHE_ENV = "STRATPACK_CALIBRATION"
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send")
SMALL, LARGE = 1024, 4 * 2**20  # bytes of the payload


@dataclass(frozen=True)
class Calibration:
    world: int
    flops: float  # FLOP/s per rank with every rank computing
    # "kind@ranks" -> (latency s, bytes/s sent): collectives over all ranks and over pairs, send between two
    links: dict[str, tuple[float, float]] = field(default_factory=dict)
    host: str = ""
    torch: str = ""
    when: float = 0.0

    def link(self, kind: str, ranks: int) -> tuple[float, float]:
        """(latency s, bytes/s sent) of ``kind`` over ``ranks`` ranks: the measured group size nearest below;
        a kind not measured (a naive server's sends to each rank) as an all_reduce."""
        sizes = sorted(int(key.split("@")[1]) for key in self.links if key.startswith(kind + "@"))
        if not sizes and kind != "all_reduce":
            return self.link("all_reduce", ranks)
        if not sizes:  # one rank measured no links: nothing to send
            return 0.0, math.inf
        size = max([s for s in sizes if s <= ranks] or sizes[:1])
        return self.links[f"{kind}@{size}"]


def cache_path() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "stratpack",
                                                     "calibration.json")


def _key(world: int) -> str:
    return f"{socket.gethostname()}|cpu|{world}|torch {torch.__version__}"


def load(world: int) -> Calibration | None:
    """This machine's cached calibration at ``world`` ranks, or None."""
    try:
        with open(cache_path()) as f:
            entry = json.load(f).get(_key(world))
    except (OSError, ValueError):
        return None
    if entry is None:
        return None
    return Calibration(**{**entry, "links": {k: tuple(v) for k, v in entry["links"].items()}})


def save(cal: Calibration) -> None:
    write_entry(cache_path(), _key(cal.world), asdict(cal))


def write_entry(path: str, key: str, entry: dict[str, Any]) -> None:
    """Put ``entry`` under ``key`` in the JSON cache at ``path`` (its other entries kept), replaced whole at once so
    that a reader never sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        entries = {}
    entries[key] = entry
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(entries, f, indent=1)
    os.replace(tmp, path)


def measure(world: int, hidden: int = 256, tokens: int = 2048, cache: bool = True) -> Calibration:
    """Measure (a few seconds) and cache this machine's calibration at ``world`` ranks."""
    from strategies.testing import run_ranks

    results = run_ranks(_rank, world, hidden, tokens, timeout_s=300)
    links = {key: _fit(times, int(key.split("@")[1]), key.split("@")[0]) for key, times in results[0].items()
             if "@" in key}
    cal = Calibration(world, min(r["flops"] for r in results), links, socket.gethostname(), torch.__version__,
                      time.time())
    if cache:
        save(cal)
    return cal


# The kernels whose working memory a rehearsal on a CPU counts (`op_workspace`): the matrix library's products and
# the CPU's fused attention, which hold buffers of their own beyond their outputs while they run.
_aten = torch.ops.aten
WORKSPACE_OPS = (_aten.mm.default, _aten.addmm.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
                 _aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


_MEASURED: dict[tuple, float] = {}  # `op_workspace`'s, once per process: the estimator and a rehearsal share them


def op_workspace(func: Any, args: tuple, kwargs: dict | None = None, threads: int | None = None) -> float:
    """Bytes ``func`` holds while it runs beyond its outputs, on tensors like ``args``' (their shapes, strides and
    dtypes: meta ones stand for real), with ``threads`` threads, measured on this host once per process (the largest
    of three 20 ms windows, `_sampled`). MKL packs a product's operands into buffers of its own, by dtype and layout
    (float32 at 2 threads about 9 MiB at the demo's shapes; bfloat16 50-720 KiB, a transposed left operand the most);
    the CPU's fused attention holds blocks of scores (about 4 MiB at 1 thread, either dtype). 0 where the heap cannot
    be read (`memory.HeapSampler` needs glibc), or where the library keeps its buffers (MKL's fast allocator, on
    unless ``MKL_DISABLE_FAST_MM=1``: then they sit in the heap for good, not in the step's peak)."""
    import os

    from torch.utils._pytree import tree_map

    from strategies.measure.memory import HeapSampler

    if not HeapSampler.available():
        return 0.0
    key = (func, repr(tree_map(_layout, (args, kwargs or {}))), threads or torch.get_num_threads(),
           os.environ.get("MKL_DISABLE_FAST_MM"))
    if key not in _MEASURED:
        _MEASURED[key] = _sampled(func, args, kwargs or {}, threads)
    return _MEASURED[key]


def _sampled(func: Any, args: tuple, kwargs: dict, threads: int | None) -> float:
    """`op_workspace` measured: calls one after another for 20 ms, each holding its workspace while it runs, the heap
    sampled beside them, three times. A window can miss it where the sampler gets no core while a call runs (one
    window alone read the fused attention's 4.3 MiB as 0.6 beside CI's other lane: a test 9% short)."""
    from torch.utils._pytree import tree_leaves, tree_map

    from strategies.measure.memory import HeapSampler

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        real_args, real_kwargs = tree_map(_real_like, (args, kwargs))
        out = func(*real_args, **real_kwargs)  # the first call sets the library up (what it keeps is not the step's)
        made = sum(t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        del out
        held, peak = HeapSampler.in_use(), 0
        for _ in range(3):
            with HeapSampler(interval_s=1e-5) as heap:
                deadline = time.perf_counter() + 0.02
                while True:
                    out = func(*real_args, **real_kwargs)
                    del out
                    if time.perf_counter() >= deadline:
                        break
            peak = max(peak, heap.peak)
        return float(max(0, peak - held - made))
    finally:
        torch.set_num_threads(before)


def host_workspace(threads: int | None = None) -> Callable[[Any, tuple, dict | None], float]:
    """A rehearsal's `meta_heap.MetaHeap` workspace on this host: for an op of `WORKSPACE_OPS`, its `op_workspace`
    with ``threads`` (measured once per op and arguments' shapes, strides and dtypes); 0 for any other op."""
    def workspace(func: Any, args: tuple, kwargs: dict | None) -> float:
        return op_workspace(func, args, kwargs, threads) if func in WORKSPACE_OPS else 0.0
    return workspace


def _layout(value: Any) -> Any:
    return (tuple(value.shape), value.stride(), value.dtype) if isinstance(value, torch.Tensor) else value


def _real_like(value: Any) -> Any:
    """A CPU tensor with ``value``'s shape, strides and dtype (random values), for a tensor; else ``value``."""
    if not isinstance(value, torch.Tensor):
        return value
    real = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
    # filled through its storage: a broadcast argument (a stride of 0) refers to an element more than once
    storage = torch.empty(0, dtype=value.dtype).set_(real.untyped_storage())
    if real.is_floating_point():
        storage.normal_()
    else:
        storage.zero_()
    return real


def linear_workspace(tokens: int, fan_in: int, fan_out: int, threads: int | None = None,
                     dtype: torch.dtype = torch.float32, products: tuple[int, ...] = (0, 1, 2)) -> float:
    """The largest workspace (`op_workspace`) of a linear layer's three products: its forward (the input by the
    weight transposed), its input's gradient (the output's gradient by the weight) and its weight's gradient (the
    output's gradient transposed by the input); ``products``: of those, which (0, 1, 2 in that order)."""
    def mat(rows: int, cols: int, transposed: bool) -> torch.Tensor:
        t = torch.empty(cols, rows, dtype=dtype, device="meta")
        return t.t() if transposed else t.t().contiguous()

    pairs = ((mat(tokens, fan_in, False), mat(fan_in, fan_out, True)),
             (mat(tokens, fan_out, False), mat(fan_out, fan_in, False)),
             (mat(fan_out, tokens, True), mat(tokens, fan_in, False)))
    chosen = [pair for i, pair in enumerate(pairs) if i in products]
    return max(op_workspace(_aten.mm.default, pair, None, threads) for pair in chosen)


def attention_workspace(batch: int, heads: int, seq: int, head_dim: int, threads: int | None = None,
                        dtype: torch.dtype = torch.float32) -> float:
    """The larger workspace (`op_workspace`) of the CPU's fused causal attention's forward and backward."""
    def qkv() -> torch.Tensor:  # (batch, heads, seq, head_dim), laid out as the projections' views are
        return torch.empty(batch, seq, heads, head_dim, dtype=dtype, device="meta").transpose(1, 2)

    q, k, v = qkv(), qkv(), qkv()
    lse = torch.empty(batch, heads, seq, dtype=torch.float32, device="meta")
    return max(op_workspace(WORKSPACE_OPS[2], (q, k, v, 0.0, True), None, threads),
               op_workspace(WORKSPACE_OPS[3], (qkv(), q, k, v, qkv(), lse, 0.0, True), None, threads))


def sent_bytes(kind: str, payload: float, world: int) -> float:
    """Bytes a rank sends for one ``kind`` of ``payload`` bytes (the full tensor) over ``world`` ranks."""
    if kind == "all_reduce":
        return 2 * (world - 1) / world * payload
    if kind in ("all_gather", "reduce_scatter"):
        return (world - 1) / world * payload
    return payload


def _fit(times: dict[Any, float], world: int, kind: str) -> tuple[float, float]:
    """(latency: a small call's cost between computes, bandwidth: a large call's extra bytes over its extra time).
    The loaded figure is a difference of two timings, and another process taking a core between them can bring it to
    0 (a test run beside other work, 29 November): a call costs at least what it costs back to back."""
    extra_bytes = sent_bytes(kind, LARGE, world) - sent_bytes(kind, SMALL, world)
    extra_time = max(times[LARGE] - times[SMALL], 1e-9)
    return max(times["loaded"], times[SMALL]), extra_bytes / extra_time


def _rank(rank: int, world: int, hidden: int, tokens: int) -> dict[str, Any]:
    import torch.distributed as dist

    from strategies import comm
    from strategies.comm import Axis, CommStats

    axis = Axis.of_group("world", dist.group.WORLD, CommStats())
    out: dict[str, Any] = {"flops": _compute(hidden, tokens, lambda: comm.barrier(axis))}
    if world == 1:
        return out
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]  # every rank takes part in each
    pair = Axis.of_group("pair", pairs[min(rank // 2, len(pairs) - 1)], CommStats()) if rank < world - world % 2 \
        else None
    for kind in KINDS:
        if kind != "send":
            out[f"{kind}@{world}"] = _times(kind, axis)
        if world > 2 or kind == "send":
            times = _times(kind, pair) if pair else {SMALL: 0.0, LARGE: 0.0, "loaded": 0.0}
            comm.barrier(axis)
            out[f"{kind}@2"] = times
    return out


def _compute(hidden: int, tokens: int, barrier) -> float:
    x = torch.randn(tokens, hidden, requires_grad=True)
    up, down = torch.randn(hidden, 4 * hidden, requires_grad=True), torch.randn(4 * hidden, hidden, requires_grad=True)
    flops = 3 * 2 * (2 * tokens * hidden * 4 * hidden)  # forward + twice that in backward, two matmuls

    def step() -> None:
        ((x @ up).relu() @ down).sum().backward()

    step()
    barrier()
    reps, start = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - start < 1.0:
        step()
        reps += 1
    return flops * reps / (time.perf_counter() - start)


def _times(kind: str, axis: Any) -> dict[Any, float]:
    """A small and a large call back to back (for the bandwidth), and a small one between computes (the latency)."""
    return {SMALL: _time_collective(kind, SMALL, axis), LARGE: _time_collective(kind, LARGE, axis),
            "loaded": _time_collective(kind, SMALL, axis, loaded=True)}


def _call(kind: str, size: int, axis: Any):
    """One ``kind`` of ``size`` bytes over ``axis``, as a function (a send goes from axis index 0 to 1)."""
    from strategies import comm

    n = size // 4
    world = axis.size
    tensor = torch.zeros(n)
    big = torch.zeros(n - n % world if kind != "all_reduce" else n)

    def once() -> None:
        if kind == "all_reduce":
            comm.all_reduce(tensor, axis)
        elif kind == "all_gather":
            comm.all_gather(big, big[: len(big) // world].clone(), axis)
        elif kind == "reduce_scatter":
            comm.reduce_scatter(big[: len(big) // world].clone(), big, axis)
        elif axis.index == 0:
            comm.send(tensor, axis, 1)
        elif axis.index == 1:
            comm.recv(tensor, axis, 0)
    return once


def _time_collective(kind: str, size: int, axis: Any, loaded: bool = False) -> float:
    """Seconds one ``kind`` of ``size`` bytes takes; ``loaded``: what it adds when the ranks compute between calls, as
    they do in training: on ranks that share cores a collective also waits for its peers to be scheduled, which back
    to back calls on idle ranks never show (measured here: an all-gather over pairs of 4 ranks on 2 cores, 0.4 ms
    idle, ~2 ms under load)."""
    from strategies import comm

    once = _call(kind, size, axis)
    a, w = torch.randn(256, 64), torch.randn(64, 256)

    def work() -> None:  # about a millisecond of compute between calls
        for _ in range(6 if loaded else 0):
            a @ w

    once()
    reps = 20 if size <= SMALL else 5  # the same on every rank: each call is a collective
    comm.barrier(axis)
    start = time.perf_counter()
    for _ in range(reps):
        work()
    alone = time.perf_counter() - start
    comm.barrier(axis)
    start = time.perf_counter()
    for _ in range(reps):
        work()
        once()
    comm.barrier(axis)
    return max(time.perf_counter() - start - alone, 0.0) / reps
