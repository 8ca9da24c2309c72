"""What every data-parallel gradient synchroniser shares: the ``no_sync`` window and the technique's hooks.

A synchroniser leaves the module itself untouched (no forward wrapper): it hooks the parameters' gradients and,
after the backward of a step that syncs, makes every ``param.grad`` hold the average over the data-parallel
axis. Each rank then steps its own optimizer, so the replicas stay identical.

Gradient accumulation: inside ``no_sync()`` nothing is communicated and gradients accumulate locally, as
nanoGPT puts it: "we only need to sync gradients at the last micro step".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from strategies import comm
from strategies.comm import Axis
from strategies.technique import HeldGrad, Technique
from strategies.tensors import address


def broadcast_module(module: nn.Module, axis: Axis) -> None:
    """Make every replica start from axis index 0's parameters and buffers (what torch DDP does). Parameters still
    on the meta device are left out: `deferred.Deferred` makes them alike on every rank."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if tensor.device.type != "meta":
                comm.broadcast(tensor.data, axis, src=0)


class GradSync(Technique):
    """A gradient synchroniser over the data-parallel ``axis``: ``no_sync()``, then ``finish()`` after backward."""

    def __init__(self, module: nn.Module, axis: Axis, find_unused_parameters: bool = False,
                 include: Callable[[str], bool] | None = None) -> None:
        self.axis = axis
        self.find_unused_parameters = find_unused_parameters
        # include: which parameters, by name, this one syncs (expert parallel's go over an axis of their own)
        self.named_params = [(n, p) for n, p in module.named_parameters()
                             if p.requires_grad and (include is None or include(n))]
        self.params = [p for _, p in self.named_params]
        self.require_sync = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside this context syncs the sum."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def finish(self) -> None:
        """Called after backward: on a syncing step, leave dp-averaged gradients in ``param.grad``."""
        raise NotImplementedError

    def remove(self) -> None:
        """Undo any hooks."""

    def finish_backward(self, held_grads: Callable[[], list[HeldGrad]], sync: bool) -> None:
        self.finish()  # inside no_sync it has nothing to reduce (ZeRO-3 still frees what it gathered)

    def teardown(self, healthy: bool) -> None:
        self.remove()

    def _unused_error(self, missing: list[str]) -> RuntimeError:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        return RuntimeError(
            f"{len(missing)} parameter(s) got no gradient in this step: {shown}. Data parallel needs every "
            "rank to reduce the same tensors. If parameters are unused on purpose, pass "
            "find_unused_parameters=True to the strategy (e.g. DataParallelStrategy(find_unused_parameters=True)),"
            " or freeze them with requires_grad_(False)."
        )



def assign_grads(params: list[nn.Parameter], grads: list[torch.Tensor], used: torch.Tensor | None) -> None:
    """Point each ``param.grad`` at its reduced gradient (a view, no copy); None where no rank used it."""
    flags = used.tolist() if used is not None else None  # one device-to-host copy, not one per parameter
    for k, (p, grad) in enumerate(zip(params, grads)):
        if flags is not None and flags[k] == 0:
            p.grad = None
        elif p.grad is None or address(p.grad) != address(grad):
            p.grad = grad.view_as(p)
