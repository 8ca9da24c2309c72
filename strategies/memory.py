"""What each rank really holds: bytes of parameters, gradients and optimizer states, counted from tensors.

Tensors are deduplicated by storage (a parameter that is a view of a flat buffer counts once, with the
buffer), and a storage is counted whole: padding included, a freed (resized-to-zero) one as 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

CATEGORIES = ("params", "grads", "optimizer", "host")


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr())


def count_bytes(groups: dict[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """Bytes per category; a storage already counted under an earlier category is not counted again."""
    seen: set[tuple[str, int]] = set()
    out = {}
    for category, tensors in groups.items():
        total = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            if key in seen or t.untyped_storage().nbytes() == 0:
                continue
            seen.add(key)
            total += t.untyped_storage().nbytes()
        out[category] = total
    return out


def model_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = (),
                      grad_sync=None) -> dict[str, int]:
    """Per-category bytes of this rank's model state: the module's parameters and gradients, the
    synchroniser's buffers (DDP buckets, ZeRO shards) and the optimizers' states. With ZeRO offload, the
    master shards, their gradients and the optimizer states are the "host" category."""
    extra = grad_sync.memory_tensors() if grad_sync is not None else {}
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    offloaded = bool(extra.get("host"))
    groups = {
        "params": [p for p in module.parameters()] + list(extra.get("params", [])),
        "grads": [p.grad for p in module.parameters()] + list(extra.get("grads", [])),
        "optimizer": [] if offloaded else state,
        "host": list(extra.get("host", [])) + (state if offloaded else []),
    }
    result = count_bytes(groups)
    result["total"] = sum(result[c] for c in CATEGORIES)
    return result


class SavedTensorsMeter:
    """Bytes autograd saves for backward while a forward runs (activations), parameters left out.

    Use as a context manager around the forward; ``bytes`` is what was saved, which is the peak, since
    nothing saved is freed before backward starts. Storages are counted once.
    """

    def __init__(self, module: nn.Module | None = None, param_buffers=None) -> None:
        self._exclude = {_storage_key(p) for p in module.parameters()} if module is not None else set()
        # ZeRO-3 gathers parameters into storage that did not exist when the meter started.
        self._param_buffers = param_buffers or (lambda: ())
        self._seen: set[tuple[str, int]] = set()
        self.bytes = 0
        self._hooks = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key in self._exclude or key in self._seen:
            return t
        if any(_storage_key(b) == key for b in self._param_buffers()):
            self._exclude.add(key)
        else:
            self._seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self) -> SavedTensorsMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
