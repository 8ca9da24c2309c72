"""Activation checkpointing: each block keeps only its input for backward and recomputes the rest.

Non-reentrant ``torch.utils.checkpoint`` (the one torch recommends): autograd hooks, module hooks and
gradient-accumulation hooks behave as without it, so it composes with DDP, ZeRO (a ZeRO-3 unit is gathered
again for its backward before the recomputation needs it), tensor parallel (the recomputation repeats the
block's collectives, counted by comm.py like any other) and the pipeline's stage swap. The blocks are the
list pipeline parallel cuts (`pipeline.stages.find_blocks`). What it saves shows in the strategy's
activation bytes: only each block's input is kept. (Not to be confused with `strategies.checkpoint`, the files a
run saves and resumes from.)
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from strategies.technique import Technique
from strategies.tensors import meta_autocast_again


def _checkpointed(forward, *args, **kwargs):
    # torch restores the autocast of the inputs' device for the recompute; a rehearsal's inputs are meta, which
    # autocast does not know, and its host autocast (`lightning.rehearsal.MetaAutocast`) is restored here instead
    host = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")

    def again(*a, **k):
        with torch.autocast("cpu", dtype=host[1], enabled=host[0]), meta_autocast_again():
            return forward(*a, **k)
    return checkpoint(again, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(blocks: nn.Module) -> list[nn.Module]:
    """Wrap the forward of every element of ``blocks`` (a ModuleList/Sequential); returns them for `remove`."""
    wrapped = []
    for block in blocks:
        if "forward" in vars(block):  # compiled one by one (block.forward = torch.compile(...)) or patched
            raise ValueError(
                f"activation checkpointing ('ac') wraps each block's forward, but this {type(block).__name__} has "
                "a forward set on the instance (compiled block by block, or replaced), which the wrapper would "
                "hide; compile the whole model (or pass compile=True) instead, or drop 'ac'")
        block.forward = functools.partial(_checkpointed, block.forward)
        wrapped.append(block)
    return wrapped


def remove_activation_checkpointing(blocks: list[nn.Module]) -> None:
    for block in blocks:
        vars(block).pop("forward", None)


class ActivationCheckpointing(Technique):
    """Every block of ``blocks`` recomputed in backward; undone at teardown."""

    def __init__(self, blocks: nn.Module) -> None:
        self.blocks = apply_activation_checkpointing(blocks)

    def teardown(self, healthy: bool) -> None:
        remove_activation_checkpointing(self.blocks)
