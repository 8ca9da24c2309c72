"""``stratpack bench --accelerator gpu``: on one GPU, our plans beside Lightning's own single-device strategy and a
plain torch loop on the same module, eager and compiled, each row a fresh process, rows in alternating order.

Rows: ``plain`` (a hand-written loop over the module's own ``compute_loss``: bf16 autocast as Lightning's
bf16-mixed, the module's optimizer, ``zero_grad(set_to_none=True)`` after the step), ``single``
(``Trainer(strategy="auto")`` on one device), or a plan (``Trainer(strategy=plan)``); ``+compile`` compiles it (the
plain loop: ``torch.compile`` of the whole model; a Trainer row: each block, `strategies.compile`). Every row reads
the loss once per step (the plain loop synchronizes, the Trainer rows' monitor reads it), so each step ends with the
device idle alike. A Trainer row is ``stratpack train`` with the first-batch check off (``Trainer(strategy="dp")``'s
default).

Per row: tokens/s and MFU (6N + 12·L·h·s FLOP per token over the device's dense peak; timed over the steps after
``--warmup-steps``), the allocator's peak (``max_memory_allocated`` over the whole run), and for the rows named in
``--profile`` the step-time split as the device saw it (`measure.profile`: busy, idle, matrix products, attention,
optimizer...), from two traced steps inside the untimed ones. The Trainer rows go to the run store under one
``bench-gpu-...`` comparison, the plain loop's beside them, so the dashboard shows them side by side.

Before each row the parent times a fixed bf16 matrix product and a large copy on the device (`device_probe`) and
reports both beside the row: on a lent machine the device's own speed can move by a fifth between processes minutes
apart (docs/gpu-2026-11-28.md), and a row run while it was slow must show as such, not as a slower strategy.

``--budget-s`` bounds the whole command (a GPU lent for minutes): a row that would not fit in what is left, by the
rows timed so far, is reported as skipped. With ``--accelerator cpu`` and a tiny size it runs anywhere (its test).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (holds strategies/, demos/)
GiB = 2**30
# The sizes the GPU issue measures: the demo GPT 24 x 2048 (1.21B) and a Hugging Face Llama 16 x 2048 (1.14B).
MODELS = {
    "gpt": ("demos.workload:GPT_WORKLOAD", {"n_layer": 24, "n_embd": 2048, "n_head": 16, "seq_len": 2048,
                                            "batch_size": 8}),
    "llama": ("demos.hf_llama:LLAMA", {"n_layer": 16, "n_embd": 2048, "n_head": 16, "seq_len": 2048,
                                       "batch_size": 4}),
}
DEFAULT_ROWS = "plain,single,dp,zero1,zero2,zero3,plain+compile,single+compile,dp+compile,zero3+compile"
COMPILE_COST = 2.5  # a compiled row's process takes about this many eager rows' time (first compile): for --budget-s


@dataclass(frozen=True)
class GpuBenchConfig:
    model: str = "gpt"
    n_layer: int = 24
    n_embd: int = 2048
    n_head: int = 16
    seq_len: int = 2048
    batch_size: int = 8
    steps: int = 20
    warmup_steps: int = 6  # the profiled steps are two of these
    precision: str = "bf16-mixed"
    max_chars: int = 2_000_000
    accelerator: str = "gpu"
    seed: int = 0

    @property
    def workload(self) -> str:
        return MODELS[self.model][0]

    def size_args(self) -> list[str]:
        return [f"--{k.replace('_', '-')}={getattr(self, k)}" for k in
                ("n_layer", "n_embd", "n_head", "seq_len", "batch_size", "steps", "warmup_steps", "max_chars")]


def parse_rows(text: str) -> list[str]:
    """The rows, checked: ``plain``, ``single`` or a plan, each optionally ``+compile``."""
    from strategies.lightning.names import looks_like_plan

    rows = [r.strip() for r in text.split(",") if r.strip()]
    for row in rows:
        name, plus, suffix = row.partition("+")
        if (plus and suffix != "compile") or not (name in ("plain", "single") or looks_like_plan(name)):
            raise ValueError(f"bench row {row!r}: give plain, single or a plan (dp, zero3...), optionally +compile")
    if not rows:
        raise ValueError("no rows to bench")
    return rows


# -- one row, in a fresh process -------------------------------------------------------------------------------


def run_row(row: str, cfg: GpuBenchConfig, store: dict[str, Any], profile_dir: str | None,
            timeout_s: float) -> dict[str, Any]:
    """``row`` in a fresh process: this module's plain loop, or `stratpack train`. ``store``: runs_dir and the
    comparison id the Trainer rows write to."""
    name, _, compiled = row.partition("+")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        if name == "plain":
            cmd = [sys.executable, "-m", "strategies.cli.bench_gpu", "--plain", json.dumps(asdict(cfg)), "--out", out,
                   *(["--compile"] if compiled else []), *(["--profile", profile_dir] if profile_dir else [])]
        else:
            cmd = [sys.executable, "-m", "strategies.cli", "train", name, "--accelerator", cfg.accelerator,
                   "--devices", "1", "--precision", cfg.precision, "--wandb", "off", "--out", out,
                   "--runs-dir", store["runs_dir"], "--comparison", store["comparison"], "--label", row,
                   "--workload", cfg.workload, "--no-check-first-batch", *cfg.size_args(),
                   *(["--compile", "inductor"] if compiled else []),
                   *(["--profile", profile_dir] if profile_dir else [])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"row": row, "error": f"timed out after {timeout_s:.0f} s", "process_s": time.perf_counter() - start}
        if proc.returncode != 0 or not os.path.exists(out):
            return {"row": row, "error": (proc.stderr or proc.stdout)[-2000:] or f"exit {proc.returncode}",
                    "process_s": time.perf_counter() - start}
        with open(out) as f:
            got = json.load(f)
    mem = got.get("memory_bytes") or {}
    result = {"row": row, "tokens_per_s": got.get("tokens_per_s"), "mfu": got.get("mfu"),
              "max_allocated": got.get("max_allocated", mem.get("max_allocated")),
              "max_reserved": got.get("max_reserved", mem.get("max_reserved")),
              "loss": (got.get("losses") or [got.get("loss")])[-1], "process_s": time.perf_counter() - start}
    if name == "plain":
        result["step_times"] = got.get("step_times")
    if profile_dir and os.path.exists(os.path.join(profile_dir, "split.json")):
        with open(os.path.join(profile_dir, "split.json")) as f:
            result["split"] = json.load(f)
    return result


def plain_loop(cfg: GpuBenchConfig, compiled: bool = False, profile_dir: str | None = None) -> dict[str, Any]:
    """The hand-written loop, in this process: the workload's LightningModule used as a plain module."""
    import torch

    from strategies.measure.profile import ProfileWindow
    from strategies.measure.readings import device_peak_flops

    device = torch.device("cuda" if cfg.accelerator != "cpu" else "cpu")
    module, optimizer, batches = _plain_parts(cfg, device, compiled)
    step_loss = getattr(module, "compute_loss", None) or (lambda batch: module.training_step(batch, 0))
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(cfg.precision)
    window = ProfileWindow(profile_dir, first=max(0, cfg.warmup_steps - 3), count=2) if profile_dir else None
    times, loss_value = [], None
    for step in range(cfg.steps):
        if window is not None:
            window.before(step)
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None):
            loss = step_loss((x, y))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())  # the one read per step, as the Trainer rows' monitor reads theirs
        times.append(time.perf_counter() - start)
        if window is not None:
            window.after(step)
    timed = times[cfg.warmup_steps:]
    tokens_per_s = cfg.batch_size * cfg.seq_len * len(timed) / sum(timed) if timed else None
    peak, _ = device_peak_flops(device, half or torch.float32)
    per_token = module.flops_per_token() if hasattr(module, "flops_per_token") else None
    return {"tokens_per_s": tokens_per_s,
            "mfu": per_token * tokens_per_s / peak if peak and per_token and tokens_per_s else None,
            "max_allocated": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
            "max_reserved": torch.cuda.max_memory_reserved() if device.type == "cuda" else None,
            "loss": loss_value, "step_times": times}


