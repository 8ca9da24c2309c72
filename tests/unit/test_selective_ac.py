"""Selective activation checkpointing (``sac``): the same bits as no recompute, and the memory the estimator says.

Across ranks, through the Trainer, `tp2_sp_sac` and `pp2_mb4_sac` match one process under plain SGD (`_sgd_job`);
tp's bytes under sac are rehearsed against the estimator in `test_rehearse` (`tp2_sp_sac`)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from demos.gpt import GPT, GPTConfig
from strategies.activation_checkpoint import apply_activation_checkpointing
from strategies.cli import main as cli_main


def _step(model, ids, mode: str | None, autocast: bool):
    model = copy.deepcopy(model)
    if mode:
        apply_activation_checkpointing(model.blocks, selective=mode == "sac")
    torch.manual_seed(1)  # dropout's masks: recompute must draw the forward's again
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-mixed"])
def test_selective_recompute_gives_the_gradients_bit_for_bit(autocast: bool):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, seq_len=16, dropout=0.1))
    ids = torch.randint(0, 128, (2, 16))
    plain = _step(model, ids, None, autocast)
    for mode in ("sac", "ac"):
        assert all(torch.equal(a, b) for a, b in zip(_step(model, ids, mode, autocast), plain)), mode


def _peak(tmp_path, capsys, plan: str) -> tuple[float, float]:
    """Rank 0 of ``plan`` at one rank rehearsed (demo GPT, 8 x 256 x 256, 4 blocks, fp32: activations are most of
    the peak): (rehearsed steady peak, the estimator's)."""
    out = tmp_path / f"{plan}.json"
    assert cli_main(["rehearse", plan, "--world-size", "1", "--n-layer", "4", "--n-embd", "256", "--seq-len", "256",
                     "--batch-size", "8", "--target", "cuda", "--out", str(out), "--runs-dir",
                     str(tmp_path / "runs"), "--wandb", "off"]) == 0
    capsys.readouterr()
    (r,) = json.loads(out.read_text())
    return r["device_peak"], sum(v for k, v in r["predicted"]["memory"][0].items() if k != "host")


def test_selective_recompute_peaks_between_none_and_full_where_the_estimator_says(tmp_path, capsys):
    # Rehearsed 177.2 (none), 149.1 (sac), 90.1 MiB (ac); the estimator 178.9, 152.9, 92.9. What sac keeps (the
    # matmuls' and attention's outputs) is a third of a block's saved activations here.
    none, sac, full = (_peak(tmp_path, capsys, plan) for plan in ("dp", "dp_sac", "dp_ac"))
    assert full[0] < 0.9 * sac[0] < 0.9 * none[0]
    assert sac[0] == pytest.approx(sac[1], rel=0.05)
