"""The heap of a rehearsal: every meta tensor's storage, counted from when torch makes it to when torch frees it.

A rehearsal (`strategies.lightning.rehearsal`) runs one rank's real code on meta tensors: shapes, no memory. This
dispatch mode sees the outputs of every op; a storage it has not seen counts its bytes until it is freed (a weak
reference to the storage, whose Python object torch keeps as long as any tensor uses it), and a storage resized in
place (ZeRO-3 frees a gathered unit so) counts its new size. It offers `HeapSampler`'s interface (``in_use``,
``peak``, ``restart``, ``start``), so the `StrategyMonitor` reads a rehearsal's memory by the rules it reads a real
run's heap with. Unlike the heap it is exact: no allocator's rounding, no backend's buffers, no sampling interval.

A meta tensor has no values. A scalar read on the host (``.item()``: a logged loss, the optimizer's step count, a
finite-loss check; or copied to the CPU: Lightning's logged values at the end) reads as one, so that the code around
it runs on (a step count of 1, a finite loss). Copying a larger meta tensor to a real device still fails, as it
should: a rehearsal never makes the model's values.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from strategies.tensors import making_host_memory, making_unmade_shapes

_aten = torch.ops.aten
_READS = {_aten._local_scalar_dense.default}
_META = torch.device("meta")


class MetaHeap:
    """Live bytes of meta storages, and their peak (see the module's docstring), counted while `tracking` is on:
    enter it around everything the rehearsal runs (a storage made outside is not counted). Entered as a sampler
    (the monitor does), it only starts a new peak."""

    device = "meta"  # the tensors it counts

    def __init__(self, workspace: Callable[..., float] | None = None, device_only: bool = False) -> None:
        self.live = self.peak = self.start = 0
        self.paused = 0  # inside `uncounted`
        self._sizes: dict[int, int] = {}  # storage (its C pointer) -> bytes counted
        # Host memory (`tensors.host_memory`: offload's copies, and what is computed from them alone) is counted in
        # ``host``; with ``device_only`` (a GPU rehearsed) it is not in ``live`` and ``peak``, which are the device's,
        # as a GPU's allocator holds only its own (one pool on a CPU).
        self.device_only, self.host = device_only, 0
        self._host: set[int] = set()  # the host's storages
        # What a kernel holds while it runs beyond its outputs on the device rehearsed, given the op and its
        # (meta) arguments: on a CPU, MKL's packing buffers and the fused attention's (`calibrate.op_workspace`);
        # None: nothing
        self.workspace = workspace

    # -- HeapSampler's interface ---------------------------------------------------------------------------

    @staticmethod
    def available() -> bool:
        return True

    def in_use(self) -> int:
        return self.live

    def sample(self) -> None:  # exact already: every change updates the peak
        pass

    def restart(self) -> tuple[int, int]:
        before, self.peak = self.peak, self.live
        return max(before, self.peak), self.peak

    def __enter__(self) -> MetaHeap:
        self.start = self.peak = self.live
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    @property
    def peak_above_start(self) -> int:
        return self.peak - self.start

    # -- counting ------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def tracking(self) -> Iterator[MetaHeap]:
        original = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:  # not an op the dispatch mode sees
            out = original(storage, size)
            self._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        _ACTIVE.append(self)
        try:
            with _Counting(self):
                yield self
        finally:
            _ACTIVE.remove(self)
            torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]

    def count(self, storage: torch.UntypedStorage, host: bool = False) -> None:
        key = storage._cdata
        if key in self._sizes or self.paused or making_unmade_shapes():
            return
        size = storage.nbytes()
        self._sizes[key] = size
        if host:
            self._host.add(key)
        self._change(size, key)
        weakref.finalize(storage, self._freed, key)

    def on_host(self, storage: torch.UntypedStorage) -> bool:
        return storage._cdata in self._host

    def _freed(self, key: int) -> None:
        self._change(-self._sizes.pop(key, 0), key)
        self._host.discard(key)

    def _change(self, delta: int, key: int | None = None) -> None:
        if key is not None and key in self._host:
            self.host += delta
            if self.device_only:
                return
        self.live += delta
        if self.live > self.peak:
            self.peak = self.live

    def transient(self, size: float) -> None:
        """``size`` more bytes, held for a moment only: a peak, nothing left."""
        self.peak = max(self.peak, self.live + int(size))

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._sizes:
            self._change(storage.nbytes() - self._sizes[key], key)
            self._sizes[key] = storage.nbytes()


_ACTIVE: list[MetaHeap] = []  # the heaps tracking now (`MetaHeap.tracking`)


def holds(storage: torch.UntypedStorage) -> bool:
    """Whether a meta storage stands for memory: in a rehearsal, where its heap counts it (a parameter made, not a
    model's shapes before its slices are made); outside one, never (a real run's meta tensors are shapes)."""
    return any(storage._cdata in heap._sizes for heap in _ACTIVE)


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Inside, the meta tensors made are what is meta in a real run too (a model's shapes before its slices are made,
    the pipeline's trace on shapes): no memory there, so none counted here. Outside a rehearsal: nothing."""
    for heap in _ACTIVE:
        heap.paused += 1
    try:
        yield
    finally:
        for heap in _ACTIVE:
            heap.paused -= 1


class _Counting(TorchDispatchMode):
    """Every op's meta outputs, counted in ``heap``; a meta scalar read on the host reads as one."""

    def __init__(self, heap: MetaHeap) -> None:
        super().__init__()
        self.heap = heap

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        meta = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        if meta and func in _READS:
            return _ones_value(meta[0].dtype)
        if meta and func is _aten._to_copy.default and meta[0].numel() == 1 and \
                kwargs.get("device") not in (None, _META):  # a logged value, moved to the CPU at the end
            return torch.ones(meta[0].shape, dtype=kwargs.get("dtype") or meta[0].dtype, device=kwargs["device"])
        out = func(*args, **kwargs)
        # host memory: made inside `host_memory`, or computed from host tensors alone (the optimizer's state and step)
        host = making_host_memory() or (bool(meta) and all(self.heap.on_host(t.untyped_storage()) for t in meta))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                self.heap.count(t.untyped_storage(), host)
        if meta and self.heap.workspace is not None:
            self.heap.transient(self.heap.workspace(func, args, kwargs))
        return out


def _ones_value(dtype: torch.dtype) -> bool | int | float:
    if dtype == torch.bool:
        return True
    return 1.0 if dtype.is_floating_point or dtype.is_complex else 1
