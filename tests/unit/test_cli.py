"""What `stratpack` says before it runs anything: help for users, and one line (exit 2) for a missing extra."""

from __future__ import annotations

import sys

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