def _plain_parts(cfg: GpuBenchConfig, device: Any, compiled: bool) -> tuple[Any, Any, Any]:
    """The plain loop's module (on ``device``; its ``model`` compiled whole with ``compiled``), its optimizer (the
    module's own) and its batches (shuffled, epoch after epoch)."""
    import torch
    from torch.utils.data import DataLoader

    from strategies.cli.train import RunConfig
    from strategies.cli.workload import find_workload

    run = RunConfig(strategy="single", steps=cfg.steps, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                    n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, max_chars=cfg.max_chars,
                    seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    module, dataset = find_workload(cfg.workload).lightning(run)
    module = module.to(device)
    optimizer = module.configure_optimizers()
    optimizer = optimizer[0] if isinstance(optimizer, (list, tuple)) else optimizer
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    if compiled:
        module.model = torch.compile(module.model)
    loader = DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(cfg.seed))
    return module, optimizer, _forever(loader)


def _forever(loader: Any) -> Any:
    """The loader's batches, epoch after epoch (as a Trainer with ``max_steps`` reads a small dataset again)."""
    while True:
        yield from loader


# -- the whole bench -----------------------------------------------------------------------------------------


def bench(cfg: GpuBenchConfig, rows: list[str], repeat: int, profile: set[str], folder: str, store: dict[str, Any],
          budget_s: float | None = None, log: Any = None) -> list[dict[str, Any]]:
    """Every row ``repeat`` times, the order reversed every other pass; the rows in ``profile`` traced in their
    first run (their traces under ``folder/profile-<row>``). Stops launching rows that would not fit ``budget_s``."""
    start, results, eager_s = time.perf_counter(), [], []
    for k in range(repeat):
        for row in rows if k % 2 == 0 else rows[::-1]:
            cost = _expected_s(row, eager_s)
            left = budget_s - (time.perf_counter() - start) if budget_s else None
            if left is not None and (left < 15 or (cost is not None and cost > left)):
                results.append({"row": row, "skipped": f"not enough of --budget-s left ({left:.0f} s; "
                                                       f"expected {cost or 0:.0f} s)"})
                continue
            traced = row in profile and not any(r["row"] == row and "split" in r for r in results)
            where = os.path.join(folder, "profile-" + row.replace("+", "-")) if traced else None
            probe = device_probe(cfg.accelerator)
            got = {**run_row(row, cfg, store, where, timeout_s=max(30.0, left - 5) if left else 1800.0),
                   "probe": probe}
            if "error" not in got and "+" not in row:
                eager_s.append(got["process_s"])
            results.append(got)
            if log is not None:
                print(_row_line(got), file=log, flush=True)
    return results


