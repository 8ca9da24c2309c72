"""Context parallel: the sequence of every sample split over the cp ranks (load-balanced chunks, `layout`), attention
run round the ring (`ring`, routed by `attention`), positions translated (`positions`).

Each cp rank runs the user's step on its part of the batch: every tensor of the batch whose dim 1 is the sequence
(the length of its first integer tensor of two or more dims: the token ids) is cut to this rank's two chunks, the
rest passed whole. The step's loss, a mean over this rank's tokens, is then 1/N of the batch's mean when every rank
holds as many counted tokens, and the gradients, averaged over cp as over dp, are the whole batch's.

A Hugging Face causal LM shifts its labels inside its forward (token t predicts t + 1), which on a chunk would pair
each chunk's last token with the wrong next one, and averages over the tokens it counts, which differ by rank (the
sequence's last token has no label). So when such a model is called with ``labels=`` one of the batch's tensors as
split here, it is given ``shift_labels=`` (that tensor shifted over the whole sequence first, then split) and
``num_items_in_batch=`` (the batch's counted tokens / N): each rank's loss is then its sum over the whole batch's
count, times N, and their mean over cp is exactly the batch's mean. Under pipeline parallel the model gets a
microbatch's rows of the split tensor (a view of it): its rows of the shift, and their count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from strategies import comm
from strategies.comm import Axis
from strategies.context_parallel import layout
from strategies.context_parallel.attention import MARK, RingRoute, find_attention
from strategies.context_parallel.positions import PositionMap, check_family
from strategies.pipeline.trace import tensors_of
from strategies.technique import Technique

IGNORE = -100  # Hugging Face's label for "no loss here"


class ContextParallel(Technique):
    """``model``'s attention and positions, made to work on this rank's part of each sequence over ``axis``."""

    def __init__(self, model: nn.Module, axis: Axis) -> None:
        check_family(model)
        attention = find_attention(model)
        if not attention:
            raise ValueError(
                f"context parallel: no attention module found in {type(model).__name__} (a module named for "
                f"attention, holding the projections). Mark yours: set `module.{MARK} = True` on each attention "
                "module whose forward calls F.scaled_dot_product_attention(q, k, v, is_causal=True)")
        self.axis = axis
        self.route = RingRoute(axis, attention)
        self.positions = PositionMap(model)
        self._labelled = [m.register_forward_pre_hook(self._labels, with_kwargs=True) for m in model.modules()
                          if type(m).__name__.endswith(("ForCausalLM", "LMHeadModel"))]
        # id(split tensor) -> its whole-sequence shift: this rank's part (shift_labels=), and whole (the items)
        self._shifted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.route.install()

    def local_batch(self, batch: Any) -> Any:
        return self.shard(batch)

    def step_output(self, output: Any) -> Any:
        """The loss with the value of its mean over cp (the batch's loss, what one process logs) and this rank's
        gradient: the data-parallel average over dp x cp makes the batch's gradient of it."""
        loss = output.get("loss") if isinstance(output, dict) else output
        if not isinstance(loss, torch.Tensor) or self.axis.size == 1:
            return output
        mean = loss.detach().clone()
        comm.all_reduce(mean, self.axis)
        loss = loss + (mean / self.axis.size - loss.detach())
        return {**output, "loss": loss} if isinstance(output, dict) else loss

    def shard(self, batch: Any) -> Any:
        """This rank's part of ``batch``: each sequence tensor cut to its two chunks (see the module's docstring)."""
        n, r = self.axis.size, self.axis.index
        ids = next((t for t in tensors_of(batch) if not t.is_floating_point() and t.dim() >= 2), None)
        if ids is None:
            raise ValueError("context parallel splits the batch's sequences, but the batch holds no integer tensor "
                             "of (batch, sequence, ...) token ids to read the sequence length from")
        length = ids.shape[1]
        layout.check_length(length, n)
        self.positions.set_table(layout.positions(length, r, n, ids.device))
        self._shifted.clear()
        return _map(batch, lambda t: self._split(t, length))

    def _split(self, t: torch.Tensor, length: int) -> torch.Tensor:
        if t.dim() < 2 or t.shape[1] != length:
            return t
        n, r = self.axis.size, self.axis.index
        local = layout.shard(t, 1, r, n)
        if not t.is_floating_point() and t.dim() == 2:  # could be labels: its whole-sequence shift, split alike
            shifted = F.pad(t[:, 1:], (0, 1), value=IGNORE)
            self._shifted[id(local)] = (layout.shard(shifted, 1, r, n), shifted)
        return local

    def _labels(self, module: nn.Module, args: tuple, kwargs: dict):
        labels = kwargs.get("labels")
        if labels is None or kwargs.get("shift_labels") is not None:
            return None
        known = self._shift_of(labels)
        if known is None:
            raise ValueError(
                f"context parallel: {type(module).__name__} was given labels= that are not one of the batch's "
                "tensors as cp split it, so they cannot be shifted over the whole sequence (a Hugging Face model "
                "shifts them inside, chunk by chunk). Pass the batch's tensor itself, or shift_labels=")
        return args, {**kwargs, "shift_labels": known[0], "num_items_in_batch": known[1]}

    def _shift_of(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``labels``' shift_labels and the count of its samples' labelled tokens / N, for one of the split tensors
        or a run of its rows (a pipeline's microbatch: a slice, which views it); None for any other tensor."""
        whole, rows, base = self._shifted.get(id(labels)), slice(None), labels._base
        if whole is None and base is not None and id(base) in self._shifted and base.is_contiguous() \
                and labels.is_contiguous() and labels.shape[1:] == base.shape[1:]:  # whole rows of the split tensor
            whole = self._shifted[id(base)]
            start = labels.storage_offset() // max(base.stride(0), 1)
            rows = slice(start, start + labels.shape[0])
        if whole is None:
            return None
        local, shifted = whole[0][rows], whole[1][rows]
        return local, (shifted != IGNORE).sum() / self.axis.size

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        self.route.remove()  # F.scaled_dot_product_attention is torch's again, for the whole process
        try:
            yield
        finally:
            self.route.install()

    def teardown(self, healthy: bool) -> None:
        self.route.remove()
        self.positions.remove()
        for hook in self._labelled:
            hook.remove()
        self._labelled.clear()


def _map(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)({k: _map(v, fn) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):
        return type(batch)(_map(v, fn) for v in batch)
    return batch
