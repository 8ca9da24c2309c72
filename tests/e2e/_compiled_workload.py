"""The demo GPT as a user who compiles their model writes it: ``self.model = torch.compile(GPT(...))``."""

from __future__ import annotations

from typing import Any

import torch

from demos.workload import GPTWorkload


class CompiledGPT(GPTWorkload):
    def lightning(self, config: Any) -> tuple[Any, Any]:
        module, dataset = super().lightning(config)
        module.model = torch.compile(module.model, backend="aot_eager")  # compiles fast; inductor in test_compile
        return module, dataset


WORKLOAD = CompiledGPT()
