"""Weight gradients split off a backward, for the zero-bubble schedules: B computes the gradient of the stage's input
(what the previous stage waits for) now, W the gradients of its weights (what nobody waits for) later.

The design (Megatron's zero-bubble implementation does the same for its linear layers): the matmul weights are where
a backward's second half of the work is, so while a split schedule runs a stage, ``F.linear`` of a weight of the
user's blocks is `deferred_linear`, an autograd function whose backward returns the input's and the bias's gradients
and, instead of the weight's, puts ``(weight, input, output gradient)`` in the `WeightStore` under the
(stage, microbatch) whose B is running. Every other parameter (norms, embeddings, biases, a GPT-2 ``Conv1D``) gets
its gradient in B as usual, and so does a linear outside the blocks: the head's output gradient is logits-sized (a
vocabulary per token), and keeping it for a W made ZB-H1's last stage hold more than 1F1B's (+7% activation peak
measured at pp4 before this rule). W then computes
``dW = dY^T X`` for each stored triple and hands all of them to autograd at once (`_Accumulate`), so each weight's
gradient is accumulated by autograd's own ``AccumulateGrad``, and every hook on it runs as it would in a full
backward: data parallel's buckets, ZeRO's flats and shards, the tied-weight shares. Which backward syncs over dp
follows the actions: a stage's last B for the parameters B finishes, its last W for the weights.

Mixed precision: under autocast the matmuls run in autocast's dtype, as ``F.linear`` would, and the weight's
gradient is cast back to its own dtype before it is accumulated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from strategies.mixed_precision import shared_cast, standing_for
from strategies.tensors import autocast_dtype as _autocast_dtype
from strategies.tensors import storage_id

_ORIGINAL_LINEAR = F.linear
Key = tuple[int, int]  # (stage, microbatch)


class WeightStore:
    """The weight gradients B deferred, by (stage, microbatch), until their W."""

    def __init__(self, deferrable: list[Tensor]) -> None:
        self.deferrable = {id(p) for p in deferrable}  # the weights whose gradients wait for W: the blocks'
        self.pending: dict[Key, list[tuple[Tensor, Tensor, Tensor, Any]]] = {}
        self.key: Key | None = None  # the B running now, whose linears defer their weights' gradients
        # Set by whoever measures activations: told of the tensors kept for W, it returns a handle held beside them.
        self.keeper: Callable[[tuple[Tensor, ...]], Any] | None = None

    @contextlib.contextmanager
    def linears(self) -> Iterator[None]:
        """While F or B of a split schedule runs: ``F.linear`` is `deferred_linear` (recompute happens in B)."""
        F.linear = _deferring(self)
        try:
            yield
        finally:
            F.linear = _ORIGINAL_LINEAR

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """While the F of a (stage, microbatch) whose W runs inside its B runs: ``F.linear`` of the blocks' weights
        takes the step's half copy that the deferred linears take (`mixed_precision.shared_cast`), not autocast's
        own."""
        F.linear = _sharing(self)
        try:
            yield
        finally:
            F.linear = _ORIGINAL_LINEAR

    @contextlib.contextmanager
    def backward_input(self, key: Key) -> Iterator[None]:
        """B of ``key``: the linears it runs through keep their weights' gradients for W."""
        self.key = key
        try:
            with self.linears():
                yield
        finally:
            self.key = None

    def held_bytes(self) -> int:
        """What the stored inputs and output gradients hold (activations kept for W)."""
        seen: dict[int, int] = {}
        for triples in self.pending.values():
            for _, x, dy, _ in triples:
                for t in (x, dy):
                    seen[storage_id(t)] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def weights(self, key: Key) -> None:
        """W of ``key``: compute its deferred weight gradients and let autograd accumulate them."""
        triples = self.pending.pop(key, [])
        if not triples:
            return
        weights = [w for w, _, _, _ in triples]
        grads = [(dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).to(w.dtype) for w, x, dy, _ in triples]
        out = _Accumulate.apply(grads, *weights)
        torch.autograd.backward(out)


def _deferring(store: WeightStore):
    def deferred_linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        param = standing_for(weight)  # (under ZeRO-3's half gather, its copy: the gradient goes to the parameter)
        if not (weight.requires_grad and torch.is_grad_enabled()) or id(param) not in store.deferrable:
            return _ORIGINAL_LINEAR(input, weight, bias)
        # The weight enters detached: autograd would otherwise run its AccumulateGrad (and the hooks on it, with no
        # gradient) in B; W accumulates into it instead.
        return _Linear.apply(input, weight.detach(), bias, store, [param])  # (in a list: not an autograd input)
    return deferred_linear


def _sharing(store: WeightStore):
    def shared_linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        dtype = _autocast_dtype(input)
        if dtype is not None and id(weight) in store.deferrable:
            weight = shared_cast(weight, dtype)  # (autocast then casts the input alone, as it would)
        return _ORIGINAL_LINEAR(input, weight, bias)
    return shared_linear


class _Linear(torch.autograd.Function):
    """``F.linear`` whose backward defers the weight's gradient to the store's current key (when one is set)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, store: WeightStore,
                param: list[Tensor]) -> Tensor:
        ctx.param = param[0]  # the parameter itself (``weight`` is it detached): W accumulates into it
        autocast = x.device.type != "meta"
        dtype = _autocast_dtype(x)
        if dtype is not None:  # what autocast does to F.linear: compute in its dtype (the weight's copy: once a step;
            # ZeRO-3's half gather is one already, its parameter's float32 storage freed)
            x = x.to(dtype)
            weight = weight if weight.dtype == dtype else shared_cast(weight, dtype, ctx.param)
            bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(x.device.type, enabled=False) if autocast else contextlib.nullcontext():
            out = _ORIGINAL_LINEAR(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.has_bias = store, bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, dy: Tensor):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        store = ctx.store
        if store.key is None:
            raise RuntimeError("a linear layer made under a zero-bubble schedule's forward ran its backward outside "
                               "the schedule's B: its weight's gradient would be lost")
        kept = store.keeper((x, dy)) if store.keeper is not None else None
        store.pending.setdefault(store.key, []).append((ctx.param, x, dy, kept))
        return dx, None, db.to(ctx.param.dtype) if db is not None else None, None, None


class _Accumulate(torch.autograd.Function):
    """Hands precomputed gradients to autograd for ``weights``, so that its AccumulateGrad (and every hook on the
    parameters) runs as in a full backward."""

    @staticmethod
    def forward(ctx: Any, grads: list[Tensor], *weights: Tensor) -> Tensor:
        ctx.grads = grads
        return torch.zeros((), device=weights[0].device, requires_grad=False)

    @staticmethod
    def backward(ctx: Any, _: Tensor):
        grads, ctx.grads = ctx.grads, None
        return (None, *grads)
