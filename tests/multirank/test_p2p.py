"""comm.p2p: grouped messages matched in issue order (no tags), and strict mode, which makes gloo follow NCCL's
rules and fails the moment a program breaks them (a swapped message, an order that would hang)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from strategies import comm
from strategies.comm import Axis, CommStats
from strategies.testing import run_ranks


def _world() -> Axis:
    return Axis.of_group("world", dist.group.WORLD, CommStats())


def _cases(rank: int, world_size: int, limit: str) -> list[str]:
    os.environ[comm.STRICT_ENV] = limit
    axis, peer, out = _world(), 1 - rank, []
    # 1. A send and a receive in one group, both ranks at once: fine (alone, both sends would wait). A complex
    # tensor arrives whole (posted through the process group's own send/recv, without isend's view as real).
    mine, theirs = torch.full((3,), float(rank)), torch.empty(3)
    z, zt = torch.full((2,), complex(rank + 1, 2)), torch.empty(2, dtype=torch.complex64)
    comm.exchange([comm.P2P(True, mine, peer, "x"), comm.P2P(True, z, peer, "z"), comm.P2P(False, theirs, peer, "x"),
                   comm.P2P(False, zt, peer, "z")], axis).wait()
    out.append(f"got {theirs.tolist()} {zt.tolist()}")
    # 2. Two messages of one shape, received in the other order: NCCL would swap them silently.
    a, b = torch.ones(2), torch.zeros(2)
    try:
        if rank == 0:
            comm.send(a, axis, 1, "first")
            comm.send(b, axis, 1, "second")
        else:
            comm.recv(b, axis, 0, "second")
            comm.recv(a, axis, 0, "first")
        out.append("no error")
    except comm.P2POrderError as err:
        out.append(str(err))
    return out


def _hang(rank: int, world_size: int) -> str:
    os.environ[comm.STRICT_ENV] = "3"
    axis, peer = _world(), 1 - rank
    try:  # each sends first, then receives: under NCCL both sends wait forever (NVIDIA/nccl#479)
        comm.send(torch.ones(4), axis, peer, "mine")
        comm.recv(torch.empty(4), axis, peer, "mine")
    except comm.P2POrderError as err:
        return str(err)
    return "no error"


def test_strict_mode_names_a_swapped_message_and_groups_exchange():
    results = run_ranks(_cases, 2, "3", timeout_s=90.0)
    assert results[0][0] == "got [1.0, 1.0, 1.0] [(2+2j), (2+2j)]", results[0][0]
    assert results[1][0] == "got [0.0, 0.0, 0.0] [(1+2j), (1+2j)]", results[1][0]
    assert "the receive of 'second' from axis rank 0 got 'first'" in results[1][1], results[1][1]
    # rank 0's second send is never received (rank 1 stopped at the mismatch): named as a hang, not left hanging
    assert results[0][1].startswith("strict p2p mode: no progress in 3 s"), results[0][1]


def test_strict_mode_fails_an_order_that_would_hang_under_nccl():
    for message in run_ranks(_hang, 2, timeout_s=90.0, pg_timeout_s=60.0):
        assert message.startswith("strict p2p mode: no progress in 3 s"), message
        assert "send on world peer" in message


def _ring(rank: int, world_size: int) -> list[float]:
    os.environ[comm.STRICT_ENV] = "20"
    t = torch.arange(7, dtype=torch.float32) * (rank + 1)
    comm.ring_all_reduce(t, _world())
    return t.tolist()


def test_ring_all_reduce_under_strict_order():
    # each step's send and receive are one group: with the receive issued first, then the send, every rank
    # would wait on its left neighbour's send under NCCL
    expected = (torch.arange(7, dtype=torch.float32) * 6).tolist()
    assert run_ranks(_ring, 3, timeout_s=90.0) == [expected] * 3
