"""`stratpack train`'s ranks on one machine, started all at once, as torchrun starts them.

Lightning's popen launcher starts ranks 1..N-1 only when rank 0 reaches ``fit``: after rank 0 alone has imported
torch, Lightning and the workload (about 4 s of CPU here) and built its module, and the others then do the same
while it waits, so a 2-rank run's start-up is two imports one after the other (a tiny 2-step run at 2 ranks: 8.2 s,
and 4.3 s with the ranks started at once; docs/tests.md has the suite's figures). Here rank 0 starts the others
before it imports anything, with the variables Lightning's launcher would give them (``MASTER_ADDR``,
``MASTER_PORT``, ``WORLD_SIZE``, ``NODE_RANK``, ``LOCAL_RANK``); Lightning then finds the processes made
(`LightningEnvironment.creates_processes_externally`) and launches none. Rank 0 watches the others as Lightning's
launcher does (a rank that fails ends the job: the others and rank 0 are sent SIGTERM) and exits with the first
failure's code. Under torchrun, SLURM or any launcher that set a rank's variables, nothing is started here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

# Variables a launcher sets for its ranks (torchrun, SLURM, MPI, LSF, Lightning's own children): ranks are made.
LAUNCHED = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "LSB_JOBID")
POLL_S = 1.0  # how often rank 0 looks at the others (Lightning's observer: 5 s)
GRACE_S = 10.0  # how long the others may take to end after rank 0 failed


def starts_ranks(devices: int, num_nodes: int) -> bool:
    """Whether this process starts the run's ranks itself: several on this machine, none made by a launcher."""
    return devices > 1 and num_nodes == 1 and not any(k in os.environ for k in LAUNCHED)


def start_other_ranks(argv: list[str], devices: int) -> list[subprocess.Popen]:
    """Make this process rank 0 of ``devices`` and start ranks 1..devices-1 as ``stratpack`` with ``argv``; a thread
    ends the job when one of them fails."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.update(WORLD_SIZE=str(devices), NODE_RANK="0", LOCAL_RANK="0")
    command = [sys.executable, "-m", "strategies.cli", *argv]
    procs = [subprocess.Popen(command, env={**os.environ, "LOCAL_RANK": str(rank)}) for rank in range(1, devices)]
    threading.Thread(target=_watch, args=(procs,), daemon=True, name="stratpack-ranks").start()
    return procs


@contextlib.contextmanager
def ended_on_error(procs: list[subprocess.Popen]) -> Iterator[None]:
    """Where rank 0 fails, the others get ``GRACE_S`` to end on their own (to print their own errors, or to find that
    rank 0's store is gone), then SIGTERM: none is left running."""
    try:
        yield
    except BaseException:
        deadline = time.monotonic() + GRACE_S
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)
        raise


def wait_for(procs: list[subprocess.Popen]) -> int:
    """The first other rank's failure code (0 if none), once every rank has ended (rank 0 itself did not fail)."""
    for proc in procs:
        proc.wait()
    return next((p.returncode for p in procs if p.returncode), 0)


def _watch(procs: list[subprocess.Popen]) -> None:
    while True:
        time.sleep(POLL_S)
        failed = [(rank, p.returncode) for rank, p in enumerate(procs, 1) if p.poll() not in (None, 0)]
        if failed:
            rank, code = failed[0]
            print(f"stratpack: rank {rank} exited with code {code}: ending the job", file=sys.stderr, flush=True)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if all(p.poll() == 0 for p in procs):
            return


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
