"""Pipeline parallel: schedules as data (`schedules`, `zero_bubble`), the cut into stages (`stages`), the runner that
executes a schedule with p2p messages (`runner`), the weight gradients split off a backward (`weights`), and all of it
as one technique of a plan (`engine.PipelineParallel`). The schedules import no torch: the CLI lists them cheaply."""

from typing import Any

__all__ = ["PipelineParallel"]


def __getattr__(name: str) -> Any:
    if name == "PipelineParallel":
        from strategies.pipeline.engine import PipelineParallel

        return PipelineParallel
    raise AttributeError(f"module 'strategies.pipeline' has no attribute {name!r}")
