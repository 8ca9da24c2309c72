"""Expert parallel as a technique: each MoE layer's experts cut by expert over the ep axis, its forward routed
through `dispatch.Dispatch`, and the cut undone for checkpoints (the state travels in the single-process layout).

Gradients. A rank's expert weights see the tokens of every rank of its ep group (the all-to-all's backward brings
their gradients home), so after backward they hold the sum of ep ranks' gradients, where a replicated weight holds
its own rank's. Scaled by 1/ep as they arrive (a hook), their average over the ranks that hold the same experts (the
`edp` axis: dp x cp / ep ranks, by the data-parallel sync or ZeRO given that axis for them) is the mean over all
dp x cp ranks, what the dense weights get from their average over dp x cp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from strategies import comm
from strategies.comm import Axis
from strategies.expert_parallel import balance
from strategies.expert_parallel.detect import find_experts
from strategies.expert_parallel.dispatch import Dispatch
from strategies.technique import HeldGrad, OptimizerState, Technique
from strategies.tensor_parallel import state as split_state
from strategies.tensor_parallel.plans import ParamSplit


class ExpertParallel(Technique):
    """The experts of ``model``'s MoE layers split over ``axis`` (ep); ``sharded``: ZeRO holds their gradients (as
    disjoint shards over the data axis, which counts each expert once), else each rank holds its experts' whole.
    ``data``: the data ranks (dp x cp), over which a Hugging Face router's load-balancing loss is computed.
    ``materialise``: the model was built on meta; each layer's experts are made (whole, seeded by their name, as on
    every rank) just before they are cut."""

    def __init__(self, model: nn.Module, axis: Axis, sharded: bool = False, data: Axis | None = None,
                 materialise: Callable[[nn.Module], None] | None = None) -> None:
        if comm.rehearsing():  # the exchange's split sizes are values other ranks send, which a rehearsal lacks
            raise ValueError("expert parallel cannot be rehearsed yet: how many rows each all-to-all carries depends "
                             "on the other ranks' routing; estimate it instead (`stratpack plan`)")
        self.axis, self.sharded, self.module = axis, sharded, model
        self.layers = find_experts(model)
        if not self.layers:
            raise ValueError(
                f"expert parallel: {type(model).__name__} has no mixture-of-experts layer (a module named `experts`, "
                "with fused (num_experts, ...) weights, beside a `gate` or `router`); drop ep<N> for a dense model")
        self.splits: dict[str, ParamSplit] = {}
        self._restore: list[tuple[nn.Module, Any, int]] = []
        self._hooks = []
        for name, experts in self.layers.items():
            if materialise is not None:  # built on meta: made whole (one layer's experts at a time), then cut
                materialise(experts)
            self._split(name, experts)
        # the router's load-balancing loss over every data rank's tokens (`balance`); the first-batch check's copy
        # computes it so too, every rank at its first batch: its loss on this rank's batch is then this rank's share
        self._balance = balance.install(model, data) if data is not None and data.size > 1 else []

    def _split(self, name: str, experts: nn.Module) -> None:
        total, n, i = experts.num_experts, self.axis.size, self.axis.index
        if total % n:
            raise ValueError(f"expert parallel: {name} has {total} experts, which ep{n} does not divide; use an ep "
                             f"that divides {total}")
        per = total // n
        for pname, param in list(experts.named_parameters(recurse=False)):
            local = nn.Parameter(param.detach()[i * per : (i + 1) * per].clone(), requires_grad=param.requires_grad)
            setattr(experts, pname, local)
            self.splits[f"{name}.{pname}"] = ParamSplit(0, (total,))
            if n > 1 and local.requires_grad:
                self._hooks.append(local.register_hook(lambda g, n=n: g / n))
        self._restore.append((experts, experts.__dict__.get("forward"), total))
        local_forward = experts.forward  # the model's own expert code, bound before it is replaced
        experts.num_experts = per
        experts.forward = Dispatch(local_forward, total, self.axis, list(experts.parameters(recurse=False)))

    def take_routing(self) -> dict[str, Any]:
        """Since the last take: each MoE layer's tokens per expert (this rank's choices, by layer name) and what the
        all-to-alls sent for that routing (`cost.call_bytes`): the monitor's, once a record."""
        taken = {name: experts.forward.take() for name, experts in self.layers.items()}
        return {"tokens": {name: counts.tolist() for name, (counts, _) in taken.items()},
                "routed_bytes": sum(sent for _, sent in taken.values())}

    def expert_names(self) -> set[str]:
        """The parameters split by expert, by their names in the model."""
        return set(self.splits)

    # -- state -------------------------------------------------------------------------------------------------

    def place_box(self, name: str, box: Any) -> Any:
        # (each rank's experts are its rows of the fused (num_experts, ...) weights: placed as tp places a slice)
        from strategies.checkpoint.slices import TensorSlices

        return TensorSlices(self.splits, self.axis.index, self.axis.size).place_one(name, box)

    def full_model_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        return split_state.unsplit_state(state, self.splits, self.axis)

    def local_model_state(self, state: dict[str, Tensor], strict: bool) -> dict[str, Tensor]:
        return split_state.split_state(state, self.splits, self.axis)

    def full_optimizer_state(self, optimizer: Any, state: OptimizerState) -> OptimizerState:
        shapes = {n: p.shape for n, p in self.module.named_parameters()}
        return state.with_entries(
            split_state.unsplit_optimizer_state(state.per_param, state.names, self.splits, shapes, self.axis))

    def local_optimizer_state(self, optimizer: Any, state: OptimizerState) -> OptimizerState:
        return state.with_entries(split_state.split_optimizer_state(state.per_param, self.splits, self.axis))

    # -- gradients ---------------------------------------------------------------------------------------------

    def held_grads(self, grads: list[HeldGrad]) -> list[HeldGrad]:
        if self.sharded:
            return grads
        return [g._replace(split=self.axis) if g.name in self.splits else g for g in grads]

    def split_axes(self) -> list[Axis]:
        return [] if self.sharded else [self.axis]

    def teardown(self, healthy: bool) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        balance.restore(self._balance)
        self._balance = []
        if healthy:  # the user gets their whole experts back
            full = self.full_model_state({n: p.detach() for n, p in self.module.named_parameters()
                                          if n in self.splits})
            for name, tensor in full.items():
                owner, _, pname = name.rpartition(".")
                experts = self.module.get_submodule(owner)
                grad = getattr(experts, pname).requires_grad
                setattr(experts, pname, nn.Parameter(tensor.clone(), requires_grad=grad))
        for experts, forward, total in self._restore:
            if forward is None:
                experts.__dict__.pop("forward", None)
            else:
                experts.forward = forward
            experts.num_experts = total
        self._restore.clear()
