"""Every `stratpack` command line README.md and docs/ show (found as `tests/unit/test_docs.py` finds and parses them)
runs after the README's install: it exits 0, or, where what it needs is not here (an optional extra, a GPU), prints
one line saying what and exits 2.

A page's lines run in its order in one folder of the page's own, as a reader would type them: a later line reads what
an earlier one wrote (docs/checkpoints.md resumes from the checkpoint its first line saved, then converts it). A line
shown on several pages runs once. A command that trains gets tiny sizes (`TINY`; steps are kept, a checkpoint's name
counts them) and benchmarks repeat once; a rehearsal (on meta) and a line that needs a GPU run as written. Synopses
in prose name their arguments in capitals: `SYNOPSIS` gives each a value (`CKPT` and `CONFIG`: a Hugging Face
Llama's checkpoint saved by `stratpack train --workload hf-llama`, and its config). `stratpack dashboard` serves
until stopped: it passes when its health check answers.

The lines that take minutes whatever their size (the rehearsal matrix and the anchors' rows, the planner's
rehearsals and published runs, the benchmarks, `compare`, `large`, inductor's compile on CPU) run under
`pytest -m matrix`; the README's
`compare` runs in CI at tiny sizes as the session's `compared` fixture (tests/conftest.py). So do the lines whose
command and options another CI test runs already (`SAME` names it)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest

from tests import lane, ports, python
from tests.unit.test_docs import commands

TINY = {"--n-layer": "4", "--n-embd": "16", "--n-head": "2", "--seq-len": "16", "--max-chars": "8000",
        "--batch-per-rank": "4"}
DEFAULTS = {"--wandb": "off"}  # where the line does not say
ALWAYS = {"--repeat": "1"}
SIZED = ("train", "compare", "bench", "bench-saves", "large")  # (a rehearsal on meta takes as long at any size)
SYNOPSIS = {"PLAN": "zero3", "DIR": "ckpt", "OUT": "hf-out"}
# What takes minutes at any size: run under -m matrix
SLOW = [r"^rehearse --(matrix|anchors)", r"^rehearse .*--world-size 1024", r"^plan .*--rehearse", r"^plan --published",
        r"^bench(?!.*--accelerator gpu)",
        r"^bench-saves", r"^compare", r"^large", r"--compile inductor"]
# A line whose command and options another CI test already runs, each with what runs it: under -m matrix
SAME = {r"^train dp --devices 2$": "the compare fixture's and test_run_store's `train dp` at 2 ranks",
        r"^train (dp|PLAN) --heap$": "test_heap's and test_rehearse's `train PLAN --heap`",
        r"^train dp --checkpoint-dir (ckpt --checkpoint-every 10|DIR) --async-save$": "docs/checkpoints.md's "
        "`train zero3 --checkpoint-dir ckpt --checkpoint-every 10 --async-save` (ZeRO-3's sharded save)",
        r"^train PLAN --configure-model$": "test_deferred's `train zero3 --configure-model` at 2 ranks",
        r"^train zero3 --resume auto --checkpoint-dir DIR$": "README.md's `train dp --resume auto` (above) and "
        "test_restart's `--resume auto` under `zero3_pp2`",
        r"^train ep2 --experts 8 --top-k 2$": "test_expert_bytes' `train ep2 --experts 2 --top-k 2`",
        r"^plan --params 7e9 --gpus 8$": "docs/commands.md's `plan --params 7e9 --gpus 8 --gpu-mem 80`",
        r"^rehearse zero3_tp2 --world-size 4 --save$": "test_rehearse's `rehearse zero3_tp2 --world-size 4 --save "
        "--target cuda`, every rank",
        r"^rehearse PLAN --world-size 64$": "README.md's `rehearse PLAN --world-size 64 --all-roles` (rank 0 among "
        "them)",
        # docs/checkpoints.md's chain: test_reshard's `saved` (the same train line), its resume under zero1_pp2 at 4
        # from step 3, and its convert of step 6's checkpoint
        r"^train zero3_tp2_pp2 --devices 8 --steps 8 --epoch-steps 4 --checkpoint-dir ckpt --checkpoint-every 3$":
            "test_reshard's `saved` fixture",
        r"^train zero1_pp2 --devices 4 --steps 8 --epoch-steps 4 --resume ckpt/epoch=0-step=3.ckpt$":
            "test_reshard's resume under zero1_pp2 at 4",
        r"^convert ckpt/epoch=1-step=6.ckpt model.pt --model-only --strip-prefix model.$":
            "test_reshard's convert of the saved checkpoint"}
# What a machine without a GPU answers in one line with exit 2
NEEDS_GPU = [r"--accelerator gpu", r"--real --target cuda"]


def _lines() -> list[tuple[str, list[str]]]:
    """(where, arguments) of each command line to run: inline names of a command left out, a line shown again (on
    any page) once, where it is first shown."""
    seen, found = set(), []
    for where, inline, args in commands():
        if (inline and len(args) == 1) or tuple(args) in seen:
            continue
        seen.add(tuple(args))
        found.append((where, args))
    return found


def _params():
    out = []
    for where, args in _lines():
        line = shlex.join(args)
        marks = [pytest.mark.matrix] if any(re.search(p, line) for p in [*SLOW, *SAME]) else []
        out.append(pytest.param(where, args, marks=marks, id=f"{where} {line}"))
    return out


def _options(command: str) -> set[str]:
    from strategies import cli

    for module in cli.COMMANDS:
        if module.__name__.rsplit(".", 1)[-1].replace("_", "-") == command:
            import argparse

            sub = argparse.ArgumentParser().add_subparsers()
            module.add_parser(sub)
            return {o for a in sub.choices[command]._actions for o in a.option_strings}
    raise AssertionError(f"no command {command}")


def tiny(args: list[str], values: dict[str, str]) -> list[str]:
    """``args`` with the synopsis' capitals given ``values``, and for a command that trains, its sizes made tiny and
    the defaults where absent. A line that needs a GPU runs as written (this machine says so, or runs it)."""
    args = [values.get(a, a) for a in args]
    if args[0] not in SIZED or any(re.search(p, shlex.join(args)) for p in NEEDS_GPU):
        return args
    known, out, i = _options(args[0]), [], 0
    while i < len(args):  # drop the sizes the line gives (each with its value), to add the tiny ones after
        if args[i] in TINY or args[i] in ALWAYS:
            i += 2
            continue
        out.append(args[i])
        i += 1
    extra = {**TINY, **ALWAYS, **{k: v for k, v in DEFAULTS.items() if k not in args}}
    return out + [w for k, v in extra.items() if k in known for w in (k, v)]


_PAGES: dict[str, partial] = {}  # "docs:PAGE" -> its selected lines' runs, in order


def _queue_pages(factory, readers) -> list:
    """Each page's selected lines, a run of them in order, for the suite's second lane (tests/lane.py)."""
    lines = [(i.callspec.params["where"], tuple(i.callspec.params["args"])) for i in readers]
    root, values, by_page = factory.mktemp("doc-commands"), dict(SYNOPSIS), {}
    for where, args in lines:
        by_page.setdefault(_page(where), []).append((where, args))
    _PAGES.update({f"docs:{page}": partial(_run_page, root, values, page, todo) for page, todo in by_page.items()})
    return list(_PAGES.items())


lane.register("doc commands", lambda item: getattr(item, "originalname", "") == "test_command_line_from_the_docs_runs",
              _queue_pages)


def _page(where: str) -> str:
    return re.sub(r"\W", "_", where.split(":")[0])


_CKPT = threading.Lock()  # (a page run here and one in the lane may both need CKPT)


def _run_page(root: Path, values: dict, page: str, todo: list) -> dict:
    """{(where, args): (the line as run, its process or None if served, seconds) or the error}, in the page's order,
    in a folder of the page's own, as a reader types them."""
    cwd = root / page
    cwd.mkdir(exist_ok=True)
    env = {**os.environ, "STRATPACK_TIMEOUT": "120", "STRATPACK_RUNS": str(cwd / "runs"),
           "STRATPACK_CALIBRATION": str(root / "calibration.json")}
    env.pop("STRATPACK_STRICT_P2P", None)  # as a user runs them
    done = {}
    for where, args in todo:
        try:
            with _CKPT:
                if {"CKPT", "CONFIG"} & set(args) and "CKPT" not in values:
                    values.update(_hf_checkpoint(root, env))
            line = tiny(list(args), values)
            if line[0] == "dashboard":
                _serve(line, cwd, env)
                done[where, args] = (line, None, 0.0)
                continue
            start = time.monotonic()
            proc = lane.run([python.for_args(line), "-m", "strategies.cli", *line], cwd=cwd, env=env, timeout=900)
            done[where, args] = (line, proc, time.monotonic() - start)
        except Exception as e:  # (this line's test fails with it; the page's later lines still run)
            done[where, args] = e
    return done


