"""Activation checkpointing: each block keeps only its input for backward and recomputes the rest.

Non-reentrant ``torch.utils.checkpoint`` (the one torch recommends): autograd hooks, module hooks and
gradient-accumulation hooks behave as without it, so it composes with DDP, ZeRO (a ZeRO-3 unit is gathered
again for its backward before the recomputation needs it), tensor parallel (the recomputation repeats the
block's collectives, counted by comm.py like any other) and the pipeline's stage swap. The blocks are the
list pipeline parallel cuts (`pipeline.stages.find_blocks`). What it saves shows in the strategy's
activation bytes: only each block's input is kept. (Not to be confused with `strategies.checkpoint`, the files a
run saves and resumes from.)

Selective (``sac``, torchtitan's op-level policy, through torch's ``create_selective_checkpoint_contexts``): the
block also keeps what its fused attention and every second matmul return (the first, third, ...), the costly ops, and
recomputes the rest (the other matmuls, norms, activation functions, casts, and the collectives between them, as
``ac`` does).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from strategies.mixed_precision import uncached
from strategies.technique import Technique
from strategies.tensor_parallel.overlap import piece_at
from strategies.tensors import meta_autocast_again


@functools.cache
def _kept_ops() -> frozenset:
    """The ops whose outputs ``sac`` may keep: the linears' matmuls (every second one) and every fused attention kernel
    torch has."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    return frozenset([aten.mm.default, aten.addmm.default,
                      *(getattr(aten, n).default for n in names if hasattr(aten, n))])


def _selective():
    """One block's call: it keeps every fused attention's output and the first, third, fifth... matmul's, and makes
    the rest again (torchtitan's op-level policy: Llama's q, v, gate and down projections kept, k, o and up made
    again). Counted apart in the forward and in the recompute, so that both take the same ops."""
    matmuls = {False: 0, True: 0}  # by ctx.is_recompute
    decided: dict[bool, dict[int, CheckpointPolicy]] = {False: {}, True: {}}  # async TP's layers, at their 1st piece
    mm = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op not in _kept_ops():
            return CheckpointPolicy.PREFER_RECOMPUTE
        if op not in mm:
            return CheckpointPolicy.MUST_SAVE
        at = piece_at()  # (a layer cut into pieces by async TP counts once, as its one matmul without it)
        if at is not None and at[0] > 0:
            return decided[ctx.is_recompute][at[1]]
        matmuls[ctx.is_recompute] += 1
        choice = CheckpointPolicy.PREFER_RECOMPUTE if matmuls[ctx.is_recompute] % 2 == 0 else \
            CheckpointPolicy.MUST_SAVE
        if at is not None:
            decided[ctx.is_recompute][at[1]] = choice
        return choice

    return create_selective_checkpoint_contexts(policy)


def _checkpointed(forward, selective: bool, *args, **kwargs):
    # torch restores the autocast of the inputs' device for the recompute; a rehearsal's inputs are meta, which
    # autocast does not know, and its host autocast (`lightning.rehearsal.MetaAutocast`) is restored here instead.
    # The block's casts are not kept for the step (`mixed_precision.uncached`): its forward saves none.
    host = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")

    def again(*a, **k):
        with torch.autocast("cpu", dtype=host[1], enabled=host[0], cache_enabled=False), meta_autocast_again():
            return forward(*a, **k)
    extra = {"context_fn": _selective} if selective else {}
    with uncached():
        return checkpoint(again, *args, use_reentrant=False, **extra, **kwargs)


def apply_activation_checkpointing(blocks: nn.Module, selective: bool = False, every: int = 1) -> list[nn.Module]:
    """Wrap the forward of every ``every``-th element of ``blocks`` (a ModuleList/Sequential), from the first: the
    first, third, ... for 2, all for 1 (the last block's backward comes first, so recomputing it would free nothing
    before it is made again); returns them for `remove`. ``selective``: keep attention's and every second matmul's
    outputs (``sac``)."""
    wrapped = []
    for block in list(blocks)[::every]:
        if "forward" in vars(block):  # compiled one by one (block.forward = torch.compile(...)) or patched
            raise ValueError(
                f"activation checkpointing ('ac', 'sac') wraps each block's forward, but this "
                f"{type(block).__name__} has a forward set on the instance (compiled block by block, or replaced), "
                "which the wrapper would hide; compile the whole model (or pass compile=True) instead, or drop 'ac' "
                "or 'sac'")
        block.forward = functools.partial(_checkpointed, block.forward, selective)
        wrapped.append(block)
    return wrapped


def remove_activation_checkpointing(blocks: list[nn.Module]) -> None:
    for block in blocks:
        vars(block).pop("forward", None)


def caches_off(model: nn.Module) -> list:
    """Turn off the key/value cache of every Hugging Face config in ``model`` (``use_cache``, on by default, even in
    training); returns the configs changed. Under recompute a cache is worse than useless: it holds each block's keys
    and values beyond its forward, and with them the graph the recompute rebuilds for them, which backward never
    reaches: most of every block's activations, kept to the end of the step (rehearsed: Llama 3 70B at zero3_tp8_ac
    peaked 31 GiB higher per rank). Hugging Face's own gradient checkpointing turns it off too."""
    changed = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True and all(config is not c for c in changed):
            config.use_cache = False
            changed.append(config)
    return changed


class ActivationCheckpointing(Technique):
    """Every (``every``-th) block of ``blocks`` recomputed in backward (``selective``: all but every second matmul and
    attention), with ``model``'s key/value caches off (`caches_off`); undone at teardown."""

    def __init__(self, blocks: nn.Module, model: nn.Module | None = None, selective: bool = False,
                 every: int = 1) -> None:
        self.blocks = apply_activation_checkpointing(blocks, selective, every)
        self.caches = caches_off(model) if model is not None else []

    def teardown(self, healthy: bool) -> None:
        remove_activation_checkpointing(self.blocks)
        for config in self.caches:
            config.use_cache = True
