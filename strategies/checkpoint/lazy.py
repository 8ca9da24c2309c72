"""One tensor of a checkpoint, or a selection of its rows or columns, read only where a technique asks
(`pretrained.SafetensorsFiles`, `dcp_dir.DcpFiles`: each gives ``read(key, index)``)."""

from __future__ import annotations

import math
from typing import Any

import torch


class LazyWeight:
    """One tensor of a checkpoint (its ``files``), or a selection of its rows or columns, read only where asked (see
    `pretrained`'s docstring). ``index_select`` gives another LazyWeight: a tensor-parallel slice stays unread until the
    techniques after it (the pipeline keeping its stage, ZeRO its shard) have taken what they keep."""

    device = torch.device("cpu")  # where what it reads lands

    def __init__(self, files: Any, key: str, shape: tuple[int, ...],
                 picked: tuple[list[int] | None, ...] | None = None) -> None:
        self.files, self.key, self.base = files, key, torch.Size(shape)
        self.picked = picked if picked is not None else tuple(None for _ in shape)  # per dim: base indices, or all
        self.shape = torch.Size(len(p) if p is not None else n for p, n in zip(self.picked, self.base))

    def _indices(self, dim: int) -> list[int]:
        picked = self.picked[dim]
        return picked if picked is not None else list(range(self.base[dim]))

    def index_select(self, dim: int, index: torch.Tensor) -> LazyWeight:
        """What ``full.index_select(dim, index)`` would give, still unread."""
        indices = self._indices(dim)
        picked = list(self.picked)
        picked[dim] = [indices[i] for i in index.tolist()]
        return LazyWeight(self.files, self.key, tuple(self.base), tuple(picked))

    def clone(self) -> LazyWeight:
        return self

    def read_all(self) -> torch.Tensor:
        if not self.shape:
            return self.files.read(self.key, ())
        return self._read([self._indices(d) for d in range(len(self.shape))])

    def read_flat(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``lo:hi`` of the flattened tensor: the rows that hold them are read, then cut."""
        if not self.shape:
            return self.read_all().reshape(-1)[lo:hi]
        row = math.prod(self.shape[1:])
        first, last = lo // row, (hi - 1) // row + 1
        box = [self._indices(0)[first:last], *(self._indices(d) for d in range(1, len(self.shape)))]
        return self._read(box).reshape(-1)[lo - first * row : hi - first * row]

    def _read(self, box: list[list[int]]) -> torch.Tensor:
        """The base tensor at the index lists ``box`` (one per dim), read run by run of consecutive indices."""
        runs = [_runs(indices) for indices in box]

        def part(dim: int, chosen: tuple[slice, ...]) -> torch.Tensor:
            if dim == len(runs):
                return self.files.read(self.key, chosen)
            return torch.cat([part(dim + 1, (*chosen, slice(a, b))) for a, b in runs[dim]], dim=dim)

        return part(0, ())


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Consecutive stretches of ``indices`` as (start, stop) pairs, in order."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
