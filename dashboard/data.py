"""The dashboard's view of the run store: runs as plain dicts and tidy tables.

The store is read through `strategies.runs`, which imports no torch (nor does ``import strategies``), so a page
opens without loading it; only the planner page imports the estimator, and torch with it.
"""

from __future__ import annotations

import math
import os
from typing import Any

from strategies import runs as runstore
from strategies.runs import MEMORY_CATEGORIES as CATEGORIES

MAX_FILE_BYTES = 256 * 2**20  # a record file larger than this is not read (a page must stay responsive)


def load_runs(root: str | os.PathLike | None) -> tuple[list[dict[str, Any]], list[str]]:
    """Every readable run under ``root``, and a message for each folder that is not one and for each part of a run
    that was left out (never raises). Only the folders directly in ``root`` are read, and only their own plain
    files: a folder or file that is a link is refused by read_run, so nothing outside the store is read."""
    runs, problems = [], []
    base = runstore.runs_dir(root)
    if not base.is_dir():
        return [], []
    for folder in sorted(p for p in base.iterdir() if p.is_dir() and p.name != "wandb"):
        try:
            run = runstore.read_run(folder, max_bytes=MAX_FILE_BYTES)
        except (runstore.RunError, OSError, ValueError) as err:
            problems.append(f"Skipped: {err}")
            continue
        problems += run.pop("problems", [])
        run["id"] = folder.name
        runs.append(run)
    return runs, problems


def _num(value: Any) -> float | None:
    """A finite number as a float, else None (not a number, true/false, NaN, or an int too big for a float)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        return float(value) if math.isfinite(value) else None
    except OverflowError:
        return None


def rehearsed(run: dict[str, Any]) -> bool:
    """Whether the run is a rehearsal (`stratpack rehearse`: ranks of the job run alone on meta tensors)."""
    return run["meta"].get("kind") == "rehearsal"


def label(run: dict[str, Any]) -> str:
    """How a run is shown: strategy, ranks (and "rehearsed" for a rehearsal), and the end of its id (repeats of one
    strategy stay apart)."""
    meta = run["meta"]
    ranks = f"{meta.get('world_size', '?')}, rehearsed" if rehearsed(run) else meta.get("world_size", "?")
    return f"{meta.get('label') or run['id']} ({ranks}) #{run['id'][-4:]}"


def progress(run: dict[str, Any]) -> str:
    """How far a run got: its last step on rank 0 of the steps it was asked for, where its config says."""
    records = run["records"].get(0) or []
    last = records[-1].get("step") if records else None
    config = run["meta"].get("run_config")
    asked = config.get("steps") if isinstance(config, dict) else None
    return f"step {last if last is not None else 0}" + (f" of {asked}" if isinstance(asked, int) else "")


def final_records(run: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each rank's last record."""
    return {rank: records[-1] for rank, records in run["records"].items() if records}


def single_losses(runs: list[dict[str, Any]]) -> dict[str, list]:
    """Each comparison's loss reference: the losses of its single-process (``single``) run."""
    return {run["meta"]["comparison"]: run["summary"].get("losses") or [] for run in runs
            if run["meta"].get("label") == "single" and run["summary"] and run["meta"].get("comparison")}


