"""What expert parallel's all-to-alls move, from the tokens each rank routes to each expert: the formula the
measured bytes are checked against (`tests/multirank/test_expert_dispatch.py`) and the estimator's term.

Per MoE layer and step, rank r of n (each holding L = E/n experts) sends:
- the counts: L int64 to each other rank (forward only);
- the rows it routes to other ranks' experts, in the forward, and their gradients' way back in the backward of the
  return trip: 2 x (rows out) x width x element size;
- the rows other ranks routed to its experts, on their way back (forward), and their gradients (backward):
  2 x (rows in) x width x element size.
A balanced router (each of the T x k choices uniform over the experts, every rank T tokens) gives rows out = rows
in = T k (n-1)/n.
"""

from __future__ import annotations

import torch


def call_bytes(rows_out: int, rows_in: int, per: int, n: int, width: int, sizes: tuple[int, int],
               backward: bool) -> int:
    """Bytes one layer's call sends: the counts, ``rows_out`` rows of the input (``sizes[0]`` bytes an element) to
    other ranks and ``rows_in`` results (``sizes[1]``) back; with ``backward``, their gradients the other way."""
    forward = 8 * per * (n - 1) + width * (rows_out * sizes[0] + rows_in * sizes[1])
    return forward + (width * (rows_in * sizes[0] + rows_out * sizes[1]) if backward else 0)


def all_to_all_bytes(choices: torch.Tensor, rank: int, width: int, element_size: int) -> int:
    """Bytes rank ``rank`` sends in one layer's step; ``choices[j, e]``: the (token, choice) pairs rank j routes to
    expert e (ep ranks x experts)."""
    n, experts = choices.shape
    per = experts // n
    owner = torch.arange(experts) // per
    rows_out = int(choices[rank][owner != rank].sum())
    rows_in = int(choices[:, owner == rank].sum() - choices[rank, owner == rank].sum())
    return call_bytes(rows_out, rows_in, per, n, width, (element_size, element_size), backward=True)


def balanced_all_to_all_bytes(tokens: int, top_k: int, experts: int, ep: int, width: int, element_size: int) -> int:
    """The same for a balanced router: each rank's ``tokens`` x ``top_k`` choices spread evenly over the experts."""
    rows = tokens * top_k * (ep - 1) // ep
    return 8 * (experts // ep) * (ep - 1) + 4 * width * element_size * rows
