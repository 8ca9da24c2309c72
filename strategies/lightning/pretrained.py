"""`load_pretrained`: a Hugging Face ``save_pretrained`` directory or a DCP checkpoint's weights loaded into a running
plan, each rank reading only the bytes of what it keeps (`checkpoint.pretrained`, `checkpoint.dcp_dir.DcpFiles`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import Callback
from torch import nn

from strategies.checkpoint.pretrained import (
    blocks,
    first_names,
    model_prefix,
    names_of_each,
    open_weights,
    write_index,
)


@dataclass
class Loaded:
    """What `load_pretrained` read: ``tensors`` loaded, ``unexpected`` names of the files the module lacks, and
    ``bytes_read`` so far (a pipeline stage reads at the first batch, once the stages are cut)."""

    files: Any  # SafetensorsFiles, or a DCP checkpoint's DcpFiles
    tensors: int
    unexpected: list[str]

    @property
    def bytes_read(self) -> int:
        return self.files.bytes_read


def load_pretrained(pl_module: Any, path: str | os.PathLike, module: nn.Module | None = None) -> Loaded:
    """Load the weights at ``path`` into ``module`` (by default the one Hugging Face ``PreTrainedModel`` inside
    ``pl_module``, else ``pl_module`` itself): a Hugging Face ``save_pretrained`` directory (``model.safetensors``,
    or shards and their index), or a torch Distributed Checkpoint directory (DCP: torchtitan's ``step-N``, a plain
    ``dcp.save`` of a model's state dict, FSDP2's, Lightning's ``ModelParallelStrategy``'s or the pack's; its
    weights found under ``state_dict``, ``model`` or at the top, and under the LightningModule's name for the model
    where one prefix fits every name).

    Call it once the strategy has set the model up (``on_fit_start``, or after ``trainer.fit`` began): under a pack
    plan each rank reads only its slices: tensor parallel's rows or columns, ZeRO's shard of each flattened
    parameter, its own pipeline stage's weights (a model built on meta is cut at the first batch, and each stage
    takes its weights then; built whole, every rank reads the whole model before the cut). Under any other strategy
    the values are read whole. Every parameter of ``module`` must be in the files (a weight tied to one that is
    counts as there); tensors of the files that the module lacks are returned as ``unexpected``. Returns what was
    read (`Loaded`).
    """
    files = open_weights(path)
    if not hasattr(files, "lazy"):
        raise ValueError(f"{path}: load_pretrained reads a Hugging Face save_pretrained directory or a DCP directory; "
                         "for one torch.save file, pass ckpt_path= to the Trainer or use module.load_state_dict")
    module = module if module is not None else _pretrained_inside(pl_module)
    prefix = _name_in(pl_module, module)
    names = set(module.state_dict())
    inner = model_prefix(names, files.keys())  # (a Lightning checkpoint's names: the module's under its own)
    stored = {key.removeprefix(inner): key for key in files.keys() if key.startswith(inner)}
    missing = sorted(names - set(stored) - _aliases(module, set(stored)))
    if missing:
        raise ValueError(f"{path}: no values for {len(missing)} of {type(module).__name__}'s entries "
                         f"({', '.join(missing[:6])}): a checkpoint of another model, or of another configuration")
    # a weight tied under several names is read once (a DCP checkpoint holds every name; save_pretrained, the first)
    later = {n for group in names_of_each(module) for n in group[1:] if any(m in stored for m in group[:1])}
    state = {prefix + key: files.lazy(stored[key]) for key in sorted((names & set(stored)) - later)}
    strategy = getattr(getattr(pl_module, "_trainer", None), "strategy", None)
    if hasattr(strategy, "techniques"):  # a pack plan: each technique takes (and reads) the part it keeps
        strategy.load_model_state_dict({"state_dict": state}, strict=False)
    else:
        pl_module.load_state_dict({k: v.read_all() for k, v in state.items()}, strict=False)
    return Loaded(files, len(state), sorted(set(stored) - names))


def _pretrained_inside(pl_module: nn.Module) -> nn.Module:
    found = [m for m in pl_module.modules() if _is_hf_model(m)]
    outermost = [m for m in found if not any(m is not o and any(m is x for x in o.modules()) for o in found)]
    return outermost[0] if len(outermost) == 1 else pl_module


def _is_hf_model(module: nn.Module) -> bool:
    return any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)


def _name_in(root: nn.Module, module: nn.Module) -> str:
    for name, sub in root.named_modules():
        if sub is module:
            return f"{name}." if name else ""
    raise ValueError(f"{type(module).__name__} is not a submodule of the LightningModule")


def _aliases(module: nn.Module, stored: set[str]) -> set[str]:
    """Names of parameters tied to one whose value the files hold (a head tied to the embedding: saved once)."""
    return {n for group in names_of_each(module) if any(n in stored for n in group) for n in group}


def save_pretrained(pl_module: Any, path: str | os.PathLike, module: nn.Module | None = None) -> list[str]:
    """Write ``module`` (by default the one Hugging Face model inside ``pl_module``) as a ``save_pretrained``
    directory that ``from_pretrained`` loads: safetensors files, their index, and the model's config.

    Every rank must call it (``on_train_end``, or after fit under Lightning's own strategies). Under a pack plan
    the model goes one block at a time: each block's full tensors are put together from the ranks that hold them
    (tensor parallel's slices, ZeRO-3's shards, the stage that owns it), and one rank, in turn, writes that block's
    file; no rank holds more than one block whole. A weight tied to another is written once, under its first name.
    Returns the files this rank wrote."""
    from safetensors.torch import save_file

    module = module if module is not None else _pretrained_inside(pl_module)
    prefix = _name_in(pl_module, module)
    strategy = getattr(getattr(pl_module, "_trainer", None), "strategy", None)
    rank, world = (strategy.global_rank, strategy.world_size) if strategy is not None else (0, 1)
    names = first_names(module)
    groups = blocks(list(module.state_dict()), names)
    os.makedirs(path, exist_ok=True)
    weight_map, written = {}, []
    for g, keys in enumerate(groups):
        file = f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        full = _full_part(pl_module, strategy, {prefix + k for k in keys})
        weight_map.update({k: file for k in keys})
        if g % world == rank:
            save_file({k: full[prefix + k].detach().cpu().contiguous() for k in keys}, os.path.join(path, file),
                      metadata={"format": "pt"})
            written.append(file)
        del full
    if strategy is not None:
        strategy.barrier("save_pretrained")
    if rank == 0:
        write_index(path, weight_map, module)
    return written


def full_state_blocks(pl_module: Any) -> Iterator[dict[str, Any]]:
    """The LightningModule's single-process state one block at a time (`checkpoint.pretrained.blocks`), each put
    together from the ranks that hold it under a pack plan: no rank holds more than one block whole. Every rank must
    take every block."""
    strategy = getattr(getattr(pl_module, "_trainer", None), "strategy", None)
    names = list(pl_module.state_dict())
    for group in blocks(names, set(names)):
        yield _full_part(pl_module, strategy, set(group))


class ExportPretrained(Callback):
    """`save_pretrained` of the model at the end of fit (``on_train_end``, while the plan still holds it: a model
    built on meta is left in slices after fit), into ``path``: what ``from_pretrained`` loads."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = path

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        save_pretrained(pl_module, self.path)


def _full_part(pl_module: Any, strategy: Any, names: set[str]) -> dict[str, Any]:
    """The full tensors of ``names`` (LightningModule names): a pack plan's `PlanStrategy.full_state` of them."""
    if hasattr(strategy, "full_state"):
        return strategy.full_state(names)
    return {k: v.detach() for k, v in pl_module.state_dict().items() if k in names}