def summary_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The side-by-side table: one row per run."""
    reference = single_losses(runs)
    rows = []
    for run in runs:
        meta, summary = run["meta"], run["summary"] or {}
        last = final_records(run)
        peaks = [_peak(r["memory"]) for r in last.values() if isinstance(r.get("memory"), dict)]
        allocated = [a for a in (_num(r["memory"].get("max_allocated")) for r in last.values()
                                 if isinstance(r.get("memory"), dict)) if a is not None]
        if not isinstance(summary, dict):
            summary = {}
        predicted = meta.get("predicted") if isinstance(meta.get("predicted"), dict) else {}
        pred_peaks = [sum(_num(m.get(k)) or 0 for k in CATEGORIES if k != "host")
                      for m in predicted.get("memory") or [] if isinstance(m, dict)]
        comm = summary.get("comm_per_step") or {}
        losses = summary.get("losses") or [r.get("loss") for r in run["records"].get(0, [])]
        ref = reference.get(meta.get("comparison")) if meta.get("comparison") else None
        match = None
        if ref and len(ref) == len(losses) and all(_num(x) is not None and _num(y) for x, y in zip(losses, ref)):
            match = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        degrees = meta.get("degrees") or {}
        rows.append({
            "run": run["id"], "strategy": meta.get("label"), "plan": meta.get("plan"), "status": run["status"],
            "world size": meta.get("world_size"), "dp": degrees.get("dp"), "tp": degrees.get("tp"),
            "cp": degrees.get("cp", 1 if degrees else None),  # runs from before cp existed had none
            "pp": degrees.get("pp"), "device": ", ".join(meta.get("devices") or []),
            "precision": runstore.precision_label(meta.get("precision"), meta.get("param_dtype")),
            "peak MiB/rank (measured)": max(peaks) / 2**20 if peaks else None,
            "peak MiB/rank (predicted)": max(pred_peaks) / 2**20 if pred_peaks else None,
            "allocator peak MiB/rank": max(allocated) / 2**20 if allocated else None,  # CUDA's max_allocated
            "tokens/s": _num(summary.get("tokens_per_s")), "MFU": _num(summary.get("mfu")),
            "comm KiB/step (rank 0)": sum(_num(c.get("bytes_sent")) or 0 for c in comm.values()) / 1024
            if comm else None,
            "bubble": _num((summary.get("pipeline") or {}).get("bubble_measured")),
            "final loss": _num(losses[-1]) if losses else None, "loss match vs single": match,
            "comparison": meta.get("comparison"), "model params": meta.get("num_params"),
            "wandb run": meta.get("wandb_run"),  # `wandb sync` this folder to upload an offline run
        })
    return rows


def _peak(memory: dict[str, Any]) -> float:
    """A record's peak bytes: the allocator's own peak where there is one (CUDA, and `stratpack bench`'s profiled
    CPU runs), else the model states plus the activations autograd saved."""
    allocated = _num(memory.get("max_allocated"))
    if allocated is not None:
        return allocated
    return (_num(memory.get("total")) or 0) + (_num(memory.get("activations_peak")) or 0)


def _mib(values: Any) -> str | None:
    """A list of byte counts as MiB, "a / b"; None when it is not a list."""
    return " / ".join(f"{x / 2**20:.1f}" for x in values if _num(x) is not None) if isinstance(values, list) else None


def bench_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`stratpack bench` pairs among ``runs``: one row per pair (from the run of our side), ratio ours/peer."""
    rows = []
    for run in runs:
        bench = run["meta"].get("bench")
        if not isinstance(bench, dict) or bench.get("role") != "ours":
            continue
        rows.append({
            "comparison": run["meta"].get("comparison"), "ours": bench.get("ours"), "peer": bench.get("peer"),
            "pairs": bench.get("pairs"), "ours tokens/s": _num(bench.get("ours_tokens_per_s")),
            "peer tokens/s": _num(bench.get("peer_tokens_per_s")),
            "median ratio ours/peer": _num(bench.get("median_ratio")),
            "peak MiB/rank ours": _mib(bench.get("ours_peak_bytes")),
            "peak MiB/rank peer": _mib(bench.get("peer_peak_bytes")),
            "estimate MiB/rank": _mib(bench.get("predicted_peak_bytes")),
        })
    return rows


