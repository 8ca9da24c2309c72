"""The documentation's examples that train (a ```python block of README.md or docs/*.md that calls ``.fit(``; the
rest run in tests/unit/test_docs.py): each runs as a script, ``python example.py`` in a temporary directory, as a
reader would run it, since Lightning's launcher re-runs ``sys.argv`` for the other ranks.

The example is the page's code unchanged; what keeps it short comes from the environment, which Lightning's Trainer
reads for every argument the example does not give (``PL_TRAINER_<ARGUMENT>``): 2 steps, no logger, checkpoint,
progress bar or validation; and ``STRATPACK_TIMEOUT=60``. A small runner patches ``Trainer.fit`` to record, on rank
0, each fit's steps, world size and status, then runs the example (``runpy``, so its tracebacks name its lines):
the test asserts that every ``.fit(`` of the example finished having trained (2 steps, unless the example says
how many), so an example that raises, or trains nothing, fails it.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.unit.test_docs import ROOT, python_blocks

STEPS = 2
TRAINER_DEFAULTS = {"MAX_STEPS": str(STEPS), "LOGGER": "False", "ENABLE_CHECKPOINTING": "False",
                    "ENABLE_PROGRESS_BAR": "False", "ENABLE_MODEL_SUMMARY": "False", "LIMIT_VAL_BATCHES": "0"}
RUNNER = """\
import json, runpy, sys
import lightning.pytorch as pl

fit = pl.Trainer.fit


def recorded_fit(self, *args, **kwargs):
    out = fit(self, *args, **kwargs)
    if self.global_rank == 0:
        with open("fits.jsonl", "a") as f:
            f.write(json.dumps({"steps": self.global_step, "world_size": self.world_size,
                                "status": self.state.status.value}) + "\\n")
    return out


pl.Trainer.fit = recorded_fit
runpy.run_path("example.py", run_name="__main__")
"""


@pytest.mark.parametrize("block", python_blocks(trains=True), ids=lambda b: b.where)
def test_training_example_runs(block, tmp_path):
    if block.needs_gpu:
        pytest.skip(f"{block.where} is marked as needing a GPU")
    import subprocess

    (tmp_path / "example.py").write_text("\n" * (block.line - 1) + block.code)  # the page's line numbers
    (tmp_path / "runner.py").write_text(RUNNER)
    env = {**os.environ, "STRATPACK_TIMEOUT": "60", "STRATPACK_RUNS": str(tmp_path / "runs"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **{f"PL_TRAINER_{k}": v for k, v in TRAINER_DEFAULTS.items()}}
    proc = subprocess.run([sys.executable, "runner.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{block.where} failed:\n{proc.stderr[-4000:]}"
    fits = [json.loads(line) for line in (tmp_path / "fits.jsonl").read_text().splitlines()]
    assert len(fits) == block.code.count(".fit("), fits
    assert all(f["steps"] > 0 and f["status"] == "finished" for f in fits), fits
