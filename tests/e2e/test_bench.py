"""`stratpack bench` end to end on a tiny model: the report, the run store entries and the dashboard's table.
Speed is not asserted (a benchmark is not a timed test): only that every figure is there and consistent."""

from __future__ import annotations

import csv
import os
import subprocess

import pytest

from dashboard import data
from strategies import runs as runstore
from strategies.cli.bench import plan_of
from strategies.measure.monitor import keep_record
from tests import python

TINY = ["--repeat", "1", "--steps", "3", "--warmup-steps", "1", "--n-layer", "2", "--n-embd", "32", "--seq-len",
        "16", "--batch-per-rank", "4"]


def test_bench_writes_report_and_run_store_the_dashboard_shows(tmp_path):
    runs, md, table = tmp_path / "runs", tmp_path / "bench.md", tmp_path / "bench.csv"
    proc = subprocess.run([python.core(), "-m", "strategies.cli", "bench", "--pairs", "dp,pp-1f1b", *TINY,
                           "--runs-dir", str(runs), "--report", str(md), "--report", str(table)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(table.open()))
    assert [(r["ours"], r["peer"]) for r in rows] == [("dp", "torch_ddp"), ("pp_1f1b", "torch_pp_1f1b")]
    for r in rows:
        ours, peer = float(r["ours_tokens_per_s"]), float(r["peer_tokens_per_s"])
        assert ours > 0 and peer > 0 and float(r["median_ratio"]) == pytest.approx(ours / peer, rel=1e-3)
        for side in ("ours", "peer", "predicted"):
            peaks = [float(x) for x in r[f"{side}_peak_MiB_per_rank"].split()]
            assert len(peaks) == 2 and all(p > 0 for p in peaks), (side, r)
    assert "| dp | torch DDP |" in md.read_text() and "| pp 1F1B | torch Schedule1F1B |" in md.read_text()

    loaded, problems = data.load_runs(runs)
    assert not problems and len(loaded) == 4
    assert {r["meta"]["comparison"] for r in loaded} == {proc.stdout.split("comparison id: ")[1].split()[0]}
    for run in loaded:
        assert run["status"] == "complete" and sorted(run["records"]) == [0, 1]
        assert all([r["step"] for r in recs] == [1, 2, 3] for recs in run["records"].values())
        assert all(recs[-1]["memory"]["max_allocated"] > 0 for recs in run["records"].values())
    bench = data.bench_rows(loaded)
    assert [(b["ours"], b["peer"]) for b in sorted(bench, key=lambda b: b["ours"])] == [
        ("dp", "torch_ddp"), ("pp_1f1b", "torch_pp_1f1b")]
    # The peer is predicted by the estimate of the plan that does the same (DDP: dp; Schedule1F1B: pp2_1f1b).
    assert plan_of("torch_ddp", 2) == "dp" and plan_of("torch_pp_1f1b", 2) == "pp2_1f1b_mb4"
    assert {r["meta"]["label"]: r["meta"]["predicted"] is not None for r in loaded} == {
        "dp": True, "torch DDP": True, "pp 1F1B": True, "torch Schedule1F1B": True}

    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    os.environ[runstore.RUNS_ENV] = str(runs)
    try:
        at = AppTest.from_file(os.path.join(os.path.dirname(__file__), "..", "..", "dashboard", "app.py"),
                               default_timeout=60)
        at.run()
    finally:
        del os.environ[runstore.RUNS_ENV]
    assert not at.exception
    assert any("stratpack bench" in h.value for h in at.subheader)
    shown = at.dataframe[1].value
    assert sorted(shown["ours"]) == ["dp", "pp_1f1b"] and all(shown["median ratio ours/peer"] > 0)


def test_records_thin_out_geometrically_for_long_runs():
    kept = [s for s in range(1, 10_001) if keep_record(s, full_steps=1000)]
    assert kept[:1000] == list(range(1, 1001))  # every step at first
    assert kept[1000:1003] == [1002, 1004, 1006] and 4008 in kept and 4004 not in kept
    assert len(kept) == 2625  # 1000 + 500 + 500 + 625 (4001..10000 every 8th)
    assert sum(keep_record(s) for s in range(1, 1_000_001)) < 6000  # a million steps: under 6,000 records


def test_the_expert_parallel_side_of_its_pair_trains_and_is_predicted():
    """The ep pair's own side (the peer, DeepSpeed-MoE, runs where DeepSpeed is installed: not in CI): the demo GPT's
    MoE, 2 experts per rank, its estimate that of `ep2`."""
    from strategies.cli.bench import BenchConfig, _train, pair_config, predict
    from strategies.testing import run_ranks

    cfg = pair_config("ep", BenchConfig(steps=2, warmup_steps=1, n_layer=2, n_embd=32, seq_len=16, batch_per_rank=4))
    assert cfg.experts == 4 and plan_of("deepspeed_moe", 2) == "ep2"
    ranks = run_ranks(_train, 2, "ep", cfg, timeout_s=120)
    assert all(r["tokens_per_s"] > 0 for r in ranks)
    assert predict("ep", cfg)["comm"]["all_to_all/ep"] > 0


def test_the_one_device_bench_writes_its_table_traces_and_a_comparison_the_dashboard_shows(tmp_path):
    # `--accelerator gpu`'s rows (`bench_gpu`) on the CPU at a tiny size: a plain loop and a plan, one traced. Speed
    # is not asserted; that every figure is there, and the traced row's device split is read off its trace.
    runs, md, folder = tmp_path / "runs", tmp_path / "gpu.md", tmp_path / "out"
    proc = subprocess.run([python.core(), "-m", "strategies.cli", "bench", "--rows", "plain,dp", "--profile", "dp",
                           "--steps", "7", "--warmup-steps", "4", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
                           "--seq-len", "16", "--batch-size", "4", "--precision", "32-true", "--runs-dir", str(runs),
                           "--folder", str(folder), "--report", str(md)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = md.read_text()
    assert "| plain |" in table and "| dp |" in table and "| 1.000 |" in table  # plain against itself
    # the device's own speed, timed before each row, in the row's last cell: "TFLOP/s, GB/s", both above zero
    probes = [line.rstrip(" |").rsplit("| ", 1)[1] for line in table.splitlines()
              if line.startswith(("| plain", "| dp"))]
    assert len(probes) == 2 and all(float(x.replace(",", "")) > 0 for p in probes for x in p.split(", ")), probes
    traced = folder / "profile-dp"
    assert {p.name for p in traced.iterdir()} == {"trace.json.gz", "ops.txt", "split.json"}
    loaded, problems = data.load_runs(runs)
    assert not problems and sorted(r["meta"]["label"] for r in loaded) == ["dp", "plain"]
    assert len({r["meta"]["comparison"] for r in loaded}) == 1
    assert all(r["summary"]["tokens_per_s"] > 0 for r in loaded)


def test_the_gpu_bench_says_what_to_do_where_no_gpu_is_visible(capsys):
    from strategies.cli import main

    assert main(["bench", "--accelerator", "gpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_zero3_under_param_dtype_sends_fsdp2s_bytes_under_its_mixed_precision_policy():
    """ZeRO-3 under ``param_dtype=bf16`` and FSDP2 under ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)``, the same model and loop (the bench pair `zero3-fsdp2-bf16`), counted at the same calls: the
    same reduce-scatter (float32 gradients) and the same all-gather, in bf16. FSDP2's root group (the embeddings, the
    final norm and the head) is gathered once and kept from forward to backward; ours frees the embeddings after
    forward and does not gather them for backward (a lookup's backward needs no weights), and keeps the final norm
    and the head (`Zero3GradSync._keeps`). Planted: the float32 gather (twice the bytes), or the embeddings and the
    norm gathered again for backward as before (+2 x 2,816 B), fail."""
    from strategies.cli.bench import BenchConfig, _train
    from strategies.cli.workload import find_workload
    from strategies.testing import run_ranks

    cfg = BenchConfig(steps=2, warmup_steps=1, n_layer=2, n_embd=32, seq_len=16, batch_per_rank=4)
    ours, peer = (run_ranks(_train, 2, impl, cfg, timeout_s=120)[0]["bytes_per_step"]
                  for impl in ("zero3_bf16", "fsdp2_bf16"))
    model = find_workload(cfg.workload).bench_model(cfg)
    psi = sum(p.numel() for p in model.parameters())
    assert ours["reduce_scatter"] == peer["reduce_scatter"] == 1 / 2 * psi * 4  # (psi even: no padding at 2)
    assert ours["all_gather"] == peer["all_gather"]