def memory_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bytes per (run, rank, category), measured (last step) and predicted."""
    rows = []
    for run in runs:
        predicted = run["meta"].get("predicted")
        predicted = [m if isinstance(m, dict) else {} for m in (predicted.get("memory") or [])] \
            if isinstance(predicted, dict) else []
        for rank, record in sorted(final_records(run).items()):
            memory = record.get("memory") if isinstance(record.get("memory"), dict) else {}
            for category in CATEGORIES:
                key = "activations_peak" if category == "activations" else category
                value = _num(memory.get(key))
                if value is not None:
                    rows.append({"run": label(run), "rank": rank, "category": category, "source": "measured",
                                 "bytes": value})
                if rank < len(predicted) and _num(predicted[rank].get(category)) is not None:
                    rows.append({"run": label(run), "rank": rank, "category": category, "source": "predicted",
                                 "bytes": _num(predicted[rank][category])})
    return rows


def peak_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (run, rank): the peak from before the model was built to the end of the first step (set-up) and
    the steady peak, measured beside the estimator's. Measured steady: the heap's where it was sampled, CUDA's
    allocator's, else the states and saved activations; set-up on CPU without the heap: resident memory's growth."""
    rows = []
    for run in runs:
        predicted = run["meta"].get("predicted") if isinstance(run["meta"].get("predicted"), dict) else {}
        steady = [sum(_num(m.get(k)) or 0 for k in CATEGORIES if k != "host") if isinstance(m, dict) else None
                  for m in predicted.get("memory") or []]
        setup = predicted.get("setup") if isinstance(predicted.get("setup"), list) else []
        per_rank = (run["summary"] or {}).get("memory_bytes_per_rank") if isinstance(run["summary"], dict) else None
        for rank, memory in enumerate(per_rank if isinstance(per_rank, list) else []):
            if isinstance(memory, dict):
                rows.append({"run": label(run), "rank": rank,
                             "set-up MiB (measured)": _in_mib(memory.get("setup_peak")),
                             "set-up MiB (predicted)": _in_mib(setup[rank] if rank < len(setup) else None),
                             "steady MiB (measured)": _in_mib(_num(memory.get("heap_peak")) or _peak(memory)),
                             "steady MiB (predicted)": _in_mib(steady[rank] if rank < len(steady) else None)})
    return rows


def _in_mib(value: Any) -> float | None:
    return _num(value) / 2**20 if _num(value) else None


def comm_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bytes rank 0 sent per step and seconds it waited, per collective kind and axis."""
    rows = []
    for run in runs:
        for key, rec in ((run["summary"] or {}).get("comm_per_step") or {}).items():
            kind, _, axis = key.partition("/")
            rows.append({"run": label(run), "collective": kind, "axis": axis,
                         "bytes": _num(rec.get("bytes_sent")) or 0, "wait s": _num(rec.get("wait_s")) or 0})
    return rows


def expert_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Expert parallel's load balance: each MoE layer's tokens per expert, summed over the steps and the ranks that
    routed them (every rank's records; the ranks of a tp group route the same tokens, which scales a layer's experts
    alike), and each expert's share over the layer's mean (1: balanced)."""
    rows = []
    for run in runs:
        totals: dict[str, list[float]] = {}
        for records in run["records"].values():
            for record in (r for r in records if not r.get("redone")):  # (a step done again after a restart: once)
                for layer, counts in ((record.get("experts") or {}).get("tokens") or {}).items():
                    total = totals.setdefault(layer, [0.0] * len(counts))
                    totals[layer] = [a + b for a, b in zip(total, counts)]
        for layer, counts in totals.items():
            mean = sum(counts) / len(counts) if counts else 0
            rows += [{"run": label(run), "layer": layer, "expert": k, "tokens": n,
                      "load": n / mean if mean else None} for k, n in enumerate(counts)]
    return rows


