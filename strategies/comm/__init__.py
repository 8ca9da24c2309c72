"""The one place that calls torch.distributed: every collective and p2p message, counted and logged.

    from strategies import comm
    comm.all_reduce(tensor, mesh.dp)        # over one named axis of the mesh; a no-op on an axis of one rank

`stats`: what is counted (bytes and blocked seconds per operation and axis) and the `Axis` every call takes;
`recorder`: the flight recorder that names a failed call; `ops`: the calls themselves.
"""

from strategies.comm.ops import (
    Handle,
    all_gather,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object,
    irecv,
    isend,
    recv,
    reduce_scatter,
    register_peers,
    ring_all_reduce,
    send,
)
from strategies.comm.recorder import (
    DEBUG_ENV,
    RECORDER,
    CallRecord,
    CollectiveError,
    CollectiveMismatch,
    FlightRecorder,
)
from strategies.comm.stats import Axis, CommRecord, CommStats, Op

__all__ = [
    "DEBUG_ENV", "RECORDER", "Axis", "CallRecord", "CollectiveError", "CollectiveMismatch", "CommRecord", "CommStats",
    "FlightRecorder", "Handle", "Op", "all_gather", "all_gather_object", "all_reduce", "barrier", "broadcast",
    "broadcast_object", "irecv", "isend", "recv", "reduce_scatter", "register_peers", "ring_all_reduce", "send",
]
