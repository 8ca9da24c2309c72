"""The documentation holds: README.md is a front page (at most 300 lines, the two set-up commands CI runs), every
relative link in README.md and docs/*.md resolves (the file, and the heading where it names one), every ```python
block runs, and every `stratpack ...` command line parses.

Python blocks: each runs here, in this process, in a namespace of its own with nothing in it (no preamble: an
example imports what it uses, so that a reader can paste it), in a temporary working directory. Two kinds run
elsewhere: a block that trains (calls ``.fit(``) runs as a script in tests/e2e/test_docs_fit.py, since Lightning's
launcher re-runs ``sys.argv`` for the other ranks; and a block whose previous line is ``<!-- needs: gpu -->`` is
skipped, saying so.

Command lines: every ``stratpack`` (or ``.venv/bin/stratpack``) command in a code block or in inline code is split
as a shell would (``&&``, ``||``, ``;`` and ``|`` chains, comments, redirections dropped) and given to the CLI's own
parser, in ``strategies.cli.main``, whose parsing is stopped before any command runs. A bare ``stratpack <command>``
in prose names a command (``stratpack train`` needs a plan to run): it must name one that exists.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shlex
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GPU_MARK = "<!-- needs: gpu -->"
SETUP_COMMANDS = [
    "bash scripts/setup.sh && .venv/bin/stratpack compare && .venv/bin/stratpack dashboard",
    "bash scripts/setup.sh --dev && .venv/bin/ruff check . && .venv/bin/python -m pytest -q",
]
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    """A fenced code block: its page, the line of its first line of code (1-based), language, code, GPU mark."""

    page: pathlib.Path
    line: int
    lang: str
    code: str
    needs_gpu: bool

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def trains(self) -> bool:
        return ".fit(" in self.code


def blocks(page: pathlib.Path) -> list[Block]:
    """The fenced code blocks of ``page``, in order."""
    lines, found, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a code block that is never closed"
        marked = i > 0 and lines[i - 1].strip() == GPU_MARK
        found.append(Block(page, i + 2, opening.group(2), "\n".join(lines[i + 1:end]) + "\n", marked))
        i = end + 1
    return found


def prose(page: pathlib.Path) -> str:
    """``page`` without its fenced code blocks (their lines blanked, so that line numbers stay)."""
    lines, inside = page.read_text().splitlines(), False
    for i, line in enumerate(lines):
        fence = bool(_FENCE.match(line)) or (inside and line.strip() == "```")
        if fence or inside:
            lines[i] = ""
        if fence:
            inside = not inside
    return "\n".join(lines)


def python_blocks(*, trains: bool) -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.lang == "python" and b.trains == trains]


# -- the front page and its links ------------------------------------------------------------------------------


def test_readme_is_a_front_page_of_at_most_300_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_readme_has_the_two_set_up_commands_ci_runs():
    section = (ROOT / "README.md").read_text().split("\n## Set up\n", 1)[1].split("\n## ", 1)[0]
    commands = [line for b in blocks_of_text(section) for line in b.splitlines() if "scripts/setup.sh" in line]
    assert commands == SETUP_COMMANDS
    ci = (ROOT / ".ci" / "run").read_text()
    assert SETUP_COMMANDS[1] in ci


def blocks_of_text(text: str) -> list[str]:
    return re.findall(r"^```\w*\n(.*?)^```$", text, flags=re.S | re.M)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    return {_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", prose(page), flags=re.M)}


def _links() -> list[tuple[str, pathlib.Path, str]]:
    found = []
    for page in PAGES:
        for number, line in enumerate(prose(page).splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if not re.match(r"^[a-z]+:", target):
                    found.append((f"{page.relative_to(ROOT)}:{number}", page, target))
    return found


@pytest.mark.parametrize("where,page,target", _links(), ids=[f"{w} {t}" for w, _, t in _links()])
def test_every_relative_link_resolves(where, page, target):
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    assert resolved.exists(), f"{where}: {target} is not there ({resolved})"
    if anchor:
        assert anchor in _anchors(resolved), f"{where}: {resolved.name} has no heading #{anchor}"


def test_the_docs_pages_are_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    topics = [p for p in PAGES[1:] if not re.search(r"-\d{4}-\d\d-\d\d", p.name)]  # the dated reports are quoted
    assert len(topics) >= 10 and [p.name for p in topics if f"](docs/{p.name})" not in readme] == []


# -- python examples -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", python_blocks(trains=False), ids=lambda b: b.where)
def test_python_example_runs(block, tmp_path, monkeypatch):
    if block.needs_gpu:
        pytest.skip(f"{block.where} is marked {GPU_MARK}")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__doc_example__"}
    code = "\n" * (block.line - 1) + block.code  # so that a traceback names the page's own line
    exec(compile(code, str(block.page), "exec"), namespace)  # noqa: S102 - the docs' own examples


def test_a_block_marked_as_needing_a_gpu_is_recognised(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"text\n\n{GPU_MARK}\n```python\nimport torch\n```\n\n```python\nx = 1\n```\n")
    assert [(b.line, b.needs_gpu) for b in blocks(page)] == [(5, True), (9, False)]


def test_the_examples_are_found():
    # The page parser finds the blocks (a regression that found none would make every test above vacuous).
    assert len(python_blocks(trains=False)) >= 3 and len(python_blocks(trains=True)) >= 1
    assert len(commands()) >= 20


# -- stratpack command lines -----------------------------------------------------------------------------------


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__("parsed")
        self.namespace = namespace


def stratpack_args(line: str) -> list[list[str]]:
    """Each ``stratpack`` command of a shell line, as its argument list (after ``stratpack``)."""
    found = []
    for segment in re.split(r"&&|\|\||;|\|", line):
        try:
            words = shlex.split(segment, comments=True)
        except ValueError as e:
            raise AssertionError(f"not a shell line: {line!r} ({e})") from e
        if not words or words[0].removeprefix(".venv/bin/") != "stratpack":
            continue
        args, skip = [], False
        for word in words[1:]:
            if skip:
                skip = False
            elif re.fullmatch(r"\d*[<>]{1,2}&?", word):  # a redirection, its target next
                skip = True
            elif not re.fullmatch(r"\d*(>{1,2}|<)&?[^<>]+", word) or re.fullmatch(r"<[^<>]*>", word):
                args.append(word)  # all but a redirection with its target (`2>&1`, `>out`); `<plan>` stays
        found.append(args)
    return found


def commands() -> list[tuple[str, bool, list[str]]]:
    """(where, whether inline, its arguments) of every stratpack command in the docs, in code blocks and inline
    code."""
    found = []
    for page in PAGES:
        name = page.relative_to(ROOT)
        for block in blocks(page):
            if block.lang not in ("bash", "sh", "shell", "console", ""):
                continue
            for offset, line in enumerate(block.code.splitlines()):
                found += [(f"{name}:{block.line + offset}", False, args) for args in stratpack_args(line)]
        text = prose(page)
        for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
            inline = " ".join(span.group(1).split())
            if re.match(r"(\.venv/bin/)?stratpack\s", inline) or "&& .venv/bin/stratpack" in inline:
                where = f"{name}:{text.count(chr(10), 0, span.start()) + 1}"
                found += [(where, True, args) for args in stratpack_args(inline)]
    return found


def parse(args: list[str]) -> argparse.Namespace:
    """``args`` through the parser `strategies.cli.main` builds, stopped before the command runs."""
    from strategies import cli

    real = argparse.ArgumentParser.parse_args

    def parse_only(parser, argv=None, namespace=None):
        raise _Parsed(real(parser, argv, namespace))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
        try:
            cli.main(args)
        except _Parsed as parsed:
            return parsed.namespace
        except SystemExit as e:
            raise AssertionError(f"stratpack {shlex.join(args)}: the parser refuses it (exit {e.code})") from e
    raise AssertionError("strategies.cli.main returned without parsing")


def _names() -> set[str]:
    from strategies import cli

    return {module.__name__.rsplit(".", 1)[-1].replace("_", "-") for module in cli.COMMANDS}


@pytest.mark.parametrize("where,inline,args", commands(), ids=[f"{w} {shlex.join(a)}" for w, _, a in commands()])
def test_stratpack_command_line_parses(where, inline, args):
    if inline and len(args) == 1:  # prose naming a command: `stratpack train`
        assert args[0] in _names(), f"{where}: `stratpack {args[0]}` names no command ({sorted(_names())})"
        return
    placeholders = [a for a in args if re.fullmatch(r"\.\.\.|<[^<>]*>|\[.*|.*\]", a)]
    assert not placeholders, f"{where}: write a command that runs, not a synopsis: {placeholders}"
    assert parse(args).command == args[0], where


def test_a_line_the_cli_refuses_fails():
    with pytest.raises(AssertionError, match="refuses"):
        parse(["train", "dp", "--no-such-option"])
    with pytest.raises(AssertionError, match="refuses"):
        parse(["plan", "--params"])
    assert stratpack_args("bash x.sh && .venv/bin/stratpack compare --devices 4 > out.txt 2>&1 | tee y") == [
        ["compare", "--devices", "4"]]