def loss_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-step losses (the global mean from the summary, else rank 0's) and wall time since the start."""
    rows = []
    for run in runs:
        records = run["records"].get(0, [])
        first = records[0] if records else {}
        start = (_num(first.get("time")) or 0) - (_num(first.get("step_time_s")) or 0)
        losses = (run["summary"] or {}).get("losses")
        # the summary's losses are its last attempt's: after a restart, each record's own (rank 0's)
        losses = losses if isinstance(losses, list) and not run.get("restarts") else None
        for i, record in enumerate(records):
            loss = losses[i] if losses and i < len(losses) else record.get("loss")
            when = _num(record.get("time"))
            rows.append({"run": label(run), "step": record.get("step"), "loss": _num(loss),
                         "seconds": when - start if when is not None else None, "redone": bool(record.get("redone"))})
    return rows


def step_throughput_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tokens/s at each recorded step of rank 0, the steps done again after a restart marked."""
    return [{"run": label(run), "step": r.get("step"), "tokens/s": _num(r.get("tokens_per_s")),
             "redone": bool(r.get("redone"))} for run in runs for r in run["records"].get(0, [])]


def restart_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each restart of each run (`strategies.runs.restarts`): where it resumed, what it did again, why, what it cost."""
    rows = []
    for run in runs:
        for entry in run.get("restarts") or []:
            redone = entry.get("redone")
            rows.append({"run": label(run), "attempt": entry.get("attempt"), "step": entry.get("resumed_step"),
                         "redone": f"{redone[0]}-{redone[1]}" if redone else "none",
                         "ranks": ", ".join(map(str, entry.get("ranks") or [])) or "-",
                         "time lost s": _num(entry.get("time_lost_s")), "downtime s": _num(entry.get("downtime_s")),
                         "cause": entry.get("cause")})
    return rows


# The estimator's step-time parts (`planner.step_time`) under the measured parts' names: compute is split as a
# transformer's FLOPs split it (a forward, a backward of twice that); recompute runs inside the backward; offload's
# copies belong to the optimizer step; Lightning's loop is part of "other"; the pipeline's messages on the critical
# path are part of the bubble, as a stage's wait for its neighbour is in the measurement (`measure.split`).
_PREDICTED_AS = {"recompute": "backward", "optimizer": "optimizer", "offload": "optimizer", "loop": "other",
                 "bubble": "bubble", "dp comm": "comm dp", "tp comm": "comm tp", "cp comm": "comm cp",
                 "pp comm": "bubble"}


def step_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where a step's time goes, seconds per part, for each run: every rank's measured mean over the timed steps
    (the records' ``split`` and comm waits, `strategies.measure.split.breakdown`), and the estimator's prediction
    where the run has one (``bar`` "predicted")."""
    from strategies.measure.split import breakdown  # no torch: the module imports only the standard library

    rows = []
    for run in runs:
        name = f"{run['meta'].get('label') or run['id']} #{run['id'][-4:]}"
        for rank, records in sorted(run["records"].items()):
            timed = _timed(run, records)
            if not timed:
                continue
            parts: dict[str, float] = {}
            for record in timed:
                # The schema lets a split's numbers be null and does not look inside comm: keep numbers only.
                split = {k: _num(v) or 0.0 for k, v in record["split"].items()}
                comm = record.get("comm") if isinstance(record.get("comm"), dict) else {}
                waits = {k: {"wait_s": _num(c.get("wait_s")) or 0.0} for k, c in comm.items() if isinstance(c, dict)}
                for part, seconds in breakdown(_num(record.get("step_time_s")) or 0.0, split, waits).items():
                    parts[part] = parts.get(part, 0.0) + seconds / len(timed)
            rows += [{"strategy": name, "bar": f"rank {rank}", "part": p, "seconds": s, "run": run["id"]}
                     for p, s in parts.items()]
        predicted = run["meta"].get("predicted")
        step = predicted.get("step_time") if isinstance(predicted, dict) else None
        if isinstance(step, dict):
            rows += [{"strategy": name, "bar": "predicted", "part": p, "seconds": s, "run": run["id"]}
                     for p, s in _predicted_parts(step).items()]
    return rows


def _timed(run: dict[str, Any], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records with a split after the run's warm-up steps (its config's; else all but the first)."""
    config = run["meta"].get("run_config")
    warmup = config.get("warmup_steps") if isinstance(config, dict) else None
    warmup = warmup if isinstance(warmup, int) else 1
    split = [r for r in records if isinstance(r.get("split"), dict)]
    after = [r for r in split if isinstance(r.get("step"), int) and r["step"] > warmup]
    return after or split[-1:]


def _predicted_parts(step: dict[str, Any]) -> dict[str, float]:
    compute = _num(step.get("compute")) or 0.0
    parts = {"forward": compute / 3, "backward": 2 * compute / 3}
    for key, value in step.items():
        if key in _PREDICTED_AS and _num(value):
            parts[_PREDICTED_AS[key]] = parts.get(_PREDICTED_AS[key], 0.0) + _num(value)
    return parts
