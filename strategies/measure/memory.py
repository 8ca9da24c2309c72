"""What each rank really holds: bytes of parameters, gradients and optimizer states, counted from tensors.

Tensors are deduplicated by storage (a parameter that is a view of a flat buffer counts once, with the
buffer), and a storage is counted whole: padding included, a freed (resized-to-zero) one as 0.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from strategies.measure.meta_heap import holds
from strategies.runs.schema import MODEL_STATE
from strategies.tensors import storage_id


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    return (t.device, storage_id(t))


def count_bytes(groups: dict[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """Bytes per category; a storage already counted under an earlier category is not counted again. (Read at
    every step's end, for a thousand tensors and more: each storage is asked for once.)"""
    seen: set[tuple[torch.device, int]] = set()
    out = {}
    for category, tensors in groups.items():
        total = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            key = (t.device, storage._cdata if t.device.type == "meta" else storage.data_ptr())  # (`storage_id`)
            if nbytes == 0 or key in seen or t.device.type == "meta" and not holds(storage):
                continue
            seen.add(key)
            total += nbytes
        out[category] = total
    return out


def model_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = (),
                      extra: dict[str, list[torch.Tensor]] | None = None) -> dict[str, int]:
    """Per-category bytes of this rank's model state: the module's parameters and gradients, ``extra`` tensors
    by category (what the techniques hold: DDP buckets, ZeRO shards) and the optimizers' states. With ZeRO
    offload, the master shards, their gradients and the optimizer states are the "host" category."""
    extra = extra or {}
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    offloaded = bool(extra.get("host"))
    groups = {
        "params": [p for p in module.parameters()] + list(extra.get("params", [])),
        "grads": [p.grad for p in module.parameters()] + list(extra.get("grads", [])),
        "optimizer": [] if offloaded else state,
        "host": list(extra.get("host", [])) + (state if offloaded else []),
    }
    result = count_bytes(groups)
    result["total"] = sum(result[c] for c in MODEL_STATE)
    return result


