"""Positions under context parallel: a rank's tokens are chunks from both ends of the sequence (`layout`), but the
model numbers them 0, 1, ... as if they were the sequence's beginning. Each place where the model turns those
numbers into positions gets them translated, local index i to global position ``layout.positions(...)[i]``:

- a learned position embedding (``nn.Embedding`` named ``pos_emb``, ``wpe`` or ``position_embeddings``: the demo
  GPT, nanoGPT, Hugging Face GPT-2) is called with ``arange(local length)``: its input is translated;
- a rotary embedding (a module whose class is named ``...RotaryEmbedding``: the Llama family) is called with
  ``position_ids``: those are translated.

A Hugging Face model of another type is refused by `check_family`: its positions may come from elsewhere (OPT's
from the attention mask, GPT-J's inside the attention), and a missed one would train on wrong positions silently.
"""

from __future__ import annotations

import torch
from torch import nn

EMBEDDING_NAMES = ("pos_emb", "wpe", "position_embeddings")
FAMILIES = ("llama", "mistral", "qwen2", "phi3", "gpt2")  # Hugging Face model types whose positions are found here


def check_family(model: nn.Module) -> None:
    """Refuse a Hugging Face model whose type is not one whose positions `PositionMap` translates."""
    for name, module in model.named_modules():
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        if isinstance(model_type, str) and model_type not in FAMILIES:
            raise ValueError(
                f"context parallel: {name or 'the model'} is a Hugging Face {model_type!r} model; cp knows where the "
                f"positions come from in {', '.join(FAMILIES)} (rotary or learned position embeddings) and GPT-style "
                "models with a position nn.Embedding named pos_emb or wpe. Another family could train on wrong "
                "positions without an error, so it is refused: use one of those, or a plan without cp")


class PositionMap:
    """Hooks on ``model``'s position sources that translate local indices to global positions, from the table
    `set_table` gives (this rank's global positions, in local order)."""

    def __init__(self, model: nn.Module) -> None:
        self.sources: list[str] = []
        self._table: torch.Tensor | None = None
        self._hooks = []
        for name, module in model.named_modules():
            short = name.rpartition(".")[2]
            if isinstance(module, nn.Embedding) and short in EMBEDDING_NAMES:
                self._hooks.append(module.register_forward_pre_hook(self._embedding))
                self.sources.append(name)
            elif type(module).__name__.endswith("RotaryEmbedding"):
                self._hooks.append(module.register_forward_pre_hook(self._rotary, with_kwargs=True))
                self.sources.append(name)

    def set_table(self, table: torch.Tensor | None) -> None:
        self._table = table

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _translate(self, index: torch.Tensor) -> torch.Tensor:
        table = self._table
        if table is None:
            return index
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= table.numel()):
            raise ValueError(f"context parallel: a position index {int(index.max())} is outside this rank's "
                             f"{table.numel()} tokens; positions must count the local tokens from 0")
        return table.to(index.device)[index]

    def _embedding(self, module: nn.Module, args: tuple):
        return (self._translate(args[0]), *args[1:])

    def _rotary(self, module: nn.Module, args: tuple, kwargs: dict):
        if "position_ids" in kwargs:
            return args, {**kwargs, "position_ids": self._translate(kwargs["position_ids"])}
        if len(args) > 1:
            return (args[0], self._translate(args[1]), *args[2:]), kwargs
        raise ValueError(f"context parallel: {type(module).__name__} was called without position_ids")