def device_probe(accelerator: str, size: int | None = None, reps: int = 30) -> dict[str, float]:
    """The device's speed now, in this process: TFLOP/s of a fixed square matrix product (bf16 on a GPU) and GB/s of
    copying a large tensor, each the best of ``reps`` timed after three untimed. Its memory is given back before
    the row's process starts (the context's few hundred MiB stay: the row's own allocator peak does not see them)."""
    import torch

    dev = torch.device("cuda" if accelerator != "cpu" else "cpu")
    cuda = dev.type == "cuda"
    n = size or (8192 if cuda else 256)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def best(fn: Any) -> float:
        for _ in range(3):
            fn()
        sync()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return min(times)

    flops, bytes_per_s = _probe_rates(dev, n, best)  # its tensors gone on return
    if cuda:
        torch.cuda.empty_cache()
    return {"tflops": flops / 1e12, "gbps": bytes_per_s / 1e9}


def _probe_rates(dev: Any, n: int, best: Any) -> tuple[float, float]:
    import torch

    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    b = torch.randn_like(a)
    flops = 2 * n**3 / best(lambda: a @ b)
    src = torch.empty((2**28 if dev.type == "cuda" else 2**22) // 4, device=dev)  # 256 MiB of fp32 (4 on the CPU)
    dst = torch.empty_like(src)
    return flops, 2 * src.numel() * 4 / best(lambda: dst.copy_(src))  # each byte read once and written once


def _expected_s(row: str, eager_s: list[float]) -> float | None:
    if not eager_s:
        return None
    return statistics.median(eager_s) * (COMPILE_COST if row.endswith("+compile") else 1.0)


def _figure(x: float) -> str:
    """Whole units from 100 up, three significant digits below (a CPU's TFLOP/s)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _row_line(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"{r['row']}: skipped ({r['skipped']})"
    if "error" in r:
        return f"{r['row']}: FAILED after {r['process_s']:.0f} s: {r['error'].strip().splitlines()[-1][:300]}"
    mfu = f"MFU {r['mfu']:.3f}, " if r.get("mfu") else ""
    peak = f"peak {r['max_allocated'] / GiB:.2f} GiB, " if r.get("max_allocated") else ""
    probe = (f", device probe {_figure(r['probe']['tflops'])} TFLOP/s {_figure(r['probe']['gbps'])} GB/s"
             if r.get("probe") else "")
    return f"{r['row']}: {r['tokens_per_s']:,.0f} tokens/s, {mfu}{peak}{r['process_s']:.0f} s{probe}"


def environment() -> dict[str, Any]:
    import lightning
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "lightning": lightning.__version__,
           "python": platform.python_version(), "device": "cpu"}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(device=torch.cuda.get_device_name(0), memory_gib=round(props.total_memory / GiB, 1))
    return out


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row: the median tokens/s and MFU over its runs, its largest allocator peak, its split, its runs."""
    out: dict[str, dict[str, Any]] = {}
    for row in dict.fromkeys(r["row"] for r in results):
        mine = [r for r in results if r["row"] == row]
        ok = [r for r in mine if "tokens_per_s" in r and r["tokens_per_s"]]
        if not ok:
            bad = next((r for r in mine if "error" in r), mine[0])
            out[row] = {"failed": bad.get("error") or bad.get("skipped"), "skipped": "error" not in bad}
            continue
        split = next((r["split"] for r in ok if "split" in r), None)
        out[row] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
                    "runs": [r["tokens_per_s"] for r in ok],
                    "mfu": statistics.median(r["mfu"] for r in ok) if all(r.get("mfu") for r in ok) else None,
                    "max_allocated": max((r.get("max_allocated") or 0) for r in ok) or None, "split": split,
                    "process_s": statistics.median(r["process_s"] for r in ok),
                    "probes": [r["probe"] for r in ok if r.get("probe")]}
    return out


