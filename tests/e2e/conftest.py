"""The shared processes of the end-to-end tests. A set of ranks costs more than most fits in it (each rank imports
torch and Lightning), so the job scripts' Trainer fits run in one set of ranks per world size for the session
(`_jobs.py`): every plan's equivalence with one process under plain SGD and AdamW, their bytes, clipping, activation
checkpointing and the pipeline's timeline (`_sgd_job`), expert parallel (`_ep_job`), the named classes (`_named_job`),
the models people bring (`_zoo_job`), models built on meta (`_deferred_job`) and Hugging Face checkpoints loaded by
slice (`_pretrained_job`). Each test file reads its job's part.

`real_3d`: one real gloo run of the 3D plan at 8 ranks with its heap sampled, which test_heap checks against the
estimator and test_rehearse against each rank's rehearsal."""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Mapping
from functools import partial

import pytest

from tests import lane
from tests.helpers import REAL_3D, REAL_3D_RUN, run_job, train_demo

HERE = os.path.dirname(__file__)
HF = ("_ep_job", "_zoo_job", "_deferred_job", "_pretrained_job")  # (these need transformers)
JOBS = {2: ("_sgd_job", "_ep_job", "_named_job"), 4: ("_sgd_job", "_ep_job"),
        8: ("_sgd_job", "_ep_job", "_zoo_job", "_deferred_job", "_pretrained_job")}


class Jobs:
    """``jobs(world)``: {job: its results}, the world's jobs run together on first use (or ahead, on the suite's second
    lane), once for the session."""

    def __init__(self, tmp_path_factory) -> None:
        self.factory, self.done = tmp_path_factory, {}

    def __call__(self, world: int) -> dict:
        if world not in self.done:
            self.done[world] = lane.result(f"jobs{world}", lambda: run_jobs(self.factory, world))
        return self.done[world]


def run_jobs(factory, world: int) -> dict:
    hf = importlib.util.find_spec("transformers") is not None
    specs = [f"{job}={hf_saved(factory)}" if job == "_pretrained_job" else job
             for job in JOBS[world] if hf or job not in HF]
    return run_job(os.path.join(HERE, "_jobs.py"), factory.mktemp(f"jobs{world}"), str(world), *specs,
                   timeout_s=1800, env={"PL_GLOBAL_SEED": "0"}, hf=True)[0]


def _queued(factory, readers) -> list:
    """The shared jobs for the lane, the largest world first (its first reader, test_deferred, comes early). The
    pretrained job's checkpoints are written here first, in pytest's own thread: building a model draws on torch's
    global generator, which the tests in front seed and draw from (a lane thread building the zoo's models beside
    test_model_zoo's one-process reference changed its weights: qwen2-tp2-sgd's first loss 0.4% off in CI, 29 Nov)."""
    if importlib.util.find_spec("transformers") is not None:
        hf_saved(factory)
    return [(f"jobs{w}", partial(run_jobs, factory, w)) for w in (8, 2, 4)]


lane.register("shared_jobs", lambda item: lane.takes(item, "shared_jobs"), _queued)


class _Part(Mapping):
    """One job's results by world size, each world's jobs run when first read."""

    def __init__(self, jobs: Jobs, job: str) -> None:
        self.jobs, self.job = jobs, job

    def __getitem__(self, world: int) -> dict:
        return self.jobs(world)[self.job]

    def __iter__(self):
        return iter(w for w, names in JOBS.items() if self.job in names)

    def __len__(self) -> int:
        return len(list(iter(self)))


_SAVED, _SAVING = {}, threading.Lock()


def hf_saved(factory):
    """Hugging Face checkpoints of the zoo's models (`_pretrained_job`'s), sharded, with an index; once a session (the
    lane's jobs and a test may ask at once)."""
    with _SAVING:
        return _hf_saved(factory)


def _hf_saved(factory):
    if "folder" not in _SAVED:
        from tests.e2e._pretrained_job import CASES, EXPORTS
        from tests.models import zoo

        folder = factory.mktemp("hf")
        for name in {name for name, _ in CASES + EXPORTS}:
            model = zoo.build(name, seed=3).model
            model.save_pretrained(folder / name, max_shard_size="40KB")
            assert len(list((folder / name).glob("*.safetensors"))) > 1  # sharded, with an index
        _SAVED["folder"] = folder
    return _SAVED["folder"]


@pytest.fixture(scope="session")
def shared_jobs(tmp_path_factory) -> Jobs:
    return Jobs(tmp_path_factory)


def _part(job: str):
    """A session fixture named ``job`` without its underscore and "_job", plus "s": its results by world size."""

    @pytest.fixture(scope="session", name=job.strip("_").replace("_job", "_jobs"))
    def fixture(shared_jobs) -> Mapping:
        return _Part(shared_jobs, job)

    return fixture


sgd_jobs, named_jobs, ep_jobs, zoo_jobs, deferred_jobs, pretrained_jobs = (_part(job) for job in (
    "_sgd_job", "_named_job", *HF))


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    return hf_saved(tmp_path_factory)


@pytest.fixture(scope="session")
def real_3d(tmp_path_factory) -> tuple[dict, str]:
    """(the run's result, its folder) of `REAL_3D` at 8 ranks with `REAL_3D_RUN`, ``--heap``."""
    tmp = tmp_path_factory.mktemp("real3d")
    result, _ = train_demo(tmp, REAL_3D, 8, "--heap", "--warmup-steps", "0", *REAL_3D_RUN)
    return result, str(tmp)
