"""Pretrained weights from a Hugging Face ``save_pretrained`` directory, read by slice.

`SafetensorsFiles` opens ``model.safetensors``, or the shards an index (``model.safetensors.index.json``) lists, and
hands out one `LazyWeight` per tensor: its shape, and no bytes until a technique asks for the part it keeps. The
techniques ask through the same calls they use to split a full state dict (`Technique.local_model_state`): tensor
parallel's ``index_select`` of its rows or columns, ZeRO's `read_flat` of the range of the flattened parameter that
falls in its shard; whatever no technique cut is read whole (`read_all`). Each read goes through safetensors'
``get_slice``, so a rank reads the bytes of its slices and not the file; ``bytes_read`` counts them.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


class SafetensorsFiles:
    """The tensors of a ``save_pretrained`` directory (one file, or shards with their index), read on demand."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._handles: dict[str, Any] = {}
        self.bytes_read = 0
        index, single = os.path.join(self.path, INDEX), os.path.join(self.path, SINGLE)
        if os.path.exists(index):
            with open(index) as f:
                self.file_of = dict(json.load(f)["weight_map"])
        elif os.path.exists(single):
            self.file_of = {key: SINGLE for key in self._handle(SINGLE).keys()}
        else:
            raise FileNotFoundError(
                f"{self.path}: no {SINGLE} and no {INDEX}; pass the directory a Hugging Face model's "
                "save_pretrained(...) wrote (safetensors; .bin checkpoints are not read by slice)")

    def _handle(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(os.path.join(self.path, file), framework="pt")
        return self._handles[file]

    def keys(self) -> list[str]:
        return list(self.file_of)

    def lazy(self, key: str) -> LazyWeight:
        return LazyWeight(self, key, tuple(self._handle(self.file_of[key]).get_slice(key).get_shape()))

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        out = self._handle(self.file_of[key]).get_slice(key)[index]
        self.bytes_read += out.numel() * out.element_size()
        return out


class LazyWeight:
    """One tensor of a `SafetensorsFiles`, read only where asked (see the module's docstring)."""

    device = torch.device("cpu")  # where what it reads lands

    def __init__(self, files: SafetensorsFiles, key: str, shape: tuple[int, ...]) -> None:
        self.files, self.key, self.shape = files, key, torch.Size(shape)

    def read_all(self) -> torch.Tensor:
        return self.files.read(self.key, tuple(slice(None) for _ in self.shape) or (slice(None),))

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """What ``full.index_select(dim, index)`` gives, reading each run of consecutive indices once."""
        rows = index.tolist()
        runs, start = [], 0
        for i in range(1, len(rows) + 1):
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                runs.append((rows[start], rows[i - 1] + 1))
                start = i
        before = tuple(slice(None) for _ in range(dim))
        return torch.cat([self.files.read(self.key, (*before, slice(a, b))) for a, b in runs], dim=dim)

    def read_flat(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``lo:hi`` of the flattened tensor: the rows that hold them are read, then cut."""
        if not self.shape:
            return self.read_all().reshape(-1)[lo:hi]
        row = math.prod(self.shape[1:])
        first, last = lo // row, (hi - 1) // row + 1
        return self.files.read(self.key, (slice(first, last),)).reshape(-1)[lo - first * row : hi - first * row]