def report(results: list[dict[str, Any]], cfg: GpuBenchConfig, env: dict[str, Any], repeat: int) -> str:
    """Markdown: one line per row (median of its runs) with its ratio to ``single`` and to ``plain`` (eager rows to
    the eager ones, compiled rows to the compiled ones), then the device's split of the profiled rows."""
    rows = summarize(results)
    lines = [f"Model `{cfg.model}` {cfg.n_layer} x {cfg.n_embd} ({cfg.n_head} heads), sequence {cfg.seq_len}, batch "
             f"{cfg.batch_size}, {cfg.precision}, {cfg.steps} steps ({cfg.warmup_steps} untimed), {repeat} run(s) per "
             f"row in alternating order, each a fresh process; {env.get('device')}, torch {env.get('torch')}, "
             f"Lightning {env.get('lightning')}.", "",
             "| row | tokens/s | MFU | allocator peak GiB | vs single | vs plain | runs (tokens/s) | device probe "
             "before each run (TFLOP/s, GB/s) |",
             "|---|---|---|---|---|---|---|---|"]
    for row, r in rows.items():
        if "failed" in r:
            what = "skipped" if r["skipped"] else "failed"
            lines.append(f"| {row} | {what}: {str(r['failed']).strip().splitlines()[-1][:200]} | | | | | | |")
            continue
        compiled = "+compile" if row.endswith("+compile") else ""
        ratios = []
        for peer in ("single", "plain"):
            other = rows.get(peer + compiled, {})
            ratios.append(f"{r['tokens_per_s'] / other['tokens_per_s']:.3f}" if other.get("tokens_per_s") else "-")
        peak = f"{r['max_allocated'] / GiB:.2f}" if r.get("max_allocated") else "-"
        mfu = f"{r['mfu']:.3f}" if r.get("mfu") else "-"
        runs = " / ".join(f"{x:,.0f}" for x in r["runs"])
        probes = " / ".join(f"{_figure(p['tflops'])}, {_figure(p['gbps'])}" for p in r["probes"]) or "-"
        lines.append(f"| {row} | {r['tokens_per_s']:,.0f} | {mfu} | {peak} | {ratios[0]} | {ratios[1]} | {runs} | "
                     f"{probes} |")
    traced = [(row, r["split"]) for row, r in rows.items() if r.get("split")]
    if traced and any(s["events"] for _, s in traced):
        kinds = sorted({k for _, s in traced for k in s["kinds"]}, key=lambda k: -max(s["kinds"].get(k, 0)
                                                                                      for _, s in traced))
        lines += ["", "The step as the device saw it (two traced steps, ms per step; `measure.profile`):", "",
                  "| row | wall | busy | idle | " + " | ".join(kinds) + " |", "|---|---|---|---|" + "---|" * len(kinds)]
        for row, s in traced:
            cells = [f"{s['kinds'].get(k, 0) * 1e3:.1f}" for k in kinds]
            lines.append(f"| {row} | {s['wall_s'] * 1e3:.1f} | {s['busy_s'] * 1e3:.1f} | {s['idle_s'] * 1e3:.1f} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_plain_runs(results: list[dict[str, Any]], cfg: GpuBenchConfig, env: dict[str, Any],
                     store: dict[str, Any]) -> None:
    """The plain loop's runs into the run store, beside the Trainer rows' (which `stratpack train` wrote): one record
    per step (its time, tokens/s, the allocator's peak), a summary with the timed tokens/s and MFU."""
    from strategies import runs

    for r in results:
        if not r["row"].startswith("plain") or "tokens_per_s" not in r:
            continue
        run_id = runs.new_run_id(f"bench-{r['row']}")
        writer = runs.RunWriter(store["runs_dir"], run_id, 0)
        writer.write_meta(runs.run_meta(run_id=run_id, label=r["row"], comparison=store["comparison"], world_size=1,
                                        devices=[env.get("device", "cpu")], plan=None, model=store.get("model"),
                                        seed=cfg.seed, bench={"role": "plain loop", "config": asdict(cfg)}))
        tokens = cfg.batch_size * cfg.seq_len
        now = time.time()
        for step, seconds in enumerate(r.get("step_times") or [], start=1):
            writer.append({"step": step, "time": now, "step_time_s": seconds, "loss": None, "lr": None,
                           "tokens_per_s": tokens / seconds, "mfu": None,
                           "memory": {"max_allocated": r["max_allocated"]},
                           "comm": {}, "bubble": None, "warmup": step <= cfg.warmup_steps})
        writer.finish({"steps": cfg.steps, "world_size": 1, "tokens_per_s": r["tokens_per_s"], "mfu": r.get("mfu"),
                       "memory_bytes_per_rank": [{"max_allocated": r["max_allocated"]}],
                       "bench": {"role": "plain loop", "row": r["row"]}})


