"""The output layer split over the vocabulary, and a loss that never puts the logits back together.

A language model's last matmul makes ``(batch, sequence, vocab)`` logits, often the largest activation of the
step (a 128k vocabulary at 8k tokens is 4 GiB in fp32). Megatron splits that layer along the vocabulary (a column
split, no gather) and computes the cross-entropy from the pieces: rank i holds the logits of tokens
``[start, start + V/p)`` only, and the loss needs three all-reduces of one value per token (the max, the sum of
exponentials, the target's logit).

The user's loss code is not ours to rewrite, so the head returns `VocabParallelLogits`: a tensor holding this
rank's slice, which lets through what keeps the vocabulary as its last dimension (``float()``, ``view(-1, V)``
with the full or the local vocabulary size, slicing other dimensions, flattening the leading ones, scaling by a
number as Gemma's soft-capping does) and computes ``F.cross_entropy`` on it vocab-parallel. Anything else
(``argmax``, ``softmax``, a sum over the vocabulary) gets the full logits, gathered over tp with a warning, so
it is still right but no longer saves the memory. Its ``shape`` is the local one (``V/p`` last).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from numbers import Number

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from strategies import comm
from strategies.comm import Axis
from strategies.tensor_parallel.layers import ColumnParallelLinear, gather_from_tp


@dataclass(frozen=True)
class VocabShard:
    """Which columns of the ``vocab`` a rank's logits hold: ``[start, start + vocab // axis.size)``; ``meter``: where
    the full logits' bytes are reported when they have to be gathered."""

    start: int
    vocab: int
    axis: Axis
    meter: object = None


class VocabParallelHead(ColumnParallelLinear):
    """The output layer split over the vocabulary (its output features), returning `VocabParallelLogits`."""

    gathered_bytes = 0  # the largest full logits a fallback gathered (`VocabParallelLogits`), for the monitor

    def forward(self, x: Tensor) -> Tensor:
        local = super().forward(x)
        vocab = self.blocks[0]
        return VocabParallelLogits.wrap(local, VocabShard(self.axis.index * (vocab // self.axis.size), vocab,
                                                          self.axis, self))


# Methods that read a property of the tensor and return no tensor: answered from the local slice (no collective, so
# a rank may call them alone).
_READS = {Tensor.dim, Tensor.size, Tensor.numel, Tensor.element_size, Tensor.is_contiguous, Tensor.data_ptr,
          Tensor.__len__, Tensor.shape.__get__, Tensor.dtype.__get__, Tensor.device.__get__, Tensor.ndim.__get__,
          Tensor.requires_grad.__get__, Tensor.grad_fn.__get__, Tensor.is_leaf.__get__, Tensor.layout.__get__,
          Tensor.is_cuda.__get__, Tensor.stride, Tensor.get_device, Tensor.is_floating_point, Tensor.grad.__get__}
# Methods that act on the tensor object itself (autograd hooks: ZeRO-3 gathers the head again from one), run on it.
_ON_ITSELF = {Tensor.backward, Tensor.register_hook, Tensor.retain_grad, Tensor.requires_grad_}

# Methods that keep every element where it is (the vocabulary stays the last dimension, in the same slice).
_ELEMENTWISE = {Tensor.float, Tensor.half, Tensor.bfloat16, Tensor.double, Tensor.contiguous, Tensor.clone,
                Tensor.detach, Tensor.to, Tensor.cpu, Tensor.cuda, Tensor.type_as, Tensor.tanh, torch.tanh,
                Tensor.__mul__, Tensor.__rmul__, Tensor.__truediv__, Tensor.__add__, Tensor.__radd__, Tensor.__sub__,
                Tensor.mul, Tensor.div, Tensor.add, torch.mul, torch.div}


class VocabParallelLogits(Tensor):
    """Logits of which this rank holds the columns ``[start, start + V/p)`` (`VocabShard`); see the module's text."""

    _shard: VocabShard

    @staticmethod
    def wrap(local: Tensor, shard: VocabShard) -> VocabParallelLogits:
        with torch._C.DisableTorchFunctionSubclass():
            out = local.as_subclass(VocabParallelLogits)
        out._shard = shard
        return out

    def __repr__(self, *, tensor_contents=None) -> str:  # no collective: printing on one rank must not hang
        s = self._shard
        return (f"VocabParallelLogits(columns [{s.start}, {s.start + s.vocab // s.axis.size}) of {s.vocab}, "
                f"local shape {tuple(self.shape)})")

    def __format__(self, spec: str) -> str:
        return self.__repr__()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shard = next(a._shard for a in tree_flatten((args, kwargs))[0] if isinstance(a, VocabParallelLogits))
        if func is F.cross_entropy and _vocab_parallel_loss_fits(args, kwargs):
            return _cross_entropy(shard, *args, **kwargs)
        if func in _ON_ITSELF:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _READS:
            return _plain_call(func, args, kwargs)
        _check_in_place(func, args, kwargs)
        kept = _keeps_vocab(func, args, kwargs, shard)
        if kept is not None:
            out = _plain_call(func, *kept)
            return VocabParallelLogits.wrap(out, shard) if isinstance(out, Tensor) else out
        return _plain_call(func, *_gathered(func, args, kwargs))


def _plain(value):
    return tree_map(lambda v: v.as_subclass(Tensor) if isinstance(v, VocabParallelLogits) else v, value)


def _numbers_only(values) -> bool:
    return all(isinstance(v, (Number, torch.dtype, torch.device, str, bool)) or v is None for v in values)


_IN_PLACE_OPERATORS = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "pow", "matmul", "mod",
                                                "and", "or", "xor", "lshift", "rshift")}


