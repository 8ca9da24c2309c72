"""Expert parallel's all-to-all, measured against what is predicted (#48), through `stratpack train` on the demo
GPT's MoE at 2 ranks: a balanced router (2 experts, each token to both: every rank sends half its rows away) equals
the estimator's figure exactly; an unbalanced one (4 experts, top 1: the routing drifts to a few experts) equals the
bytes its routing implies (`expert_parallel.cost`, from the tokens per expert the monitor recorded), and not the
balanced figure. `stratpack compare` prints the same three figures (`compare.expert_lines`)."""

from __future__ import annotations

import pytest

from strategies.cli.compare import expert_lines
from tests.helpers import train_demo

pytestmark = pytest.mark.slow


def _bytes(result: dict) -> tuple[float, float, float]:
    measured = result["comm_per_step"]["all_to_all/ep"]["bytes_sent"]
    return measured, result["experts"]["routed_bytes_per_step"], result["predicted"]["comm"]["all_to_all/ep"]


def test_balanced_router_equals_the_estimator(tmp_path):
    result, _ = train_demo(tmp_path, "ep2", 2, "--experts", "2", "--top-k", "2", "--optimizer", "sgd-plain")
    measured, routed, balanced = _bytes(result)
    assert measured == pytest.approx(balanced, rel=1e-12) and measured == pytest.approx(routed, rel=1e-12)
    assert result["experts"]["imbalance_max"] == 1.0


def test_unbalanced_router_equals_its_routing(tmp_path):
    result, _ = train_demo(tmp_path, "zero1_ep2", 2, "--experts", "4", "--top-k", "1", "--optimizer", "sgd-plain")
    measured, routed, balanced = _bytes(result)
    assert measured == pytest.approx(routed, rel=1e-12)
    assert result["experts"]["imbalance_max"] > 1.2 and abs(measured / balanced - 1) > 1e-3
    tokens = result["experts"]["tokens"]
    assert len(tokens) == 2 and all(len(counts) == 4 for counts in tokens.values())  # each layer, each expert
    lines = expert_lines([{**result, "label": "zero1_ep2"}])
    assert "zero1_ep2" in lines and "1.0000" in lines  # measured / routed
