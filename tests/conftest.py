"""Every test runs with strict p2p (`comm.p2p`, ``STRATPACK_STRICT_P2P``): gloo is made to follow NCCL's rules
(a rank's messages in issue order, each receive checked against the message it gets), so a change to the
pipeline's or any other p2p order that would hang or swap tensors on GPUs fails here. The ranks tests start
inherit it from this process's environment."""

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tests import lane, ports, python

os.environ.setdefault("STRATPACK_STRICT_P2P", "60")

# `pytest -m quick`, the inner loop (under 3 minutes here): every unit test and the multi-rank tests (each technique's
# engine against one process on forked gloo ranks), not the model zoo's matrix nor anything under `-m matrix`.
QUICK_DIRS, NOT_QUICK = ("unit", "multirank"), ("test_model_zoo.py",)


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.path
        if path.parent.name in QUICK_DIRS and path.name not in NOT_QUICK and not item.get_closest_marker("matrix"):
            item.add_marker(pytest.mark.quick)
    # The tests that read what the second lane (tests/lane.py) runs ahead come after the rest, which run beside it;
    # the tests on sampled figures last, when the lane is empty. (A stable sort: each group in its order.)
    items.sort(key=lambda item: (lane.takes(item, "quiet"), lane.reads_lane(item)))



@pytest.fixture(autouse=True)
def _main_module_kept():
    """Streamlit's AppTest (the dashboard's, the bench's and the dashboard surface's tests) runs the app as
    ``__main__`` and leaves it there. Multiprocessing's spawn and forkserver children re-run a ``__main__`` that has a
    file, so every rank `run_ranks` started after such a test imported the dashboard first (0.8 s a rank: the
    multi-rank tests took 2-5 times as long). Put pytest's back after each test."""
    main = sys.modules["__main__"]
    yield
    sys.modules["__main__"] = main


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same random state (torch, random, numpy), whatever ran before it in the process:
    a case whose random data can land near its bound (test_first_batch's small loss, CI stop 63) then fails every
    time or never, not by chance."""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK", "OMP_NUM_THREADS",
               "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def _no_launch_left():
    """A Trainer fit inside pytest's own process (a one-process strategy, an in-process rehearsal) sets Lightning's
    launch variables here, and the world's process group it made listens on MASTER_PORT until the process ends. Every
    job started later would inherit that port, and its rank 0 fail to listen on it (EADDRINUSE: 80 tests failed when
    the unit tests ran before the e2e ones), and the fit's OMP_NUM_THREADS (the cores over one process: a 4-rank job's
    ranks then each ran 2 threads, and their heap peaks grew past test_heap's bounds). Both undone after such a
    test. And each test gets a MASTER_PORT of its own, from below the ephemeral range (`tests/ports.py`), for what it
    launches without one: a port found by binding port 0 can be taken by a job's outgoing connection beside it."""
    saved = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    os.environ["MASTER_PORT"] = ports.take()
    given = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    yield
    if any(os.environ.get(k) != v for k, v in given.items()):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


TINY_RUN = ["--devices", "2", "--n-embd", "16", "--seq-len", "16", "--max-chars", "8000", "--wandb", "off"]
COMPARED = "single,dp,ddp,zero2,pp2"


@pytest.fixture(scope="session", autouse=True)
def _lane(request, tmp_path_factory):
    """The long subprocess work the selected tests need, queued on the suite's second lane (`tests/lane.py`)."""
    lane.start(request.session.items, tmp_path_factory)
    yield
    lane.close()


@pytest.fixture
def quiet():
    """For a test that compares a sampled figure (a heap peak, an elapsed time): nothing runs beside it."""
    lane.drain()


@pytest.fixture(scope="session")
def compared(tmp_path_factory):
    """A run store written by real commands, once per session: `stratpack compare` of COMPARED at 2 CPU ranks
    (4 steps; it first measures this host, into a calibration cache of the session's own, so each run's meta holds
    a predicted step time), and a `stratpack train` killed (SIGKILL, every rank) after its third step. Read by the
    compare table's test (tests/e2e/test_launch.py) and the dashboard's (tests/dashboard/test_real_store.py)."""
    return lane.result("compared", lambda: _compared(tmp_path_factory))


def _compared(tmp_path_factory):
    root = tmp_path_factory.mktemp("compared")
    runs, table = root / "runs", root / "results.json"
    env = {**os.environ, "STRATPACK_CALIBRATION": str(root / "cache" / "calibration.json"), "STRATPACK_RUNS": str(runs)}
    cli = [python.core(), "-m", "strategies.cli"]
    proc = lane.run([*cli, "compare", "--strategies", COMPARED, "--steps", "4", "--json", str(table),
                     "--runs-dir", str(runs), *TINY_RUN], timeout=900, env=env)
    killed = subprocess.Popen([*lane.prefix(), *cli, "train", "dp", "--steps", "100000", *TINY_RUN],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=lane.environ(env),
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and killed.poll() is None and not _steps_written(runs, 3):
            time.sleep(0.2)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)  # the launcher and its ranks, as a node failure would
        killed.wait()
    return SimpleNamespace(proc=proc, table=table, runs=runs)


lane.register("compared", lambda item: lane.takes(item, "compared"),
              lambda factory, readers: [("compared", lambda: _compared(factory))])


def _steps_written(runs, steps: int) -> bool:
    """Whether some run in ``runs`` other than the comparison's has ``steps`` records on every rank file."""
    for folder in runs.iterdir() if runs.is_dir() else []:
        files = sorted(folder.glob("rank*.jsonl"))
        if "-dp-" in folder.name and not (folder / "summary.json").exists() and len(files) == 2 and all(
                len(f.read_text().splitlines()) >= steps for f in files):
            return True
    return False
