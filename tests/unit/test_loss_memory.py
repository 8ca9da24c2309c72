"""The vocabulary-parallel loss holds the logits in float32 once (shifted, exponentiated and normalised in place, as
Megatron's), rehearsed where the loss is the rank's peak: Llama 3 8B's width and vocabulary, one block, 8 x 2,048
tokens, `tp2_sp_vp`, bf16-mixed. Rehearsed 20,425 MiB against the estimator's 20,294; with the three float32 copies
it made before (a cast, the shifted logits, their exponential), 22,685: 12% over, which fails here."""

from __future__ import annotations

import json

import pytest

from strategies.cli import main as cli_main


def test_the_vocab_parallel_loss_holds_one_float32_copy_of_the_logits(tmp_path, capsys):
    out = tmp_path / "rehearsal.json"
    assert cli_main(["rehearse", "tp2_sp_vp", "--world-size", "2", "--rank", "0", "--workload", "llama3-8b",
                     "--n-layer", "1", "--batch-size", "8", "--seq-len", "2048", "--precision", "bf16-mixed",
                     "--optimizer", "sgd", "--target", "cuda", "--out", str(out), "--runs-dir", str(tmp_path / "runs"),
                     "--wandb", "off"]) == 0
    capsys.readouterr()
    (r,) = json.loads(out.read_text())
    predicted = sum(v for k, v in r["predicted"]["memory"][0].items() if k != "host")
    assert r["device_peak"] == pytest.approx(predicted, rel=0.03), (r["device_peak"] / 2**20, predicted / 2**20)
