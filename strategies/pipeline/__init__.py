"""Pipeline parallel: schedules as data (`schedules`), the cut into stages (`stages`), the runner that executes a
schedule with p2p messages (`runner`), and all of it as one technique of a plan (`engine.PipelineParallel`)."""

from strategies.pipeline.engine import PipelineParallel

__all__ = ["PipelineParallel"]
