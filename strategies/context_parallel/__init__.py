"""Context parallel: each sample's sequence split over the cp ranks, attention run round a ring (#23).

`layout` (which tokens a rank holds), `ring` (ring attention and its bytes), `attention` (SDPA routed to the ring),
`positions` (position ids translated), `technique` (`ContextParallel`: the batch split, the model made to run on it).
"""

from strategies.context_parallel.attention import MARK
from strategies.context_parallel.ring import ring_attention, ring_bytes
from strategies.context_parallel.technique import ContextParallel

__all__ = ["MARK", "ContextParallel", "ring_attention", "ring_bytes"]
