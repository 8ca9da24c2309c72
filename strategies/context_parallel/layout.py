"""Which tokens of the sequence each context-parallel rank holds: load-balanced chunks.

Causal attention's work is uneven along the sequence: the query at position t attends to t + 1 keys, so the rank
that holds the sequence's last quarter would do seven times the work of the rank holding its first. The sequence is
therefore cut into 2N equal chunks and rank r of N holds chunk r and its mirror, chunk 2N-1-r (the layout of
Megatron's and torchtitan's context parallel): every rank then holds the same amount of causal work. A rank's local
sequence is its two chunks one after the other, so its local position i is global position ``positions(...)[i]``.
"""

from __future__ import annotations

import torch


def chunks_of(rank: int, size: int) -> tuple[int, int]:
    """The two chunks (of 2 * ``size``) that ``rank`` holds, in local order."""
    return rank, 2 * size - 1 - rank


def check_length(length: int, size: int) -> None:
    """Refuse a sequence that does not cut into 2 * ``size`` equal chunks, saying what would."""
    if size > 1 and length % (2 * size):
        raise ValueError(
            f"context parallel cp{size} cuts the sequence into {2 * size} equal chunks (two per rank, one from each "
            f"end, so causal attention's work is even), but the sequence has {length} tokens: use a length that "
            f"divides by {2 * size} (pad the batch, or change cp)")


def positions(length: int, rank: int, size: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions of ``rank``'s tokens, in local order (int64, ``length // size`` of them)."""
    check_length(length, size)
    chunk = length // (2 * size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunks_of(rank, size)])


def shard(x: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """``rank``'s part of ``x`` along ``dim`` (the sequence): its two chunks, concatenated (a copy)."""
    if size == 1:
        return x
    check_length(x.shape[dim], size)
    parts = x.chunk(2 * size, dim=dim)
    return torch.cat([parts[c] for c in chunks_of(rank, size)], dim=dim)


def unshard(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's part (``parts[r]`` from rank r), in global order: `shard`'s inverse."""
    size = len(parts)
    pieces: list[torch.Tensor | None] = [None] * (2 * size)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        a, b = chunks_of(rank, size)
        pieces[a], pieces[b] = first, second
    return torch.cat(pieces, dim=dim)
