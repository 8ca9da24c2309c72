"""The textbook parameter server: every worker sends its full gradients to one server rank."""

from __future__ import annotations

import torch
from torch import nn

from strategies import comm
from strategies.comm import Axis
from strategies.data_parallel.sync import GradSync, assign_grads


class NaiveDataParallel(GradSync):
    """The textbook parameter server: workers send full gradients to one server rank, which averages them.

    Per step the server receives (N-1)*Psi elements and sends (N-1)*Psi back: 2(N-1)*Psi in all, which is
    why it does not scale and why DDP replaces it with an all-reduce that spreads the traffic evenly.
    """

    def __init__(self, module: nn.Module, axis: Axis, server: int = 0, find_unused_parameters: bool = False):
        super().__init__(module, axis, find_unused_parameters)
        if not 0 <= server < axis.size:
            raise ValueError(f"server rank {server} is not on the data-parallel axis of size {axis.size}")
        self.server = server

    def finish(self) -> None:
        if not self.require_sync or self.axis.size == 1 or not self.params:
            return
        missing = [name for name, p in self.named_params if p.grad is None]
        if missing and not self.find_unused_parameters:
            raise self._unused_error(missing)
        # One flat message each way. With find_unused_parameters, "used" flags ride at its end so that a
        # parameter no rank used keeps grad None; without, the message is exactly Psi elements.
        parts = [_flat_grad(p) for p in self.params]
        flags = len(self.params) if self.find_unused_parameters else 0
        flat = torch.cat(parts + ([_used_flags(self.params)] if flags else []))
        if self.axis.index == self.server:
            incoming = torch.empty_like(flat)
            for worker in range(self.axis.size):
                if worker != self.server:
                    comm.recv(incoming, self.axis, src=worker)
                    flat += incoming
            flat[: flat.numel() - flags] /= self.axis.size
            for worker in range(self.axis.size):
                if worker != self.server:
                    comm.send(flat, self.axis, dst=worker)
        else:
            comm.send(flat, self.axis, dst=self.server)
            comm.recv(flat, self.axis, src=self.server)
        grads = torch.split(flat[: flat.numel() - flags], [p.numel() for p in self.params])
        assign_grads(self.params, list(grads), flat[flat.numel() - flags :] if flags else None)



def _flat_grad(p: nn.Parameter) -> torch.Tensor:
    return p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)


def _used_flags(params: list[nn.Parameter]) -> torch.Tensor:
    dtype, device = params[0].dtype, params[0].device
    return torch.tensor([float(p.grad is not None) for p in params], dtype=dtype, device=device)