def _check_in_place(func, args, kwargs) -> None:
    """Refuse an in-place change of the logits (``x.div_(c)``, ``x *= c``, ``x[..., 0] = v``): made on a gathered
    copy it would be lost, and the split logits are not changed in place."""
    name = getattr(func, "__name__", "")
    in_place = func is Tensor.__setitem__ or name in _IN_PLACE_OPERATORS or (
        name.endswith("_") and not name.startswith("__"))
    if in_place and func not in _ON_ITSELF and isinstance(args[0] if args else None, VocabParallelLogits):
        raise NotImplementedError(
            f"vocab parallel ('vp'): the logits are split over the vocabulary and {name or func} would change them in "
            "place; compute a new tensor instead (x = x * c, not x *= c), or drop vp")


def _plain_call(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*_plain(tuple(args)), **_plain(dict(kwargs)))


def _keeps_vocab(func, args, kwargs, shard: VocabShard) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` to run ``func`` on the local slice when its result keeps the vocabulary last, else None."""
    logits = args[0] if args else None
    if not isinstance(logits, VocabParallelLogits):
        return None
    rest = [*args[1:], *kwargs.values()]
    if func in _ELEMENTWISE:
        return (args, kwargs) if _numbers_only(rest) else None
    if func in (Tensor.view, Tensor.reshape, torch.reshape):
        shape = tuple(args[1]) if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
        local = shard.vocab // shard.axis.size
        if kwargs or not shape or shape[-1] not in (local, shard.vocab):
            return None
        return (logits, (*shape[:-1], local)), {}
    if func in (Tensor.flatten, torch.flatten):
        given = dict(zip(("start_dim", "end_dim"), args[1:], strict=False)) | kwargs
        return (args, kwargs) if given.get("end_dim", -1) % logits.dim() < logits.dim() - 1 else None
    if func is Tensor.__getitem__ and _index_keeps_last(args[1], logits.dim()):
        return args, kwargs
    return None


def _index_keeps_last(index, ndim: int) -> bool:
    """Whether ``logits[index]`` leaves the last dimension whole: it indexes only leading dimensions (slices or
    integers), or names the last one with ``:``."""
    index = index if isinstance(index, tuple) else (index,)
    if any(i is None or isinstance(i, (Tensor, list, bool)) for i in index):
        return False
    if Ellipsis in index:
        return index[-1] is Ellipsis or index[-1] == slice(None)
    return len(index) < ndim or (len(index) == ndim and index[-1] == slice(None))


def _gathered(func, args, kwargs) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every `VocabParallelLogits` replaced by the full logits (one all-gather over tp,
    which every tp rank makes: they run the same code on the same batch)."""
    def full(value):
        if not isinstance(value, VocabParallelLogits):
            return value  # (tree_map below reaches logits inside lists: torch.cat([logits, ...]))
        shard = value._shard
        with torch._C.DisableTorchFunctionSubclass():
            whole = gather_from_tp(value.as_subclass(Tensor), shard.axis)
        if shard.meter is not None:
            shard.meter.gathered_bytes = max(shard.meter.gathered_bytes, whole.numel() * whole.element_size())
        return whole

    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    warnings.warn(f"vocab parallel ('vp'): {name} needs the whole vocabulary, so the logits were gathered over tp "
                  "for it (right, but their memory is no longer split). Only F.cross_entropy on the logits (after "
                  "float/view/reshape/slicing of other dimensions) keeps them split.", stacklevel=3)
    return tree_map(full, tuple(args)), tree_map(full, dict(kwargs))


def _vocab_parallel_loss_fits(args, kwargs) -> bool:
    """Whether ``F.cross_entropy(*args, **kwargs)`` is one this module computes vocab-parallel: logits
    ``(tokens, vocab)`` and integer targets, no class weights, no label smoothing."""
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    given = dict(zip(names, args, strict=False)) | kwargs
    logits, target = given.get("input"), given.get("target")
    return (isinstance(logits, VocabParallelLogits) and logits.dim() == 2 and isinstance(target, Tensor)
            and not target.is_floating_point() and not isinstance(target, VocabParallelLogits)
            and given.get("weight") is None and given.get("size_average") is None and given.get("reduce") is None
            and not given.get("label_smoothing", 0.0))


def _cross_entropy(shard: VocabShard, input, target, weight=None, size_average=None, ignore_index: int = -100,
                   reduce=None, reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        local = input.as_subclass(Tensor)
    ignored = target == ignore_index
    per_token = vocab_parallel_cross_entropy(local, target.masked_fill(ignored, 0), shard.start,
                                             shard.axis).masked_fill(ignored, 0.0)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (~ignored).sum()  # torch's mean: over the targets not ignored


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, start: int, axis: Axis) -> Tensor:
        # Stable softmax over the whole vocabulary from per-rank pieces: max, then sum of exp, then the
        # target's logit, each a small all-reduce of (tokens,) values; never the (tokens, vocab) logits.
        # One float32 copy of the logits, shifted, exponentiated and normalised in place (Megatron's way): the
        # logits' size in float32 once, not three times (Llama 3 70B, 16 x 8,192 tokens per rank, tp8: 8 GiB each).
        logits_dtype, logits = logits.dtype, _plain(logits)  # (a caller's split logits: this rank's slice, as is)
        global_max = logits.max(dim=-1).values.float()
        comm.all_reduce(global_max, axis, op=torch.distributed.ReduceOp.MAX)
        shifted = logits.to(torch.float32, copy=True).sub_(global_max.unsqueeze(-1))
        local = target - start
        inside = (local >= 0) & (local < logits.shape[-1])
        local = local.clamp(0, logits.shape[-1] - 1)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        exp = shifted.exp_()
        both = torch.stack([exp.sum(dim=-1), picked])
        comm.all_reduce(both, axis)
        sum_exp, picked = both[0], both[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, inside)
        ctx.dtype = logits_dtype
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx, grad: Tensor):
        softmax, local, inside = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -inside.to(softmax.dtype).unsqueeze(-1))
        return (grad_logits * grad.unsqueeze(-1)).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, start: int, axis: Axis) -> Tensor:
    """Per-token cross-entropy of logits split along the vocabulary (this rank holds columns
    [start, start + logits.shape[-1])), equal to ``F.cross_entropy(full_logits, target, reduction="none")``."""
    if axis.size == 1:
        return F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), reduction="none").view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, start, axis)
