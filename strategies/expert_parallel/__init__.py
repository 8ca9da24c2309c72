"""Expert parallel: the experts of each mixture-of-experts layer split over the ``ep`` ranks (carved out of the data
ranks), tokens sent to their experts' ranks and back by all-to-all (`dispatch`), the layers found by their structure
(`detect`), the split undone for checkpoints (`technique`)."""

from strategies.expert_parallel.detect import find_experts
from strategies.expert_parallel.technique import ExpertParallel

__all__ = ["ExpertParallel", "find_experts"]
