"""The token exchange of one expert-parallel MoE layer: dropless, each token's rows sent to the ranks that hold its
chosen experts and back, by two all-to-alls (three with the counts) through `strategies.comm`.

Per call, with E experts split over n ranks (rank j holds experts [j E/n, (j+1) E/n)):

1. this rank's (token, choice) pairs sorted by expert, stably: so the rows for rank j are one run, and within it
   the rows of each of its experts;
2. every rank tells every other how many rows it sends each of its experts (an all-to-all of E counts);
3. the rows go out (all-to-all); each rank runs its own experts, with the model's own expert code, on what it got
   (grouped by sender, then by expert), and sends the results back by the reverse all-to-all;
4. each result is scaled by its routing weight here, where the weights were computed, and added into its token.

No capacity factor: every token reaches every expert it chose, so each rank computes what one process computes for
its tokens. The backward of an all-to-all is the all-to-all with the splits swapped (`_AllToAll`), run on every
rank whether or not its experts got a row (`Dispatch._link`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from strategies import comm
from strategies.comm import Axis
from strategies.expert_parallel import cost


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, axis: Axis, output_splits: list[int], input_splits: list[int]):
        ctx.axis, ctx.splits = axis, (output_splits, input_splits)
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        comm.all_to_all(out, rows.contiguous(), axis, output_splits, input_splits)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        comm.all_to_all(back, grad.contiguous(), ctx.axis, input_splits, output_splits)
        return back, None, None, None


def exchange(rows: torch.Tensor, axis: Axis, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    """``rows`` sent by the splits (differentiable: gradients travel back the same way)."""
    return _AllToAll.apply(rows, axis, output_splits, input_splits)


class Dispatch:
    """Runs the experts of one layer across ``axis``: ``local(rows, expert_index, weights)`` is the model's own expert
    forward over this rank's ``experts`` of ``total``, whose weights are ``params``; called as the experts module was,
    with the router's choice."""

    def __init__(self, local: Callable[..., torch.Tensor], total: int, axis: Axis,
                 params: list[torch.nn.Parameter]) -> None:
        self.local, self.total, self.axis, self.params = local, total, axis, params
        self.per_rank = total // axis.size
        self.tokens = torch.zeros(total, dtype=torch.int64)  # this rank's choices per expert since `take`
        self.routed_bytes = 0  # what the all-to-alls send for the routing seen (`cost.call_bytes`), since `take`

    def _link(self, rows: torch.Tensor) -> torch.Tensor:
        """Zero, depending on ``rows`` and on every local expert weight, whatever the routing. With it, each rank's
        backward runs both all-to-alls' backwards (collectives: a rank that skipped one would leave the others
        waiting, a hang under NCCL) and gives every local expert weight a gradient at the same point of backward on
        every rank: zeros where no row came, as one process's fused weight has for an expert no token chose (and the
        gradient syncs launch in the same order everywhere). Empty slices: nothing is computed."""
        return sum((t.reshape(-1)[:0].sum() for t in (rows, *self.params) if t.requires_grad), rows.new_zeros(()))

    def take(self) -> tuple[torch.Tensor, int]:
        """The tokens per expert and the routed bytes since the last take (the monitor's, once a step)."""
        out = (self.tokens.clone(), self.routed_bytes)
        self.tokens.zero_()
        self.routed_bytes = 0
        return out

    def _count(self, counts: torch.Tensor, received: torch.Tensor, width: int, sizes: tuple[int, int],
               training: bool) -> None:
        """Note the routing of one call. Activation checkpointing runs the forward again inside backward: that call
        sends again, its tokens are not new, and its backward is the first call's. ``training``: a backward follows."""
        n, me = self.axis.size, self.axis.index
        mine = counts.view(n, self.per_rank)
        rows_out = int(counts.sum() - mine[me].sum())
        rows_in = int(received.sum() - received.view(n, self.per_rank)[me].sum())
        recompute = torch._C._current_graph_task_id() != -1
        self.routed_bytes += cost.call_bytes(rows_out, rows_in, self.per_rank, n, width, sizes,
                                             backward=training and not recompute)
        if training and not recompute:  # (evaluation sends, and routes no training token)
            self.tokens += counts.cpu()

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 2 or top_k_index.shape[0] != hidden.shape[0]:
            raise ValueError(f"expert parallel: the experts are called with hidden states of shape "
                             f"{tuple(hidden.shape)} and a choice of shape {tuple(top_k_index.shape)}; it takes "
                             "(tokens, width) and (tokens, top_k), as Hugging Face's MoE blocks call them")
        n, per = self.axis.size, self.per_rank
        choices = top_k_index.reshape(-1)
        order = torch.argsort(choices, stable=True)
        token = order // top_k_index.shape[-1]
        counts = torch.bincount(choices, minlength=self.total)
        received = torch.empty_like(counts)
        comm.all_to_all(received, counts, self.axis, [per] * n, [per] * n)  # (sender, my expert) row counts
        sent_splits = counts.view(n, per).sum(1).tolist()
        got_splits = received.view(n, per).sum(1).tolist()
        rows = exchange(hidden[token], self.axis, got_splits, sent_splits)
        expert = torch.arange(per, device=hidden.device).repeat(n).repeat_interleave(received)
        out = self.local(rows, expert[:, None], rows.new_ones(rows.shape[0], 1)) + self._link(rows)
        if self.axis.stats.counting:  # (not set-up work: the pipeline's traced forward)
            sizes = (hidden.element_size(), out.element_size())
            self._count(counts, received, hidden.shape[-1], sizes, out.requires_grad)
        back = exchange(out, self.axis, sent_splits, got_splits)
        weights = top_k_weights.reshape(-1)[order, None].to(back.dtype)
        return torch.zeros_like(hidden).index_add(0, token, back * weights)
