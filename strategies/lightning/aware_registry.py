"""Lightning's strategy registry, answering for plan strings too (`registry.install` switches the one object Lightning
has to this class, once Lightning is imported)."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry

from strategies.lightning.names import PlanNames, looks_like_plan


class PlanAwareRegistry(_StrategyRegistry):
    def available_strategies(self) -> list:
        return PlanNames(self.keys())

    def get(self, name: str, default: Any = None) -> Any:
        name = name.lower() if isinstance(name, str) else name  # as the Trainer does before looking up
        if name in self.keys() or not looks_like_plan(name):
            return super().get(name, default)
        from strategies.lightning.strategy import PlanStrategy
        from strategies.plan import ParallelPlan

        return PlanStrategy(ParallelPlan.parse(name))  # raises ValueError naming the bad token
