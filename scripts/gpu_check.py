"""The CUDA path on a GPU machine: what only a GPU shows, printed as markdown and written as JSON.

    python scripts/gpu_check.py [--out DIR] [--quick]

1. Trainer runs of the demo GPT on one GPU (nccl, world size 1) under dp, zero1, zero2, zero3 and
   zero3_offload: ``torch.cuda.max_memory_allocated`` beside the estimator's model states + activations.
2. The ZeRO engines on two ranks sharing the GPU (gloo carries the CUDA tensors: nccl refuses two ranks on one
   device): each rank's model-state bytes and allocator peak against the ZeRO formulas at N = 2.
3. bf16-mixed against 32-true on a model that fills the GPU: tokens/s and MFU (6N + 12·L·h·s FLOP per token
   against the device's dense bf16 peak).
4. With two or more GPUs: the equivalence check on nccl, one rank per GPU, against one process: dp, zero1-3,
   tp2, pp2 under 1F1B, GPipe and interleaved, and the largest 3D plan the GPU count fits (per-step loss
   difference and largest parameter difference). With fewer, it says so and what has not been run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # a checkout on a GPU machine need not have the pack installed
MiB, GiB = 2**20, 2**30


def train(plan: str, *args: str, devices: int = 1, params: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "strategies.cli", "train", plan, "--accelerator", "gpu", "--devices", str(devices),
               "--wandb", "off", "--runs-dir", os.path.join(tmp, "runs"), "--out", out,
               "--workload", "demos.workload:GPT_WORKLOAD", *args]  # named in full: the pack may not be installed
        if params:
            cmd += ["--params-out", params]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": ROOT})
        if proc.returncode != 0:
            return {"plan": plan, "error": proc.stderr[-1500:]}
        with open(out) as f:
            return {"plan": plan, **json.load(f)}


def _engine_rank(rank: int, world: int, mode: str, store: str, results: str) -> None:
    import torch
    import torch.distributed as dist

    from demos.gpt import GPT, GPTConfig
    from strategies.comm import Axis, CommStats
    from strategies.measure.memory import model_state_bytes
    from strategies.zero import shard_model

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, n_layer=8, n_head=8, n_embd=512, seq_len=256)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = GPT(config).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    axis = Axis.of_group("dp", dist.group.WORLD, CommStats())
    stage = int(mode[4]) if mode.startswith("zero") else 0
    sync = shard_model(model, opt, axis, stage, offload=mode.endswith("offload")) if stage else None
    if sync is None:
        from strategies.data_parallel import BucketedDataParallel
        sync = BucketedDataParallel(model, axis)
    psi = sum(p.numel() for p in GPT(config).parameters())
    for _ in range(3):
        x = torch.randint(0, 256, (4, 256), device="cuda")
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x.reshape(-1)).backward()
        sync.finish()
        opt.step()
        sync.after_step()
        states = model_state_bytes(model, [opt], sync.memory_tensors())
        opt.zero_grad(set_to_none=True)
    out = {"rank": rank, "mode": mode, "psi": psi, "states": states,
           "max_allocated": torch.cuda.max_memory_allocated() - base}
    with open(f"{results}.{rank}", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def engines_on_two_ranks() -> list[dict]:
    import torch.multiprocessing as mp

    from strategies.measure.estimate import model_states
    from strategies.plan import ParallelPlan

    rows = []
    for mode in ("dp", "zero1", "zero2", "zero3", "zero3_offload"):
        with tempfile.TemporaryDirectory() as tmp:
            results = os.path.join(tmp, "r")
            try:
                mp.start_processes(_engine_rank, args=(2, mode, os.path.join(tmp, "store"), results), nprocs=2,
                                   start_method="spawn")
            except Exception as err:  # noqa: BLE001 - report and go on
                rows.append({"mode": mode, "error": f"{type(err).__name__}: {str(err)[-800:]}"})
                continue
            for rank in range(2):
                with open(f"{results}.{rank}") as f:
                    got = json.load(f)
                plan = ParallelPlan.parse(mode).resolve(2)
                got["predicted"] = model_states(got["psi"], plan)
                rows.append(got)
    return rows


def _table(title: str, columns: list[str], rows: list[dict], key, cells) -> None:
    """A markdown table: ``key(row)`` cells, then ``cells(row)`` or the row's error."""
    print(f"\n## {title}\n\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for r in rows:
        rest = [f"failed: {r['error'][-300:]!r}"] if "error" in r else cells(r)
        rest += [""] * (len(columns) - len(key(r)) - len(rest))
        print("| " + " | ".join(key(r) + rest) + " |", flush=True)


def trainer_part(report: dict) -> None:
    """1: Trainer runs on one GPU, allocator peak beside the estimator."""
    from strategies.runs import MEMORY_CATEGORIES

    mid = ["--n-layer", "8", "--n-head", "8", "--n-embd", "512", "--seq-len", "256", "--batch-size", "8",
           "--steps", "8", "--warmup-steps", "3", "--max-chars", "2000000"]
    report["trainer"] = [train(plan, *mid) for plan in ("dp", "zero1", "zero2", "zero3", "zero3_offload")]

    def trainer_row(r: dict) -> list[str]:
        mem = r.get("memory_bytes") or {}
        pred = (r.get("predicted") or {}).get("memory") or [{}]
        est = sum(pred[0].get(k, 0) for k in MEMORY_CATEGORIES if k != "host")
        return [f"{mem.get('max_allocated', 0) / MiB:.1f}", f"{mem.get('total', 0) / MiB:.1f}", f"{est / MiB:.1f}",
                f"{r.get('tokens_per_s') or 0:,.0f}"]

    _table("Trainer, one GPU (nccl): allocator peak vs the estimator",
           ["plan", "max_allocated MiB", "model states MiB (measured)", "estimate: states + activations MiB",
            "tokens/s"], report["trainer"], lambda r: [r["plan"]], trainer_row)


def engines_part(report: dict) -> None:
    """2: the ZeRO engines on two ranks sharing the GPU, against the formulas."""
    from strategies.runs import MODEL_STATE

    report["engines"] = engines_on_two_ranks()
    _table("ZeRO engines, two ranks on the GPU (gloo): model states vs the formulas at N = 2",
           ["plan", "rank", "params MiB meas/pred", "grads", "optimizer", "host", "max_allocated MiB"],
           report["engines"], lambda r: [r["mode"], str(r.get("rank", "-"))],
           lambda r: [f"{r['states'][k] / MiB:.2f} / {r['predicted'][k] / MiB:.2f}" for k in MODEL_STATE]
           + [f"{r['max_allocated'] / MiB:.1f}"])


def mfu_part(report: dict, quick: bool) -> None:
    """3: bf16-mixed against 32-true, tokens/s and MFU."""
    big = ["--n-layer", "12", "--n-head", "12", "--n-embd", "768", "--seq-len", "1024", "--batch-size",
           "16" if quick else "32", "--steps", "12" if quick else "25", "--warmup-steps", "5", "--max-chars", "4000000"]
    report["mfu"] = [{**train("dp", *big, "--precision", p), "precision": p} for p in ("32-true", "bf16-mixed")]
    _table("Throughput and MFU, GPT 12 x 768, sequence 1024, one GPU",
           ["precision", "tokens/s", "TFLOP/s", "MFU", "max_allocated GiB"], report["mfu"],
           lambda r: [r["precision"]],
           lambda r: [f"{r.get('tokens_per_s') or 0:,.0f}", f"{(r.get('flops_per_s') or 0) / 1e12:.1f}",
                      f"{r.get('mfu') or 0:.3f}", f"{(r.get('memory_bytes') or {}).get('max_allocated', 0) / GiB:.2f}"])


NCCL_PLANS = [("dp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 2), ("tp2", 2), ("pp2_1f1b_mb4", 2),
              ("pp2_gpipe_mb4", 2), ("pp2_interleaved_v2_mb4", 2)]
THREE_D = [(8, "zero3_tp2_pp2"), (4, "tp2_pp2")]  # the largest that the GPU count fits


def nccl_part(report: dict) -> None:
    """4: every plan on nccl, one rank per GPU, against one process (fp32, SGD: no optimizer hides a scale)."""
    import torch

    gpus = torch.cuda.device_count()
    report["gpus"] = gpus
    if gpus < 2:
        report["nccl"] = f"skipped: {gpus} GPU visible; nccl across ranks needs two or more (one rank per GPU)"
        print(f"\n## Equivalence on nccl\n\n{report['nccl']}. Not run here: any multi-rank collective or p2p "
              "message on nccl.", flush=True)
        return
    common = ["--steps", "5", "--batch-size", "8", "--seq-len", "32", "--n-embd", "32", "--n-layer", "4",
              "--max-chars", "20000", "--optimizer", "sgd"]
    three_d = next(((plan, n) for n, plan in THREE_D if n <= gpus), None)
    plans = NCCL_PLANS + ([three_d] if three_d else [])
    with tempfile.TemporaryDirectory() as tmp:
        ref = train("single", *common, params=os.path.join(tmp, "single.pt"))
        rows = [_compare(ref, train(plan, *common, devices=n, params=os.path.join(tmp, f"{plan}.pt")),
                         os.path.join(tmp, "single.pt"), os.path.join(tmp, f"{plan}.pt"), plan, n) for plan, n in plans]
    report["nccl"] = rows
    _table(f"Equivalence on nccl, one rank per GPU ({gpus} GPUs), against one process (fp32, SGD, 5 steps)",
           ["plan", "ranks", "max loss rel. diff", "max param abs. diff"], rows, lambda r: [r["plan"], str(r["ranks"])],
           lambda r: [f"{r['loss_rel']:.2e}", f"{r['param_abs']:.2e}"])


def _compare(ref: dict, got: dict, ref_params: str, got_params: str, plan: str, ranks: int) -> dict:
    import torch

    if "error" in got or "error" in ref:
        return {"plan": plan, "ranks": ranks, "error": got.get("error") or ref.get("error")}
    a, b = torch.tensor(got["losses"]), torch.tensor(ref["losses"])
    p, q = torch.load(got_params), torch.load(ref_params)
    return {"plan": plan, "ranks": ranks, "loss_rel": float(((a - b).abs() / b.abs()).max()),
            "param_abs": max(float((p[k].float() - q[k].float()).abs().max()) for k in q)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", default="trainer,engines,mfu,nccl",
                        help="which of trainer, engines, mfu, nccl to run")
    args = parser.parse_args()
    import torch

    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                    "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    print(f"# {report['device']}, torch {report['torch']}, CUDA {report['cuda']}, NCCL {report['nccl']}\n", flush=True)
    parts = args.parts.split(",")
    for name, part in (("trainer", trainer_part), ("engines", engines_part)):
        if name in parts:
            part(report)
    if "mfu" in parts:
        mfu_part(report, args.quick)
    if "nccl" in parts:
        nccl_part(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
