"""What the tests share: a tiny model, fixed batches and a training loop to compare a distributed run against one
process with, and `train_demo`, which trains the demo GPT through `stratpack train` in a subprocess.

The multi-rank launcher itself is public (`strategies.testing.run_ranks`): users may want it for their own tests.
"""

from __future__ import annotations

import contextlib
import json
import os
from functools import partial

import torch

from strategies.clipping import clip_pieces
from tests import lane
from tests import python as interpreter


class TinyNet(torch.nn.Module):
    """Two linear layers and a bias-free head: 3*13+13 + 13*7+7 + 7*3 = 171 parameters, odd on purpose."""

    def __init__(self, d_in: int = 3, hidden: int = 13, mid: int = 7, d_out: int = 3) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.fc2 = torch.nn.Linear(hidden, mid)
        self.head = torch.nn.Linear(mid, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def global_batches(steps: int, batch: int, seed: int = 0, d_in: int = 3, d_out: int = 3):
    """``steps`` fixed (x, y) global batches of ``batch`` rows."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)) for _ in range(steps)]


def train(model, optimizer, batches, accum: int = 1, shard: tuple[int, int] = (0, 1), sync=None,
          clip: float | None = None):
    """Train on ``batches``: each global batch is cut into ``accum`` micro-batches and each micro-batch into
    ``shard[1]`` equal row blocks, of which this rank takes block ``shard[0]``. ``sync`` (a GradSync) averages
    gradients after the last micro-batch (and, for ZeRO, gathers the updated shards after the step).
    ``clip``: clip by the global gradient norm. Returns this rank's per-step losses (mean over its rows);
    their mean over the ranks is the single-process loss of the global batch."""
    rank, world = shard
    losses = []
    for x, y in batches:
        total = torch.zeros(())
        for micro, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            xs, ys = xm.chunk(world)[rank], ym.chunk(world)[rank]
            loss = torch.nn.functional.mse_loss(model(xs), ys) / accum
            last = micro == accum - 1
            context = sync.no_sync() if sync is not None and not last else _nullcontext()
            with context:
                loss.backward()
                if sync is not None:
                    sync.finish()
            total += loss.detach()
        if clip is not None:
            _clip(model, sync, clip)
        optimizer.step()
        if sync is not None:
            sync.after_step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total.item())
    return losses


def _nullcontext():
    return contextlib.nullcontext()


def _clip(model, sync, max_norm: float) -> None:
    """Clip by the global gradient norm: under ZeRO each rank's shards, summed over the data-parallel axis."""
    flats = getattr(sync, "flats", None)
    if flats is None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return
    grads = [(flat.master.grad, None) for flat in flats if flat.master.grad is not None]
    clip_pieces(grads, max_norm, disjoint=[sync.axis], device=flats[0].full.device if flats else None)


# -- Trainer-level runs of the demo GPT (tests/e2e): one `stratpack train` per strategy ------------------------

# fp32 tolerances of a distributed run against one process: losses rel 1e-5 / abs 1e-6; parameters rel 1e-5 /
# abs 5e-5 (attention's key bias has an exact gradient of zero, whose float noise AdamW's normalised update
# turns into steps of a few 1e-6; see tests/e2e/test_trainer.py).
RTOL, ATOL, PARAM_ATOL = 1e-5, 1e-6, 5e-5
DEEP = ("--n-layer", "4")  # four blocks: enough for pp4, and for pp2 with two virtual stages each
COMMON = ["--steps", "5", "--batch-size", "8", "--seq-len", "32", "--n-embd", "32", "--max-chars", "20000"]

# The 3D plan at 8 ranks (ZeRO-3 shards, tp slices, 1F1B stages and recompute on every rank together) at the heap
# tests' size, built in configure_model (a rehearsal never makes values), plain SGD (no optimizer state to hide a
# gradient's size behind), its heap sampled from the first step.
REAL_3D = "zero3_tp2_pp2_1f1b_ac"
REAL_3D_SIZE = ("--n-layer", "4", "--n-embd", "128", "--n-head", "4", "--seq-len", "128", "--batch-size", "16")
REAL_3D_RUN = ("--steps", "3", "--optimizer", "sgd-plain", "--configure-model", *REAL_3D_SIZE)


def run_job(script: str, folder, *args: str, timeout_s: float = 600, collective_timeout: str = "120",
            env: dict[str, str] | None = None, hf: bool = False):
    """Run a job script (a set of Trainer fits in one set of ranks: Lightning's popen launcher re-runs it for the
    other ranks) in ``folder``, with this checkout importable; what it saved at ``folder/results.pt``. ``hf``: it
    builds Hugging Face models (`tests/python.py`)."""
    out = folder / "results.pt"
    env = {**os.environ, "STRATPACK_TIMEOUT": collective_timeout, "STRATPACK_RUNS": str(folder / "runs"),
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    exe = interpreter.full() if hf else interpreter.core()
    proc = lane.run([exe, script, str(out), *args], cwd=folder, timeout=timeout_s, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out), proc


def train_demo(tmp_path, strategy: str, devices: int, *extra: str, launcher: tuple[str, ...] = (),
               timeout_s: float = 420) -> tuple[dict, dict]:
    """Train the demo GPT with ``strategy`` on ``devices`` CPU ranks (a subprocess); return the run's result
    and its final parameters (the single-device layout)."""
    out, params = tmp_path / f"{strategy}-{devices}.json", tmp_path / f"{strategy}-{devices}.pt"
    python = list(launcher) or [interpreter.for_args(extra)]
    cmd = [*python, "-m", "strategies.cli", "train", strategy, "--devices", str(devices),
           "--out", str(out), "--params-out", str(params), *COMMON, *extra]
    env = {**os.environ, "STRATPACK_TIMEOUT": os.environ.get("STRATPACK_TIMEOUT", "120"),
           "STRATPACK_RUNS": str(tmp_path / "runs")}
    if "--wandb" not in extra:
        cmd += ["--wandb", "off"]  # wandb's offline service costs seconds a run; tested on its own
    proc = lane.run(cmd, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"{strategy} on {devices} ranks failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    check = result.get("first_batch_check")  # on by default for a plan (off with --heap): it ran, and passed
    if check is not None and not {"--no-check-first-batch", "--configure-model"} & set(extra):
        assert check["skipped"] is None and abs(check["plan"] - check["reference"]) <= \
            check["tolerance"] * abs(check["reference"]), check
    # Set-up memory is measured on every rank (peak from before the model was built to the end of the first step).
    assert all(m["setup_peak"] > 0 for m in result["memory_bytes_per_rank"]), result["memory_bytes_per_rank"]
    return result, torch.load(params)


def demo_run(factory, key: str, strategy: str, devices: int, *extra: str) -> tuple[dict, dict]:
    """`train_demo`'s (result, parameters) of ``strategy`` on ``devices`` ranks with ``extra``, in a folder of its own:
    run ahead on the suite's second lane (tests/lane.py) where `demo_runs_ahead` queued ``key``, else here, once."""
    return lane.result(key, partial(_demo_in, factory, strategy, devices, extra))


def demo_runs_ahead(name: str, reads, runs) -> None:
    """Queue a test file's `demo_run`s on the lane: ``reads(item)``, whether a test reads them; ``runs(readers)``,
    {key: (strategy, devices, *extra)} the selected readers need, in their order."""
    lane.register(name, reads, lambda factory, readers: [
        (key, partial(_demo_in, factory, args[0], args[1], tuple(args[2:]))) for key, args in runs(readers).items()])


def _demo_in(factory, strategy: str, devices: int, extra: tuple) -> tuple[dict, dict]:
    return train_demo(factory.mktemp(strategy), strategy, devices, *extra)


def record_figure(test: str, **values) -> None:
    """Append a sampled figure a test compares (a heap peak beside its estimate, an elapsed time) to the JSON-lines
    file ``STRATPACK_TEST_FIGURES`` names, if any: `scripts/stress.sh` reads the spread over many runs from it."""
    path = os.environ.get("STRATPACK_TEST_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **values}) + "\n")