# -- the command line ----------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options only the GPU bench takes (`bench.add_parser` has the shared ones)."""
    p.add_argument("--model", choices=tuple(MODELS), default="gpt", help="gpu: the demo GPT or a Hugging Face Llama")
    p.add_argument("--rows", default=None,
                   help="one device (gpu, or cpu when given): plain, single or plans, each optionally +compile "
                        f"(gpu's default: {DEFAULT_ROWS})")
    p.add_argument("--n-head", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None, help="gpu: the batch (one device)")
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--profile", default="", help="gpu: rows to trace (comma-separated), or 'all'")
    p.add_argument("--budget-s", type=float, default=None, help="gpu: skip the rows that would end after this")
    p.add_argument("--folder", default=None, help="gpu: where the report, the runs' JSON and the traces go")


def config_of(args: argparse.Namespace) -> GpuBenchConfig:
    """The bench's config: ``--model``'s sizes, where the command line gives none."""
    sizes = MODELS[args.model][1]
    given = {k: getattr(args, k, None) for k in ("n_layer", "n_embd", "n_head", "seq_len", "batch_size")}
    cfg = GpuBenchConfig(model=args.model, precision=args.precision, accelerator=args.accelerator,
                         **{k: v if v is not None else sizes[k] for k, v in given.items()})
    return replace(cfg, **{k: getattr(args, k) for k in ("steps", "warmup_steps") if getattr(args, k) is not None})


