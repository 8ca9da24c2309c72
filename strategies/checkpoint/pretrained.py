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
import os
from typing import Any

import torch
from torch import nn

from strategies.checkpoint.lazy import LazyWeight

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

    def entries(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Each tensor's shape and dtype, from the files' headers."""
        out = {}
        for key in self.file_of:
            part = self._handle(self.file_of[key]).get_slice(key)
            out[key] = (torch.Size(part.get_shape()), _SAFETENSORS_DTYPES[part.get_dtype()])
        return out

    def tensor(self, key: str) -> torch.Tensor:
        return self.read(key, ())

    def lazy(self, key: str) -> LazyWeight:
        return LazyWeight(self, key, tuple(self._handle(self.file_of[key]).get_slice(key).get_shape()))

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``key``'s values at ``index`` (one slice per dim; ``()``: a scalar's one value)."""
        handle = self._handle(self.file_of[key])
        out = handle.get_tensor(key) if not index else handle.get_slice(key)[index]
        self.bytes_read += out.numel() * out.element_size()
        return out


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


class TorchFile:
    """The tensors of one ``torch.save`` file, memory-mapped (a model's state dict, or a Lightning checkpoint's
    ``state_dict``): the converters' reader (``keys``, ``entries``, ``tensor``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:  # noqa: BLE001 - whatever torch raises for a damaged or hostile file
            raise ValueError(f"{path}: not a file torch.load reads with weights_only=True "
                             f"({type(err).__name__}: {err})") from None
        state = obj.get("state_dict", obj) if isinstance(obj, dict) else None
        if not isinstance(state, dict) or not state:
            raise ValueError(f"{path}: neither a state dict nor a Lightning checkpoint")
        self._tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def keys(self) -> list[str]:
        return list(self._tensors)

    def entries(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return {k: (v.shape, v.dtype) for k, v in self._tensors.items()}

    def tensor(self, key: str) -> torch.Tensor:
        return self._tensors[key]


def open_weights(path: str | os.PathLike) -> Any:
    """The weights at ``path``, read on demand: a DCP directory's (`dcp_dir.DcpFiles`), a ``save_pretrained``
    directory's (`SafetensorsFiles`) or, for a file, `TorchFile`."""
    from strategies.checkpoint.dcp_dir import DcpFiles
    from strategies.checkpoint.directory import is_dcp

    if is_dcp(path):
        return DcpFiles(path)
    return SafetensorsFiles(path) if os.path.isdir(path) else TorchFile(path)


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

    from strategies.checkpoint.dcp_dir import DcpFiles
    from strategies.checkpoint.directory import CheckpointError, is_dcp
    from strategies.checkpoint.sharded import ShardedReader

    reader = DcpFiles(checkpoint) if is_dcp(checkpoint) else ShardedReader(checkpoint)
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
