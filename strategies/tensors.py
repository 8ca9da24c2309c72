"""Where a tensor's memory is, in a form that holds on the meta device too.

Every meta tensor has data pointer 0 (a rehearsal's, `strategies.lightning.rehearsal`, are all meta), so code that
asks "is this gradient already the slot of its bucket?" by ``data_ptr()`` would answer yes for any two. These answer
by the storage itself there.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from strategies.mixed_precision import shared_cast


def storage_id(t: torch.Tensor) -> int:
    """One number per storage while it lives: its data pointer, or on meta the storage object's own."""
    storage = t.untyped_storage()
    return storage._cdata if t.device.type == "meta" else storage.data_ptr()


def address(t: torch.Tensor) -> tuple[int, int]:
    """Where ``t``'s first element is: (its storage, the byte offset in it); on a real device the same test as
    comparing ``data_ptr()``."""
    if t.device.type == "meta":
        return storage_id(t), t.storage_offset() * t.element_size()
    return t.data_ptr(), 0


_HOST = [0]  # inside `host_memory` (nested)


@contextlib.contextmanager
def _raised(flag: list[int]) -> Any:
    """``flag[0]`` one higher inside (nested: a count)."""
    flag[0] += 1
    try:
        yield
    finally:
        flag[0] -= 1


def host_memory() -> Any:
    """Inside, the storages made are host memory: offload's copies of a device's tensors. On a device they are made
    on the CPU and say so; a rehearsal's are meta like the rest, and its heap (`measure.meta_heap`) counts them apart
    from the device's while this is on (and what is computed from them alone: the optimizer's state and step)."""
    return _raised(_HOST)


def making_host_memory() -> bool:
    return _HOST[0] > 0


_LATER = [0]  # inside `unmade_shapes`


def unmade_shapes() -> Any:
    """Inside, the meta tensors made are shapes in a real run too (a slice a rank makes later, if at all): a
    rehearsal's heap (`measure.meta_heap`) counts none of them."""
    return _raised(_LATER)


def making_unmade_shapes() -> bool:
    return _LATER[0] > 0


class MetaAutocast(torch.overrides.TorchFunctionMode):
    """Autocast for meta tensors, which torch's autocast leaves alone (it knows no meta device): while the host's
    autocast is on (Lightning's ``*-mixed`` precision turns it on around each step), a matmul or attention on meta
    floats computes in the autocast dtype and a norm, softmax or loss in float32, as on the device rehearsed, so that
    what autograd saves has the size it would have there. Above autograd, as autocast is: the casts are saved.
    ``device_type``: whose autocast is on here (the host's); ``target``: whose lists the device rehearsed keeps
    (CUDA's computes norms and softmax in float32, the CPU's keeps them in the half dtype: only the losses float32)."""

    def __init__(self, device_type: str = "cpu", target: str = "cuda") -> None:
        super().__init__()
        self.device_type, self.target = device_type, target

    def __enter__(self) -> MetaAutocast:
        _AUTOCASTING.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _AUTOCASTING.remove(self)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        high = _HIGH if self.target == "cuda" else _HIGH_CPU
        if func in _LOW or func in high:
            if torch.is_autocast_enabled(self.device_type):
                dtype = torch.get_autocast_dtype(self.device_type) if func in _LOW else torch.float32
                args, kwargs = meta_cast((args, kwargs), dtype)
        return func(*args, **kwargs)


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes a matmul on ``x`` in, or None. A rehearsal's meta tensors follow the host's autocast,
    as `MetaAutocast` makes F.linear do (autocast has no meta device)."""
    host = x.device.type if x.device.type != "meta" else "cpu"
    return torch.get_autocast_dtype(host) if torch.is_autocast_enabled(host) else None


def meta_cast(tree: Any, dtype: torch.dtype) -> Any:
    """Every meta float in ``tree`` in ``dtype``; a weight's copy once per step where autocast's cache would keep it
    (`mixed_precision.shared_cast`)."""
    from torch.utils._pytree import tree_map

    def cast(t: Any) -> Any:
        meta_float = isinstance(t, torch.Tensor) and t.device.type == "meta" and t.is_floating_point()
        return shared_cast(t, dtype) if meta_float and t.dtype != dtype else t
    return tree_map(cast, tree)


_F = torch.nn.functional
_LOW = {_F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.Tensor.matmul,
        torch.Tensor.__matmul__, _F.scaled_dot_product_attention}
_HIGH = {_F.layer_norm, _F.softmax, _F.log_softmax, _F.cross_entropy, _F.nll_loss, torch.softmax, torch.log_softmax,
         torch.layer_norm, _F.group_norm}
_HIGH_CPU = {_F.cross_entropy, _F.nll_loss}  # (torch's CPU autocast: norms and softmax stay in bf16)


_AUTOCASTING: list[MetaAutocast] = []  # entered now


def meta_autocast_again() -> Any:
    """`MetaAutocast` entered again where it is on (a recompute inside backward, which runs without it), else
    nothing."""
    return MetaAutocast(_AUTOCASTING[-1].device_type, _AUTOCASTING[-1].target) if _AUTOCASTING else \
        contextlib.nullcontext()


# A number read off a meta tensor while a step is traced on shapes: `StandInReads`.
_NUMBER_READS = {torch.Tensor.item: 1.0, torch.Tensor.__float__: 1.0, torch.Tensor.__int__: 1,
                 torch.Tensor.__index__: 1}


class StandInReads(torch.overrides.TorchFunctionMode):
    """While a step runs on meta tensors to learn shapes (the pipeline's trace of a model built in configure_model),
    a number read off a meta tensor (``loss.item()``, ``float(loss)``, ``int(n)``: a user's logging, a perplexity)
    gets a stand-in, 1, instead of torch's "cannot be called on meta tensors": nothing read there reaches the
    model's shapes. A truth value (``if``, ``assert`` on a tensor) gets none: no stand-in is right for both branches.
    The read of a real tensor is untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NUMBER_READS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            value = _NUMBER_READS[func]
            return float(value) if args[0].is_floating_point() and func is torch.Tensor.item else value
        return func(*args, **kwargs)