def command(args: argparse.Namespace) -> int:
    """``stratpack bench --accelerator gpu`` (or ``--rows ...`` on the CPU, its smoke test at a tiny size)."""
    import torch

    cfg = config_of(args)
    if not 3 <= cfg.warmup_steps < cfg.steps:
        print(f"error: --warmup-steps must be 3 or more (two of them are traced) and below --steps ({cfg.steps})",
              file=sys.stderr)
        return 2
    if cfg.accelerator == "gpu" and not torch.cuda.is_available():
        print("error: --accelerator gpu needs a CUDA GPU, and torch sees none here (a CPU build of torch, or no "
              "driver); the CPU comparison is `stratpack bench` without it", file=sys.stderr)
        return 2
    try:
        rows = parse_rows(args.rows or DEFAULT_ROWS)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from strategies import runs
    from strategies.cli.workload import find_workload

    folder = args.folder or tempfile.mkdtemp(prefix="bench-gpu-")
    os.makedirs(folder, exist_ok=True)
    profile = set(rows) if args.profile == "all" else {r.strip() for r in args.profile.split(",") if r.strip()}
    store = {"runs_dir": str(runs.runs_dir(args.runs_dir)), "comparison": runs.new_comparison_id("bench-gpu"),
             "model": find_workload(cfg.workload).model_config(cfg)}
    env = environment()
    print(f"bench on {env['device']}: {', '.join(rows)} x {args.repeat}; comparison {store['comparison']}",
          file=sys.stderr, flush=True)
    results = bench(cfg, rows, args.repeat, profile, folder, store, args.budget_s, log=sys.stderr)
    _write_outputs(results, cfg, env, store, folder, args)
    return 0 if all("error" not in r for r in results) else 1


def _write_outputs(results: list[dict[str, Any]], cfg: GpuBenchConfig, env: dict[str, Any], store: dict[str, Any],
                   folder: str, args: argparse.Namespace) -> None:
    """The table (printed, and to each ``--report``), the raw figures in ``folder``, the plain loop's runs in the
    run store."""
    text = report(results, cfg, env, args.repeat)
    print(text)
    with open(os.path.join(folder, f"bench-gpu-{cfg.model}.json"), "w") as f:
        json.dump({"config": asdict(cfg), "environment": env, "comparison": store["comparison"], "results": results,
                   "summary": summarize(results)}, f, indent=1)
    for path in args.report or []:
        with open(path, "w") as f:
            f.write(f"# stratpack bench --accelerator {cfg.accelerator}, {time.strftime('%Y-%m-%d %H:%M')}\n\n"
                    f"{text}\n")
        print(f"report: {path}")
    if not args.no_store:
        write_plain_runs(results, cfg, env, store)
        print(f"comparison id: {store['comparison']} (in the run store; `stratpack dashboard` shows it)")


def main(argv: list[str] | None = None) -> int:
    """The plain loop's own process (`run_row`)."""
    p = argparse.ArgumentParser()
    p.add_argument("--plain", required=True, help="the GpuBenchConfig as JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--profile", default=None)
    args = p.parse_args(argv)
    got = plain_loop(GpuBenchConfig(**json.loads(args.plain)), args.compile, args.profile)
    with open(args.out, "w") as f:
        json.dump(got, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
