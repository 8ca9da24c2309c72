"""GPU speed on one device (#19): our plans beside Lightning's own single-device strategy and a plain torch loop
on the same module, each row a fresh process, rows in alternating order, printed as markdown and written as JSON.

    python scripts/gpu_speed.py [--model gpt|llama] [--rows plain,plain+compile,single,dp,zero3,dp+compile]
                                [--repeat 2] [--steps 25] [--out DIR]

``plain`` trains the module's own ``compute_loss`` in a hand-written loop (bf16 autocast as Lightning's
bf16-mixed does, the module's optimizer: fused AdamW on CUDA); ``single`` is ``Trainer(strategy="auto")`` on one
device; a plan is ``Trainer(strategy=plan)``; ``+compile`` compiles it (the plain loop: ``torch.compile`` of the
model; a plan: per block, ``stratpack train --compile inductor``). MFU = (6N + 12·L·h·s) FLOP per token over the
device's dense bf16 peak (the pack's monitor's table). ``--model llama`` is a Hugging Face ``LlamaForCausalLM``
from a random config (GQA, vocab 32k; nothing downloaded). With ``--accelerator cpu`` and a tiny size the script
runs anywhere (its smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GiB = 2**30
SIZES = {"gpt": {"n_layer": 24, "n_embd": 2048, "n_head": 16, "seq_len": 2048, "batch_size": 8},
         "llama": {"n_layer": 16, "n_embd": 2048, "n_head": 16, "seq_len": 2048, "batch_size": 4}}
LLAMA_VOCAB, LLAMA_KV_HEADS = 32000, 4


class RandomTokens(Dataset):
    """``(x, y)`` next-token pairs of fixed random ids (the Llama rows need no corpus)."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        ids = torch.randint(vocab, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[i, :-1], self.ids[i, 1:]


def _llama_module(config):
    import lightning as L
    import transformers

    class LlamaModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            cfg = transformers.LlamaConfig(
                vocab_size=LLAMA_VOCAB, hidden_size=config.n_embd, intermediate_size=4 * config.n_embd,
                num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
                num_key_value_heads=LLAMA_KV_HEADS, max_position_embeddings=config.seq_len)
            self.model = transformers.LlamaForCausalLM(cfg)
            self.tokens_per_sample, self.lr = config.seq_len, config.lr
            self.shape = (config.n_layer, config.n_embd, config.seq_len)

        def compute_loss(self, batch):
            x, y = batch
            logits = self.model(input_ids=x).logits
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

        def training_step(self, batch, batch_idx):
            return self.compute_loss(batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95),
                                     fused=self.device.type == "cuda" or None)

        def flops_per_token(self) -> int:
            layers, hidden, seq = self.shape
            lookup = self.model.get_input_embeddings().weight.numel()
            return 6 * (sum(p.numel() for p in self.parameters()) - lookup) + 12 * layers * hidden * seq

    return LlamaModule()


class LlamaWorkload:
    """A Hugging Face Llama on random tokens, as a `stratpack train --workload scripts.gpu_speed:LLAMA`."""

    def lightning(self, config):
        n = max(config.steps, 1) * config.batch_size * config.accumulate
        return _llama_module(config), RandomTokens(n, config.seq_len, LLAMA_VOCAB)


LLAMA = LlamaWorkload()
WORKLOADS = {"gpt": "demos.workload:GPT_WORKLOAD", "llama": "scripts.gpu_speed:LLAMA"}


def _batches(loader: DataLoader):
    """The loader's batches, epoch after epoch (as a Trainer with ``max_steps`` takes them: a small corpus is
    read again)."""
    while True:
        yield from loader