class LogitsMeter:
    """Bytes of the logits this rank holds: the largest output of the model's output layer (its vocabulary slice
    under vocab parallel), plus the full logits when a loss had to gather them (``gathered_bytes`` of the layer)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer, self.output_bytes = layer, 0
        self._hook = layer.register_forward_hook(self._seen)

    def _seen(self, module: nn.Module, args, output) -> None:
        if isinstance(output, torch.Tensor):
            self.output_bytes = max(self.output_bytes, output.numel() * output.element_size())

    @property
    def bytes(self) -> int:
        return self.output_bytes + getattr(self.layer, "gathered_bytes", 0)

    def remove(self) -> None:
        self._hook.remove()


class SavedTensorsMeter:
    """Bytes autograd saves for backward while a forward runs (activations), parameters left out.

    Use as a context manager around the forward (and, under pipeline parallel, the backwards that run
    inside the same step). ``bytes`` is the peak of what was held at once: each saved storage counts from
    its first save until autograd drops the last reference to it (after its backward). Without a backward
    inside the context that is everything saved, since nothing is freed before backward starts.
    """

    def __init__(self, module: nn.Module | None = None, param_buffers=None) -> None:
        # The parameters' storages, read at the first save: a pipeline's first step makes the rank's blocks (a model
        # built on meta) and cuts away the others after the meter starts. Read at the start, the parameters made then
        # counted as activations, and an activation at a freed parameter's address went uncounted: a pipeline rank's
        # figure moved by up to 10% run to run, with where malloc put them.
        self._module, self._exclude = module, None
        # ZeRO-3 gathers parameters into storage that did not exist when the meter started.
        self._param_buffers = param_buffers or (lambda: ())
        # Their bytes when gathered (fixed): a saved storage of another size is none of them, found without asking
        # each one where it is (a 70B model has 80)
        self._buffer_count, self._buffer_sizes = 0, set()
        self._live: dict[tuple[str, int], list[int]] = {}  # storage -> [references held, bytes]
        self.live = 0
        self.bytes = 0
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if self._exclude is None:
            self._exclude = {_storage_key(p) for p in self._module.parameters()} if self._module is not None else set()
        if key in self._exclude:
            return t
        buffers = self._param_buffers() if key not in self._live else ()
        if buffers and len(buffers) != self._buffer_count:  # (a pipeline adds ZeRO-3 in its first step)
            self._buffer_sizes = {b.numel() * b.element_size() for b in buffers}
            self._buffer_count = len(buffers)
        if buffers and t.untyped_storage().nbytes() in self._buffer_sizes and \
                any(_storage_key(b) == key for b in buffers):
            # A gathered ZeRO-3 unit: asked each time, not remembered. It moves when gathered again, and the address it
            # left may hold an activation next (remembered, such activations went uncounted: up to 5% of the peak).
            return t
        entry = self._live.setdefault(key, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.bytes = max(self.bytes, self.live)
        entry[0] += 1
        return _Held(t, self, key)

    def keep(self, tensors: tuple[torch.Tensor, ...]) -> list[_Held]:
        """Count ``tensors`` as held for backward until the returned handles are dropped: what a zero-bubble
        schedule's B keeps for its W (the linears' inputs and output gradients) after autograd let go of them."""
        return [held for t in tensors if isinstance(held := self._pack(t), _Held)]

    def _release(self, key: tuple[str, int]) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._live[key]

    def __enter__(self) -> SavedTensorsMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Held:
    """What autograd keeps in place of a saved tensor: it tells the meter when autograd lets go of it."""

    __slots__ = ("tensor", "_meter", "_key")

    def __init__(self, tensor: torch.Tensor, meter: SavedTensorsMeter, key) -> None:
        self.tensor, self._meter, self._key = tensor, meter, key

    def __del__(self) -> None:
        self._meter._release(self._key)


def _unpack(held):
    return held.tensor if isinstance(held, _Held) else held


class HeapSampler:
    """The most bytes this process's C heap held while the ``with`` block ran, above what it held at the start.

    glibc's ``mallinfo2`` (every arena plus the mmapped blocks: every CPU tensor's storage, and the comm
    backend's buffers) read by a thread every ``interval_s``; torch runs its ops without the GIL, so the
    thread samples during forward and backward too. On CPU torch keeps no allocator counters, and its
    profiler's memory events miss frees made on other threads (gloo's), so it sees memory pile up that
    malloc does not. Linux with glibc only (`available`); a sample can miss a peak shorter than the interval.
    """

    def __init__(self, interval_s: float = 2e-4) -> None:
        import threading

        self.interval_s, self.peak, self.start = interval_s, 0, 0
        self._lock = threading.Lock()  # `restart` and the thread's samples, one at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def available() -> bool:
        return _mallinfo() is not None

    @staticmethod
    def in_use() -> int:
        info = _mallinfo()
        if info is None:
            raise RuntimeError("HeapSampler needs glibc's mallinfo2 (Linux)")
        return info()

    def sample(self) -> None:
        with self._lock:
            self.peak = max(self.peak, self.in_use())

    def restart(self) -> tuple[int, int]:
        """Start a new peak from what is in use now; return the peak so far and what is in use now."""
        with self._lock:
            before, self.peak = self.peak, self.in_use()
            return max(before, self.peak), self.peak

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "HeapSampler":
        self.start = self.peak = self.in_use()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    @property
    def peak_above_start(self) -> int:
        return self.peak - self.start


class CudaHeap:
    """`HeapSampler`'s interface over the CUDA caching allocator's counters (bytes allocated and their peak): exact,
    nothing sampled, and only the device's memory (a host copy, offload's, is not in it). For the monitor's ``heap``
    on a GPU, where there is no C heap to sample: a real-tensor rehearsal (`stratpack rehearse --real`)."""

    device = "cuda"  # the tensors it counts
    device_only = True  # offload's host copies are not in it

    def __init__(self, index: int | None = None) -> None:
        self.index = torch.cuda.current_device() if index is None else index
        self.start = 0

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available()

    def in_use(self) -> int:
        return torch.cuda.memory_allocated(self.index)

    @property
    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.index)

    def sample(self) -> None:  # the allocator keeps its own peak
        pass

    def restart(self) -> tuple[int, int]:
        before = self.peak
        torch.cuda.reset_peak_memory_stats(self.index)
        return before, self.in_use()

    def __enter__(self) -> "CudaHeap":
        torch.cuda.reset_peak_memory_stats(self.index)
        self.start = self.in_use()
        return self

    def __exit__(self, *exc) -> None:
        pass

    @property
    def peak_above_start(self) -> int:
        return self.peak - self.start


@functools.cache
def _mallinfo():
    """A function returning glibc's bytes in use (arenas + mmapped), or None where there is no mallinfo2."""
    import ctypes
    import ctypes.util

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                         "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        call = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    call.restype = Info

    def in_use() -> int:
        info = call()
        return info.uordblks + info.hblkhd
    return in_use
