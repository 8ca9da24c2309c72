"""Ports for every process group and server the suite starts, taken from below the kernel's ephemeral range.

Lightning's launchers, `stratpack train` and torchrun, left to themselves, pick a port by binding port 0 and let
rank 0 listen on it seconds later, once it has imported torch. Meanwhile the port, one of the ephemeral range
(32768-60999 by default, `net.ipv4.ip_local_port_range`), is free for any socket's outgoing connection on the host:
the gloo mesh of a job running beside (the suite's second lane, `tests/lane.py`) opens hundreds, and one that takes
it makes rank 0 fail at once (EADDRINUSE). A port below that range is never given to an outgoing connection, so
handing each launch its own one ends the race.

Each test gets a ``MASTER_PORT`` of its own (`tests/conftest.py`, `_no_launch_left`), each lane job another
(`lane.environ`), and what starts a server on a port of its choosing (torchrun's rendezvous, the dashboard) takes one
here. Ports are handed out in turn from an offset set by this process's id (two sessions on one host rarely meet),
and one some socket holds (bound, listening, or in TIME_WAIT) is passed over.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading

LOW, HIGH = 20000, 32768  # [LOW, HIGH): below the ephemeral range's default start
_lock = threading.Lock()
_start = LOW + os.getpid() * 61 % (HIGH - LOW)
_order = itertools.chain(range(_start, HIGH), range(LOW, _start))


def take() -> str:
    """A port on 127.0.0.1 that no socket holds now and that this session has not handed out before."""
    with _lock:
        for port in _order:
            if free(port):
                return str(port)
    raise RuntimeError(f"no free port left in [{LOW}, {HIGH}) for this session")


def free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
