"""comm.py's flight recorder: a timed-out collective names itself and the rank's last calls; debug mode catches
mismatched collectives before they hang or mix up data."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from strategies import comm
from strategies.comm import Axis, CommStats
from strategies.testing import run_ranks


def _world() -> Axis:
    return Axis.of_group("world", dist.group.WORLD, CommStats())


def _timeout_case(rank: int, world_size: int) -> str:
    axis = _world()
    comm.all_reduce(torch.ones(3), axis)  # a call that completes: it must show in the history
    if rank == world_size - 1:
        time.sleep(6)  # never joins the second all-reduce: the others time out (process-group timeout 3 s)
        return ""
    try:
        comm.all_reduce(torch.ones(5, 2), axis)
    except comm.CollectiveError as err:
        return str(err)
    return "no error"


def test_timed_out_collective_reports_the_call_and_history_on_every_waiting_rank():
    messages = run_ranks(_timeout_case, 3, timeout_s=60.0, pg_timeout_s=3.0)  # a loaded machine starts ranks slowly
    for rank, message in enumerate(messages[:2]):
        lines = message.splitlines()
        assert lines[0].startswith(f"[rank {rank}] #2 all_reduce on world (5, 2) float32 failed:"), message
        assert f"last calls on rank {rank}, oldest first:" in message
        assert "  #1 all_reduce on world (3,) float32  [done]" in lines
        assert "  #2 all_reduce on world (5, 2) float32  [failed]" in lines
        assert "collective timeout" in message


def _mismatch_case(rank: int, world_size: int, kind: str) -> str:
    os.environ[comm.DEBUG_ENV] = "1"
    axis = _world()
    comm.all_reduce(torch.zeros(2), axis)  # agreeing calls pass the check
    try:
        if kind == "shape":
            comm.all_reduce(torch.zeros(4 + rank), axis)
        else:
            if rank == 0:
                comm.all_reduce(torch.zeros(4), axis)
            else:
                comm.all_gather(torch.zeros(4), torch.zeros(2), axis)
    except comm.CollectiveMismatch as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("kind", ["shape", "op"])
def test_debug_mode_names_mismatched_collectives(kind: str):
    messages = run_ranks(_mismatch_case, 2, kind, timeout_s=60.0)
    for rank, message in enumerate(messages):
        assert message.startswith(f"[rank {rank}] mismatched collectives on axis world:"), message
        if kind == "shape":
            assert "rank 0: #2 all_reduce (4,) float32" in message and "rank 1: #2 all_reduce (5,) float32" in message
        else:
            assert "rank 0: #2 all_reduce (4,)" in message and "rank 1: #2 all_gather (4,) (2,)" in message


def test_recorder_tells_exited_processes():
    proc = subprocess.Popen(["sleep", "30"])
    recorder = comm.FlightRecorder()
    recorder.peers = [(__import__("socket").gethostname(), os.getpid()), (__import__("socket").gethostname(), proc.pid)]
    assert recorder.gone() == []
    proc.kill()
    time.sleep(0.2)  # killed but not reaped yet: a zombie counts as exited
    assert recorder.gone() == [1]
    proc.wait()
    assert recorder.gone() == [1]
    assert len(recorder.calls) == 0 and recorder.calls.maxlen == 12  # bounded history


def _chain_then_reduce(rank: int, world_size: int) -> str:
    os.environ[comm.DEBUG_ENV] = "1"
    axis = _world()
    x = torch.ones(3)
    if rank > 0:  # a pipeline: the middle rank receives and sends, the ends do one of the two
        comm.recv(x, axis, rank - 1)
    if rank < world_size - 1:
        comm.send(x, axis, rank + 1)
    comm.all_reduce(x, axis)
    return "ok"


def test_debug_mode_counts_collectives_not_p2p_messages():
    assert run_ranks(_chain_then_reduce, 3, timeout_s=60.0) == ["ok", "ok", "ok"]
