"""`stratpack plan` for the user's own model (`--workload`, `--hf-config`), and a config.json's model rehearsed."""

from __future__ import annotations

import json
import re

import pytest

from demos.sizes import CONFIGS
from strategies.cli import main as cli_main

COMMON = ["--gpus", "8", "--gpu-mem", "80", "--seq", "8192", "--global-batch", "16", "--top", "5"]


def _config_json(folder, model_type: str, **values) -> str:
    """A config.json as a downloaded model's folder holds one: its own dtype and longest sequence."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, **values, "dtype": "bfloat16",
                                                    "max_position_embeddings": 131072}))
    return str(folder)


def _planned(capsys) -> tuple[str, list[str]]:
    out = capsys.readouterr().out
    return out, [line.split()[0] for line in out.splitlines() if line.startswith("  ")]


def test_a_workload_and_its_config_json_are_planned_alike(tmp_path, capsys):
    folder = _config_json(tmp_path / "llama3-8b", "llama", **CONFIGS["llama3-8b"][2])
    assert cli_main(["plan", "--workload", "llama3-8b", *COMMON]) == 0
    by_name, plans = _planned(capsys)
    assert cli_main(["plan", "--hf-config", folder, *COMMON]) == 0
    by_file, same = _planned(capsys)
    assert len(plans) == 5 and plans == same
    # Llama 3 8B's own count (8.03e9), grouped keys, and --seq rather than the config's longest sequence
    for out in (by_name, by_file):
        assert "8.03e+09 parameters as 32 layers x 4096 wide, 32 heads, 8 key/value heads, sequence 8192" in out


def test_a_mixture_of_experts_config_is_planned_with_its_experts(tmp_path, capsys):
    folder = _config_json(tmp_path / "moe", "mixtral", hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                          num_attention_heads=16, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                          vocab_size=32000)
    assert cli_main(["plan", "--hf-config", folder, *COMMON[:-1], "200"]) == 0
    out, plans = _planned(capsys)
    assert "8 experts (top 2)" in out and any(re.search(r"_ep\d", p) for p in plans), out[:600]


def test_a_missing_or_unreadable_config_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli_main(["plan", "--hf-config", str(tmp_path / "nowhere")]) == 2
    assert "No such file" in capsys.readouterr().err
    folder = _config_json(tmp_path / "vision", "vit", hidden_size=64)
    assert cli_main(["plan", "--hf-config", folder]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a transformer's config the planner reads" in err[0]


def test_the_config_json_s_model_is_built_and_rehearsed_in_the_runs_dtype(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--workload llama3-8b names another"):
        cli_main(["rehearse", "zero3", "--world-size", "2", "--hf-config", "x", "--workload", "llama3-8b",
                  "--target", "cuda"])
    folder = _config_json(tmp_path / "tiny", "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)
    assert cli_main(["rehearse", "zero3", "--world-size", "2", "--hf-config", folder, "--target", "cuda",
                     "--seq-len", "32", "--runs-dir", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    # The built model's parameters (fp32 under 32-true, though the config says bfloat16), ZeRO-3's half of
    # 106,816, as the estimator reads the same config: 0.20 MiB each
    rehearsed, predicted = re.search(r"params\s+([\d.]+)\s+([\d.]+)", out).groups()
    assert rehearsed == predicted == f"{106_816 * 4 / 2 / 2**20:.2f}", out
