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
from torch import nn

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
        """``key``'s values at ``index`` (one slice per dim; ``()``: a scalar's one value)."""
        handle = self._handle(self.file_of[key])
        out = handle.get_tensor(key) if not index else handle.get_slice(key)[index]
        self.bytes_read += out.numel() * out.element_size()
        return out


class LazyWeight:
    """One tensor of a `SafetensorsFiles`, or a selection of its rows or columns, read only where asked (see the
    module's docstring). ``index_select`` gives another LazyWeight: a tensor-parallel slice stays unread until the
    techniques after it (the pipeline keeping its stage, ZeRO its shard) have taken what they keep."""

    device = torch.device("cpu")  # where what it reads lands

    def __init__(self, files: SafetensorsFiles, key: str, shape: tuple[int, ...],
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


def names_of_each(module: nn.Module) -> list[list[str]]:
    """Every name of each parameter (a weight tied under several names has several), the first in the model's order
    first."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return list(names.values())


def first_names(module: nn.Module) -> set[str]:
    """The state's names without a tied weight's later names (HF saves a tied head once, under the embedding)."""
    return set(module.state_dict()) - {n for group in names_of_each(module) for n in group[1:]}


def blocks(keys: list[str], keep: set[str]) -> list[list[str]]:
    """The state's names grouped by block: up to the first number in the name (``model.layers.3.``), else alone
    in groups of what comes between blocks, in the state's order."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        if key not in keep:
            continue
        parts = key.split(".")
        cut = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        groups.setdefault(".".join(parts[: cut + 1]) if cut is not None else "", []).append(key)
    return list(groups.values())


def write_index(path: str | os.PathLike, weight_map: dict[str, str], module: nn.Module) -> None:
    import json

    total = sum(os.path.getsize(os.path.join(path, f)) for f in set(weight_map.values()))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(path)


def sharded_to_pretrained(checkpoint: str | os.PathLike, out: str | os.PathLike, config: str | os.PathLike,
                          strip_prefix: str = "") -> list[str]:
    """Write the model weights of the pack's sharded or DCP ``checkpoint`` as a Hugging Face ``save_pretrained``
    directory at ``out`` (one safetensors file per block, their index, the config), which ``from_pretrained`` loads.
    ``config``: a directory with the model's ``config.json`` (the one it was loaded from); ``strip_prefix``: the
    LightningModule's name for the model (``net.``; found where not given and only one fits). One tensor at a time
    is read whole; a weight tied to another is written once, as ``save_pretrained`` writes it. Returns the files
    written."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from strategies.checkpoint.dcp_dir import DcpReader
    from strategies.checkpoint.directory import CheckpointError, is_dcp
    from strategies.checkpoint.sharded import ShardedReader

    reader = DcpReader(checkpoint) if is_dcp(checkpoint) else ShardedReader(checkpoint)
    with torch.device("meta"):  # the names and ties only: no weights made
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config))
    keep = first_names(model)
    strip_prefix = strip_prefix or model_prefix(keep, reader.index)
    stored = {k.removeprefix(strip_prefix): k for k in reader.index if k.startswith(strip_prefix)}
    missing = sorted(keep - set(stored))
    if missing:
        raise CheckpointError(
            f"{checkpoint}: {len(missing)} of {type(model).__name__}'s weights are not in the checkpoint "
            f"({', '.join(missing[:4])}); it holds {', '.join(sorted(reader.index)[:4])}...: pass --strip-prefix with "
            "the LightningModule's name for the model (e.g. 'net.'), or the config of the model it holds")
    os.makedirs(out, exist_ok=True)
    groups, weight_map = blocks(list(model.state_dict()), keep), {}
    for g, keys in enumerate(groups):
        file = f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: reader.tensor(stored[k]).contiguous() for k in keys}, os.path.join(out, file),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    write_index(out, weight_map, model)
    return sorted(set(weight_map.values()))


def model_prefix(names: set[str], keys) -> str:
    """The one prefix (the LightningModule's name for the model: ``model.``, ``net.``) under which every one of the
    model's ``names`` is among a checkpoint's ``keys``; "" where there is none or more than one (the error then says
    what to pass)."""
    keys = set(keys)
    some = min(names, default="")
    found = {k[:-len(some)] for k in keys if some and k.endswith(some) and (k == some or k[-len(some) - 1] == ".")}
    fits = [p for p in found if all(p + n in keys for n in names)]
    return fits[0] if len(fits) == 1 else ""


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Consecutive stretches of ``indices`` as (start, stop) pairs, in order."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
