"""How PlanStrategy's state moves in and out: every plan's state in the single-process layout.

Each axis undoes its own split, innermost first: ZeRO gathers its shards over dp (ZeRO-3's parameters, every
stage's optimizer state), tensor parallel its slices over tp, pipeline parallel takes each parameter (and
its optimizer state) from the stage that owns it. Loading runs the other way: the pipeline keeps its
stage's entries, tensor parallel its slices, ZeRO its shards. So a state saved under any plan and world
size loads under any other, and in one process. Every rank must call these (they gather).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies.parallel import ParallelStrategy
from typing_extensions import override

from strategies.tp_plan import full_state_dict as tp_full_state_dict
from strategies.tp_plan import split_like, split_states, split_styles, unsplit_states
from strategies.zero import ZeroGradSync
from strategies.zero3 import Zero3GradSync
from strategies.zero_state import full_optimizer_state, load_full_optimizer_state, refresh_shards


class StateRoutingMixin(ParallelStrategy):
    """Lightning's state hooks, through ZeRO, tensor parallel and the pipeline (PlanStrategy's attributes)."""

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        module, sync = self.lightning_module, self.grad_sync
        zero3 = isinstance(sync, Zero3GradSync)
        if zero3:
            sync.gather_all()
        try:
            if self.tp_layers:  # split weights gathered back to the single-device layout
                state = tp_full_state_dict(module, self.tp_layers, self.mesh.tp)
            else:
                state = {k: v.detach() for k, v in module.state_dict().items()}
            if self.pipeline is not None:  # each parameter from the stage that owns it
                state = self.pipeline.full_state_dict(state)
            elif zero3:  # ZeRO-3 frees the gathered storage again below
                state = {k: v.clone() for k, v in state.items()}
            return state
        finally:
            if zero3:
                sync.release_all()

    def _optimizer_names(self, optimizer: Any) -> list[str]:
        """Parameter names in the order of the single-process ``optimizer.state_dict()`` indices."""
        if isinstance(self.grad_sync, ZeroGradSync):
            return [name for group in self.grad_sync.original_groups for name in group]
        name_of = {id(p): n for n, p in self.lightning_module.named_parameters()}
        return [name_of.get(id(p), f"<unnamed {i}>")
                for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])]

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(self.grad_sync, ZeroGradSync):
            state = full_optimizer_state(self.grad_sync, optimizer)  # shards gathered, in local (tp) shapes
        elif self.tp_layers or self.pipeline is not None:
            state = optimizer.state_dict()
            state = {"state": {k: dict(v) for k, v in state["state"].items()}, "param_groups": state["param_groups"]}
        else:
            return super().optimizer_state(optimizer)
        names = self._optimizer_names(optimizer)
        if self.tp_layers:
            shapes = {n: p.shape for n, p in self.lightning_module.named_parameters()}
            styles = split_styles(self.lightning_module, self.tp_layers)
            state["state"] = unsplit_states(state["state"], names, styles, shapes, self.mesh.tp)
        if self.pipeline is not None:
            state["state"] = self.pipeline.merge_states(state["state"])
        return state

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if not (isinstance(self.grad_sync, ZeroGradSync) or self.tp_layers or self.pipeline is not None):
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            names = self._optimizer_names(optimizer)
            if len(saved["param_groups"]) != len(optimizer.param_groups):
                raise ValueError(f"the checkpoint's optimizer has {len(saved['param_groups'])} param groups, this "
                                 f"one {len(optimizer.param_groups)}: it was saved from a different configure_optimizers")
            states = {int(k): v for k, v in saved["state"].items()}
            if any(k >= len(names) for k in states):
                raise ValueError(f"the checkpoint's optimizer holds states for {max(states) + 1} parameters, this "
                                 f"model's optimizer has {len(names)}: it was saved from a different model")
            if self.pipeline is not None:  # this stage's parameters only
                states = {k: v for k, v in states.items() if self.pipeline.owns(names[k])}
            if self.tp_layers:
                states = split_states(states, names, split_styles(self.lightning_module, self.tp_layers), self.mesh.tp)
            local = {"state": states, "param_groups": saved["param_groups"]}
            if isinstance(self.grad_sync, ZeroGradSync):
                load_full_optimizer_state(self.grad_sync, optimizer, local)
            else:
                optimizer.load_state_dict(local)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        # Lightning restores weights before setup (a full module, split afterwards); this path is for loads
        # after setup, where tensor-parallel layers hold slices of the (full) saved weights, ZeRO's parameters
        # live in flats, and other stages' parameters are placeholders.
        state = checkpoint["state_dict"]
        module = self.lightning_module
        if self.tp_layers:
            styles = split_styles(module, self.tp_layers)
            state = {k: split_like(v, styles[k], self.mesh.tp) if k in styles else v for k, v in state.items()}
        if self.pipeline is not None:
            params = dict(module.named_parameters())
            missing = sorted(set(params) - set(state))
            if strict and missing:
                raise KeyError(f"the checkpoint has no values for {', '.join(missing[:8])}")
            state = {k: v for k, v in state.items() if k not in params or self.pipeline.owns(k)}
            strict = False  # placeholders keep their one element
        if isinstance(self.grad_sync, ZeroGradSync):
            refresh_shards(self.grad_sync, module, state)
            params = dict(module.named_parameters())  # buffers (e.g. norm statistics) load as they are
            module.load_state_dict({k: v for k, v in state.items() if k not in params}, strict=False)
            return None
        return module.load_state_dict(state, strict=strict)
