"""Where a DCP checkpoint keeps the weights and the optimizer's state, by whom it was written (#59).

Lightning's layout (the pack's, ``ModelParallelStrategy``'s): the module's state under ``state_dict`` by the
LightningModule's names, the optimizer's under ``optimizer_0`` as torch's ``get_optimizer_state_dict`` gives it
(``state.<name>.<key>``; ``param_groups`` a list, each group's hyperparameters and ``params``, its names), and the
loops' state beside them in ``meta.pt``. torchtitan's (and a plain ``dcp.save`` of FSDP2's state dicts): the model's
under ``model`` (or its names at the top), the optimizer's under ``optimizer`` (or ``optim``), its groups either a list
or, flattened by torch's ``flatten_optimizer_state_dict`` as torchtitan saves them, by parameter
(``param_groups.<name>.<key>``), all by the names of the model inside the LightningModule (without its ``model.``).
A `Layout` moves a rank's state (`PlanStrategy.state_by_slice`: Lightning's layout) to another one's keys, so that one
DCP read fills it from either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODEL = "state_dict"
# a torchtitan step-N's other states, and an optimizer's: never weights
RESERVED = ("optimizer", "optim", "lr_scheduler", "lr_schedulers", "dataloader", "train_state")


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def paths(metadata: Any) -> dict[str, tuple]:
    """Each saved entry's nested path (DCP's planner data: ``("model", "tok_embeddings.weight")`` for a torchtitan
    weight, ``("model.tok_embeddings.weight",)`` for a name saved at the top), by its flattened name."""
    where = metadata.planner_data or {}
    return {fqn: tuple(where.get(fqn, tuple(fqn.split(".", 1)))) for fqn in metadata.state_dict_metadata}


@dataclass(frozen=True)
class Layout:
    """The keys of a DCP checkpoint: the weights under ``model`` ("": at the top), the optimizer's state under
    ``optimizer`` ("": none saved), its param groups by parameter (``by_name``) or as a list, the weights' names those
    of the LightningModule without ``prefix`` (its name for the model inside: ``model.``)."""

    model: str = MODEL
    optimizer: str = optimizer_key(0)
    by_name: bool = False
    prefix: str = ""

    @property
    def lightnings(self) -> bool:
        return self.model == MODEL

    def name(self, ours: str) -> str:
        return ours[len(self.prefix):] if ours.startswith(self.prefix) else ours

    def weights(self, metadata: Any) -> dict[str, str]:
        """The saved weights (a tensor's or a buffer's) by their names in the checkpoint: each one's flattened name."""
        found = paths(metadata).items()
        if self.model:
            return {p[1]: fqn for fqn, p in found if len(p) == 2 and p[0] == self.model}
        return {p[0]: fqn for fqn, p in found if len(p) == 1 and p[0].split(".", 1)[0] not in RESERVED}

    def stated(self, saved: set[str]) -> set[str]:
        """The LightningModule's names of the parameters the checkpoint holds optimizer state for."""
        head = f"{self.optimizer}.state."
        return {self.prefix + k[len(head):k.rindex(".")] for k in saved if self.optimizer and k.startswith(head)}

    def group_count(self, saved: set[str]) -> int | None:
        """How many param groups a list of them holds (None: by parameter, or none saved)."""
        head = f"{self.optimizer}.param_groups."
        count = len({k[len(head):].split(".", 1)[0] for k in saved if k.startswith(head)})
        return None if self.by_name or not count else count

    def groups(self, groups: list[dict[str, Any]], saved: set[str]) -> Any:
        """The optimizer's ``groups`` (by the LightningModule's names) as this layout saves them, with only the
        hyperparameters the checkpoint holds: DCP fills in their values; `read_groups` takes them back."""
        head = f"{self.optimizer}.param_groups"
        if not self.by_name:
            return [{k: [self.name(n) for n in v] if k == "params" else v for k, v in g.items()
                     if f"{head}.{i}.{k}" in saved} for i, g in enumerate(groups)]
        by_first = {}
        for g in (g for g in groups if g["params"]):
            first = self.name(g["params"][0])  # (a group's hyperparameters: its first parameter's)
            by_first[first] = {k: v for k, v in g.items() if k != "params" and f"{head}.{first}.{k}" in saved}
        return by_first

    def read_groups(self, theirs: Any, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What DCP read into `groups`' answer, one dict per param group of ``groups`` (by parameter: the values of
        each group's first parameter; a list: with ``params``, the names the checkpoint's group held)."""
        if not self.by_name:
            return theirs
        return [dict(theirs.get(self.name(g["params"][0]), {})) if g["params"] else {} for g in groups]

    def saved(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (Lightning's layout: ``state_dict``, ``optimizer_0`` with its ``state`` and ``param_groups``
        made by `groups`) under this layout's keys; the leaves are the same objects, so a load fills ``state``."""
        if self.lightnings:
            return state
        out: dict[str, Any] = {}
        if MODEL in state:
            weights = {self.name(k): v for k, v in state[MODEL].items()}
            out.update({self.model: weights} if self.model else weights)
        ours = state.get(optimizer_key(0))
        if ours is not None:
            optim = {k: v for k, v in ours.items() if k != "state"}
            if "state" in ours:
                optim["state"] = {self.name(k): v for k, v in ours["state"].items()}
            out[self.optimizer] = optim
        return out


def layout_of(metadata: Any) -> Layout:
    """The layout of a DCP checkpoint from its metadata (the prefix left to the caller, who knows the module)."""
    found = paths(metadata)
    tops = {p[0] for p in found.values() if len(p) > 1}
    if MODEL in tops:
        return Layout()
    optimizer = next((t for t in ("optimizer", "optim", optimizer_key(0)) if t in tops), "")
    listed = any(p[:2] == (optimizer, "param_groups") and p[-1] == "params" for p in found.values())
    by_name = any(p[0] == optimizer and k.startswith(f"{optimizer}.param_groups.") for k, p in found.items())
    return Layout("model" if "model" in tops else "", optimizer, by_name and not listed)
