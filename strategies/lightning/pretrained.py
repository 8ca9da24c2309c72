"""`load_pretrained`: a Hugging Face ``save_pretrained`` directory loaded into a running plan, each rank reading only
the bytes of what it keeps (`checkpoint.pretrained`)."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from strategies.checkpoint.pretrained import SafetensorsFiles


def load_pretrained(pl_module: Any, path: str | os.PathLike, module: nn.Module | None = None) -> dict[str, Any]:
    """Load the safetensors of ``path`` (``model.safetensors``, or shards and their index) into ``module`` (by
    default the one Hugging Face ``PreTrainedModel`` inside ``pl_module``, else ``pl_module`` itself).

    Call it once the strategy has set the model up (``on_fit_start``, or after ``trainer.fit`` began): under a pack
    plan each rank reads only its slices: tensor parallel's rows or columns, ZeRO's shard of each flattened
    parameter, its own pipeline stage's weights once the stages are cut (before the first batch a pipeline rank holds
    the whole model, and reads it whole). Under any other strategy the values are read whole. Every parameter of
    ``module`` must be in the files (a weight tied to one that is counts as there); tensors of the files that the
    module lacks are returned as ``unexpected``. Returns what was read: ``{"bytes_read", "tensors", "unexpected"}``.
    """
    files = SafetensorsFiles(path)
    module = module if module is not None else _pretrained_inside(pl_module)
    prefix = _name_in(pl_module, module)
    names = set(module.state_dict())
    stored = set(files.keys())
    missing = sorted(names - stored - _aliases(module, stored))
    if missing:
        raise ValueError(f"{path}: no values for {len(missing)} of {type(module).__name__}'s entries "
                         f"({', '.join(missing[:6])}): a checkpoint of another model, or of another configuration")
    state = {prefix + key: files.lazy(key) for key in sorted(names & stored)}
    strategy = getattr(getattr(pl_module, "_trainer", None), "strategy", None)
    if hasattr(strategy, "techniques"):  # a pack plan: each technique takes (and reads) the part it keeps
        strategy.load_model_state_dict({"state_dict": state}, strict=False)
    else:
        pl_module.load_state_dict({k: v.read_all() for k, v in state.items()}, strict=False)
    return {"bytes_read": files.bytes_read, "tensors": len(state), "unexpected": sorted(stored - names)}


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
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n for group in names.values() if any(n in stored for n in group) for n in group}