def _hf_checkpoint(root: Path, env: dict) -> dict[str, str]:
    """A Hugging Face Llama trained two steps under `dp` at 2 ranks, its checkpoint saved: CKPT, and CONFIG its
    config.json's folder."""
    cwd = root / "hf"
    cwd.mkdir(exist_ok=True)
    shape = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "16"]
    run([sys.executable, "-m", "strategies.cli", "train", "dp", "--workload", "hf-llama", "--steps", "2",
         "--checkpoint-dir", "ckpt", "--checkpoint-every", "2", "--wandb", "off", *shape], cwd, env)
    import torch

    from demos.hf_llama import LlamaModule

    with torch.device("meta"):  # (its config only: no weights drawn from the generator the tests in front use)
        module = LlamaModule(2, 32, 2, 16)
    module.config.save_pretrained(cwd / "config")
    (ckpt,) = (cwd / "ckpt").glob("*.ckpt")
    return {"CKPT": str(ckpt), "CONFIG": str(cwd / "config")}


def run(cmd: list[str], cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = lane.run(cmd, cwd=cwd, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{shlex.join(cmd[3:])} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def _serve(args: list[str], cwd: Path, env: dict) -> None:
    """`stratpack dashboard ...` on a free port: up (its health check answers), then stopped."""
    from strategies.cli.dashboard import wait_until_up

    port = ports.take()  # (below the ephemeral range: see tests/ports.py)
    args = [a for i, a in enumerate(args) if a != "--port" and (i == 0 or args[i - 1] != "--port")]
    server = subprocess.Popen([*lane.prefix(), python.core(), "-m", "strategies.cli", *args, "--port", port],
                              cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait = 300 if lane.in_lane() else 90  # (in the lane it may wait for the test in front)
    try:
        assert wait_until_up(f"http://127.0.0.1:{port}", wait), f"stratpack {shlex.join(args)} did not come up"
    finally:
        server.terminate()
        server.wait(30)


@pytest.mark.parametrize("where,args", _params())
def test_command_line_from_the_docs_runs(where, args):
    key = f"docs:{_page(where)}"
    got = lane.result(key, _PAGES[key])[where, tuple(args)]
    if isinstance(got, Exception):
        raise got
    line, proc, seconds = got
    if proc is None:  # `stratpack dashboard`: it came up
        return
    said = proc.stderr.strip().splitlines()
    gpu = any(re.search(p, shlex.join(args)) for p in NEEDS_GPU)
    if proc.returncode == 2:  # what this machine lacks, said in one line: a GPU, or an extra and how to install it
        assert len(said) == 1 and ("GPU" in said[0] if gpu else "pip install" in said[0]), \
            (where, proc.stderr[-2000:])
        return
    assert proc.returncode == 0, (f"{where}: stratpack {shlex.join(line)} exited {proc.returncode} after "
                                  f"{seconds:.0f} s:\n{proc.stderr[-3000:]}")


def test_tiny_gives_the_synopsis_values_and_tiny_sizes():
    line = tiny(["train", "PLAN", "--n-embd", "1024", "--steps", "8", "--checkpoint-dir", "DIR"],
                {"PLAN": "zero3", "DIR": "ckpt"})
    assert line[:5] == ["train", "zero3", "--steps", "8", "--checkpoint-dir"] and line[5] == "ckpt"
    assert "1024" not in line and line[line.index("--n-embd") + 1] == "16" and line[-2:] == ["--wandb", "off"]
    assert tiny(["bench", "--repeat", "9"], {})[1:3] == ["--n-layer", "4"] and tiny(["bench", "--repeat", "9"], {})[
        -4:] == ["--batch-per-rank", "4", "--repeat", "1"]
    for kept in (["plan", "--params", "7e9"], ["rehearse", "zero3", "--seq-len", "8192"], ["bench", "--accelerator",
                                                                                            "gpu", "--n-layer", "24"]):
        assert tiny(kept, {}) == kept


def test_every_line_left_to_another_test_is_still_in_the_docs():
    lines = [shlex.join(args) for _, args in _lines()]
    assert [p for p in SAME if not any(re.search(p, line) for line in lines)] == []
