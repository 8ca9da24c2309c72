"""How PlanStrategy saves and loads: every plan's checkpoint is in the single-process layout.

ZeRO gathers its shards, tensor parallel its slices, pipeline parallel each stage's parameters and optimizer
state from the rank that owns them; loading takes this rank's part of the full tensors. So a checkpoint
moves between plans and world sizes, and loads in one process. Every rank must call these (they gather).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies.parallel import ParallelStrategy
from typing_extensions import override

from strategies.tp_plan import full_optimizer_state as tp_full_optimizer_state
from strategies.tp_plan import full_state_dict as tp_full_state_dict
from strategies.tp_plan import load_full_optimizer_state as tp_load_optimizer_state
from strategies.tp_plan import split_like, split_params
from strategies.zero import ZeroGradSync
from strategies.zero3 import Zero3GradSync
from strategies.zero_state import full_optimizer_state, load_full_optimizer_state, refresh_shards


class StateRoutingMixin(ParallelStrategy):
    """Lightning's state hooks, routed to ZeRO, tensor parallel or the pipeline (PlanStrategy's attributes)."""

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        sync = self.grad_sync
        if self.pipeline is not None:  # each parameter from the stage that owns it
            return self.pipeline.full_state_dict()
        if self.tp_layers:  # the single-device layout: split weights gathered back
            return tp_full_state_dict(self.lightning_module, self.tp_layers, self.mesh.tp)
        if not isinstance(sync, Zero3GradSync):
            return super().lightning_module_state_dict()
        sync.gather_all()
        try:
            return {k: v.detach().clone() for k, v in self.lightning_module.state_dict().items()}
        finally:
            sync.release_all()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if self.pipeline is not None:
            return self.pipeline.full_optimizer_state(optimizer)
        if isinstance(self.grad_sync, ZeroGradSync):
            return full_optimizer_state(self.grad_sync, optimizer)
        if self.tp_layers:
            return tp_full_optimizer_state(optimizer, self.lightning_module, self.tp_layers, self.mesh.tp)
        return super().optimizer_state(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if self.pipeline is not None:
            for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
                self.pipeline.load_optimizer_state(optimizer, state)
            return None
        if self.tp_layers:
            for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
                tp_load_optimizer_state(optimizer, self.lightning_module, self.tp_layers, self.mesh.tp, state)
            return None
        if not isinstance(self.grad_sync, ZeroGradSync):
            return super().load_optimizer_state_dict(checkpoint)
        load_full_optimizer_state(self.grad_sync, self.optimizers[0], checkpoint["optimizer_states"][0])

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        # Lightning restores weights before setup (a full module, sharded afterwards); this path is for loads
        # after setup, where ZeRO-3's parameters are freed and offloaded masters are separate copies, and
        # tensor-parallel layers hold slices of the (full) saved weights.
        if self.tp_layers:
            split = {name: style for name, style in split_params(self.lightning_module, self.tp_layers).values()}
            state = {k: split_like(v, split[k], self.mesh.tp) if k in split else v
                     for k, v in checkpoint["state_dict"].items()}
            return self.lightning_module.load_state_dict(state, strict=strict)
        if not isinstance(self.grad_sync, ZeroGradSync):
            return super().load_model_state_dict(checkpoint, strict=strict)
        refresh_shards(self.grad_sync, self.lightning_module, checkpoint["state_dict"])
