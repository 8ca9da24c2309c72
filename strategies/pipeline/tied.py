"""Weights the forward uses both before and after the blocks (a head tied to the embedding), as Megatron ties its
word embeddings across pipeline stages: the first and the last stage each hold the weight, each computes its own
share of the gradient, and the two shares are summed, so both copies take the same step and stay equal.

The sum must reach every technique that holds the gradient (data parallel's buckets, ZeRO's shards), whose
layouts differ between the two stages. So each share is kept aside during the schedule (a hook on the parameter
takes it, and the parameter's own gradient sees zeros, which data parallel reduces as usual); after the backward,
the two stages exchange their shares, average the sum over the data-parallel axis, and write it into the
gradient each technique holds (`HeldGrad`, a ZeRO piece at its offset). The exchange runs after the schedule, the
last stage sending its share before it receives the sum and the first stage receiving the share before it sends the
sum, so each pair's messages match in the order issued, as NCCL requires (no grouping needed). The average over dp
is taken on the first stage's dp group and sent to the last stage, so the two copies get the same bits (two groups'
all-reduces need not sum in the same order); likewise the last stage starts from the first stage's copy.
"""

from __future__ import annotations

import torch
from torch import nn

from strategies import comm
from strategies.comm import Axis
from strategies.technique import HeldGrad


class TiedWeights:
    """The parameters ``names`` of ``module``, held by the ranks ``first`` and ``last`` of the pp ``axis``."""

    def __init__(self, module: nn.Module, names: list[str], axis: Axis, dp: Axis, first: int, last: int) -> None:
        self.axis, self.dp = axis, dp
        self.params = [module.get_parameter(name) for name in names]
        self.is_first = axis.index == first
        # One rank holding both stages (a V placement) holds one copy, whose gradient sums both shares already.
        self.peer = None if first == last else last if self.is_first else first if axis.index == last else None
        self.shares: dict[int, torch.Tensor] = {}
        self._hooks = [p.register_hook(self._keep(k)) for k, p in enumerate(self.params)] if self.peer is not None \
            else []
        with torch.no_grad():  # the two copies start equal: the first stage's (as Megatron's embedding group does)
            for param in self.params if self.peer is not None else []:
                self._from_first(param.data)

    def _from_first(self, tensor: torch.Tensor) -> None:
        if self.is_first:
            comm.send(tensor.contiguous(), self.axis, self.peer, "tied")
        else:
            received = torch.empty_like(tensor)
            comm.recv(received, self.axis, self.peer, "tied")
            tensor.copy_(received)

    def _keep(self, k: int):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if k in self.shares:
                self.shares[k].add_(grad)
            else:
                self.shares[k] = grad.detach().clone()
            return torch.zeros_like(grad)
        return hook

    def is_copy(self, param: nn.Parameter) -> bool:
        """Whether this rank's gradient of ``param`` is the second copy (the last stage's): not counted twice."""
        return self.peer is not None and not self.is_first and any(param is p for p in self.params)

    def reduce(self, held: list[HeldGrad]) -> None:
        """Sum the two stages' shares, average over dp, and write the result into the gradients ``held``."""
        if self.peer is None:
            return
        for k, param in enumerate(self.params):
            mine = self.shares.pop(k, None)
            mine = torch.zeros_like(param) if mine is None else mine
            if self.is_first:  # receives the last stage's share, sums, averages over its dp group, sends the result
                theirs = torch.empty_like(mine)
                comm.recv(theirs, self.axis, self.peer, "tied share")
                total = mine + theirs
                if self.dp.size > 1:
                    comm.all_reduce(total, self.dp)
                    total /= self.dp.size
                comm.send(total, self.axis, self.peer, "tied sum")
            else:
                comm.send(mine, self.axis, self.peer, "tied share")
                total = torch.empty_like(mine)
                comm.recv(total, self.axis, self.peer, "tied sum")
            flat = total.reshape(-1)
            for h in held:
                if h.param is param:
                    h.grad.copy_(flat[h.start : h.start + h.grad.numel()].view_as(h.grad))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
