"""What `stratpack` says before it runs anything: help for users, and one line (exit 2) for a missing extra."""

from __future__ import annotations

import sys

import pytest

from strategies import cli


def test_help_lists_the_everyday_commands_first_and_no_developer_notes(capsys):
    try:
        cli.main(["--help"])
    except SystemExit:
        pass
    text = capsys.readouterr().out
    commands = text.split("positional arguments:", 1)[1]
    order = sorted(("compare", "train", "plan", "rehearse", "dashboard", "convert", "bench", "sweep"),
                   key=lambda name: commands.index(f"\n    {name} "))
    assert order == ["compare", "train", "plan", "rehearse", "dashboard", "convert", "bench", "sweep"], order
    assert "add_parser" not in text and "One module per command" not in text


def test_a_workload_whose_library_is_missing_says_which_extra_in_one_line(monkeypatch, capsys):
    import lightning.pytorch  # noqa: F401  (and torchmetrics, which imports transformers where its metadata says so)

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: importing it raises ImportError
    code = cli.main(["rehearse", "zero3", "--world-size", "8", "--workload", "demos.sizes:LLAMA3_8B",
                     "--target", "cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "needs transformers" in err[0] and "pip install 'stratpack[models]'" in err[0]


def test_a_rehearsal_without_a_batch_gets_one_that_splits_over_its_data_ranks(capsys):
    import argparse

    from strategies.cli.rehearse import _batch

    def batch(plan: str, world: int | None, given: int | None = None, matrix: bool = False) -> int:
        return _batch(argparse.Namespace(plan=plan, world_size=world, batch_size=given, matrix=matrix, anchors=False))

    assert batch("zero3", 64) == 64 and "splits over the job's 64" in capsys.readouterr().err
    assert batch("zero3_tp8_pp16", 1024) == 16 and capsys.readouterr().err == ""  # 8 data ranks: 16 splits
    assert batch("zero3", 24) == 24 and batch("dp", 4) == 16 and batch("zero3", 64, given=8) == 8
    assert batch("zero3", None) == 16 and batch("zero3", 64, matrix=True) == 16


def test_convert_finds_the_lightning_modules_name_for_the_model_where_only_one_fits():
    from strategies.checkpoint.pretrained import model_prefix

    names = {"model.embed_tokens.weight", "lm_head.weight"}
    assert model_prefix(names, {"net.model.embed_tokens.weight", "net.lm_head.weight", "loss.w"}) == "net."
    assert model_prefix(names, set(names)) == ""  # saved bare
    assert model_prefix(names, {"a.model.embed_tokens.weight", "a.lm_head.weight", "b.model.embed_tokens.weight",
                                "b.lm_head.weight"}) == ""  # two fit: the user says which
    assert model_prefix(names, {"net.model.embed_tokens.weight"}) == ""  # the head missing: none fits


def test_a_rehearsal_whose_given_batch_does_not_split_says_so_in_one_line():
    # (DataLoader's "batch_size=0" from inside the rehearsal, before)
    with pytest.raises(SystemExit) as stop:
        cli.main(["rehearse", "zero3", "--world-size", "2", "--batch-size", "1", "--target", "cuda"])
    said = str(stop.value.code)
    assert "--batch-size 1 does not split over the 2 data-parallel ranks" in said and "multiple of 2" in said


def test_compare_shows_each_runs_precision_and_a_plans_param_dtype():
    from strategies.cli.compare import format_table

    def run(label: str, **config) -> dict:
        return {"label": label, "world_size": 2, "losses": [1.0], "tokens_per_s": 1.0, "config": config}

    table = format_table([run("single", precision="bf16-mixed", param_dtype="bf16"),
                          run("zero3", precision="bf16-mixed", param_dtype="bf16"),
                          run("dp", precision="32-true")], "single")
    rows = {line.split()[0]: line for line in table.splitlines()[2:5]}
    assert rows["zero3"].endswith("  bf16-mixed, param_dtype bf16") and rows["dp"].endswith("  32-true")
    assert rows["single"].endswith("  bf16-mixed")  # (one device, not a plan: no param_dtype)
