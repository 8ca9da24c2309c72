"""The one place that calls torch.distributed: every collective and p2p message, counted and logged.

    from strategies import comm
    comm.all_reduce(tensor, mesh.dp)        # over one named axis of the mesh; a no-op on an axis of one rank

`stats`: what is counted (bytes and blocked seconds per operation and axis) and the `Axis` every call takes;
`recorder`: the flight recorder that names a failed call; `ops`: the collectives; `p2p`: point-to-point
messages, grouped and ordered as NCCL matches them.
"""

from strategies.comm.ops import (
    DETERMINISTIC_ENV,
    Handle,
    all_gather,
    all_gather_object,
    all_reduce,
    all_to_all,
    backend_of,
    barrier,
    broadcast,
    broadcast_object,
    leave_group_at_exit,
    leave_groups,
    ordered_sums,
    reduce_scatter,
    register_peers,
    rehearsing,
    set_ordered_sums,
    set_rehearsal,
)
from strategies.comm.p2p import P2P, STRICT_ENV, GroupHandle, P2POrderError, exchange, recv, ring_all_reduce, send
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
    "DEBUG_ENV", "DETERMINISTIC_ENV", "P2P", "RECORDER", "STRICT_ENV", "Axis", "CallRecord", "CollectiveError",
    "CollectiveMismatch", "CommRecord", "CommStats", "FlightRecorder", "GroupHandle", "Handle", "Op", "P2POrderError",
    "all_gather", "all_gather_object", "all_reduce", "all_to_all", "backend_of", "barrier", "broadcast",
    "broadcast_object", "exchange", "leave_group_at_exit", "leave_groups", "ordered_sums", "recv", "reduce_scatter",
    "register_peers", "rehearsing", "ring_all_reduce", "send", "set_ordered_sums", "set_rehearsal",
]