def plain(args: argparse.Namespace) -> dict:
    """The hand-written loop: this process trains ``args.model`` and returns its figures."""
    from strategies.cli.train import RunConfig
    from strategies.cli.workload import find_workload
    from strategies.measure.readings import device_peak_flops

    config = RunConfig(strategy="single", steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                       n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, max_chars=args.max_chars)
    torch.manual_seed(0)
    module, dataset = find_workload(WORKLOADS[args.model]).lightning(config)
    device = torch.device("cuda" if args.accelerator != "cpu" else "cpu")
    module = module.to(device)
    opt = module.configure_optimizers()
    if args.compile:
        module.model = torch.compile(module.model)
    loader = _batches(DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    times = []
    for _ in range(args.steps):
        x, y = (t.to(device, non_blocking=True) for t in next(loader))
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            loss = module.compute_loss((x, y))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    tokens_per_s = args.batch_size * args.seq_len / statistics.mean(times[args.warmup_steps:])
    peak, _ = device_peak_flops(device, dtype)
    flops = module.flops_per_token() * tokens_per_s
    return {"tokens_per_s": tokens_per_s, "mfu": flops / peak if peak else None,
            "max_allocated": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
            "loss": float(loss)}


def run_row(row: str, args: argparse.Namespace) -> dict:
    """One row in a fresh process: the plain loop (this script again) or `stratpack train`."""
    size = ["--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--n-embd", str(args.n_embd),
            "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--warmup-steps", str(args.warmup_steps), "--max-chars", str(args.max_chars)]
    name, _, compiled = row.partition("+")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        if name == "plain":
            cmd = [sys.executable, __file__, "--plain-out", out, "--model", args.model, "--accelerator",
                   args.accelerator, *size, *(["--compile"] if compiled else [])]
        else:
            cmd = [sys.executable, "-m", "strategies.cli", "train", name, "--accelerator", args.accelerator,
                   "--devices", "1", "--precision", args.precision, "--wandb", "off", "--out", out,
                   "--runs-dir", os.path.join(tmp, "runs"), "--workload", WORKLOADS[args.model], *size,
                   *(["--compile", "inductor"] if compiled else [])]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
        if proc.returncode != 0:
            return {"row": row, "error": proc.stderr[-1200:]}
        with open(out) as f:
            got = json.load(f)
    mem = got.get("memory_bytes") or {}
    return {"row": row, "tokens_per_s": got.get("tokens_per_s"), "mfu": got.get("mfu"),
            "max_allocated": got.get("max_allocated", mem.get("max_allocated"))}


def report(results: list[dict], args: argparse.Namespace) -> str:
    """Median tokens/s and MFU of each row's runs, its allocator peak, and its speed against ``single``."""
    rows = dict.fromkeys(r["row"] for r in results)
    med = {}
    for row in rows:
        ok = [r for r in results if r["row"] == row and "error" not in r]
        med[row] = statistics.median(r["tokens_per_s"] for r in ok) if ok else None
    lines = [f"model {args.model} {args.n_layer} x {args.n_embd}, seq {args.seq_len}, batch {args.batch_size}, "
             f"{args.precision}, {args.steps} steps ({args.warmup_steps} untimed), median of {args.repeat}", "",
             "| row | tokens/s | MFU | allocator peak GiB | vs single |", "|---|---|---|---|---|"]
    for row in rows:
        ok = [r for r in results if r["row"] == row and "error" not in r]
        if not ok:
            err = next(r["error"] for r in results if r["row"] == row)
            lines.append(f"| {row} | failed: {err.strip().splitlines()[-1][:200]!r} | | | |")
            continue
        mfu = statistics.median(r["mfu"] or 0 for r in ok)
        peak = max(r["max_allocated"] or 0 for r in ok) / GiB
        ratio = med[row] / med["single"] if med.get("single") else float("nan")
        lines.append(f"| {row} | {med[row]:,.0f} | {mfu:.3f} | {peak:.1f} | {ratio:.3f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=tuple(SIZES), default="gpt")
    p.add_argument("--rows", default="plain,plain+compile,single,dp,zero3,dp+compile")
    p.add_argument("--repeat", type=int, default=1, help="runs of each row, order alternating")
    p.add_argument("--accelerator", default="gpu")
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--max-chars", type=int, default=2_000_000)
    for name in ("n_layer", "n_embd", "n_head", "seq_len", "batch_size"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plain-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="write the markdown and the runs' JSON in this folder")
    args = p.parse_args()
    for name, value in SIZES[args.model].items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    if args.plain_out:
        with open(args.plain_out, "w") as f:
            json.dump(plain(args), f)
        return 0
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    results = []
    for i in range(args.repeat):
        for row in rows if i % 2 == 0 else rows[::-1]:
            results.append(run_row(row, args))
            print(json.dumps(results[-1])[:300], flush=True)
    text = report(results, args)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"gpu_speed_{args.model}.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, f"gpu_speed_{args.model}.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
