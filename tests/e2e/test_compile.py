"""torch.compile under the plans: each block's forward compiled, the same losses and parameters as eager.

Tolerance as in test_trainer (relative 1e-5 on losses and parameters): ``aot_eager`` runs the same kernels as
eager through dynamo and AOTAutograd (where the plans' hooks, swaps and collectives would break a graph), inductor
generates its own (the sums reorder: ~1e-7 relative here). Inductor costs ~30 s of compiling per rank on this
machine, so one case uses it.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ATOL, PARAM_ATOL, RTOL, demo_run, demo_runs_ahead

# inductor's C++ compile on CPU takes 20-30 s at any size: under -m matrix (and on a GPU: scripts/gpu_check_all.sh);
# dynamo and AOTAutograd, where the plans' hooks and collectives would break a graph, run in CI under tp2 and pp2
CASES = [pytest.param("dp", "inductor", marks=pytest.mark.matrix), ("tp2", "aot_eager"), ("pp2", "aot_eager")]
USERS = ("zero3_ac", 2, "--steps", "4", "--workload", "tests.e2e._compiled_workload:WORKLOAD")


def _runs(readers) -> dict[str, tuple]:
    """The runs the selected tests read, each run ahead on the suite's second lane (tests/lane.py)."""
    runs = {"compile:single": ("single", 1, "--steps", "4")}
    for item in readers:
        if item.originalname == "test_compiled_blocks_match_eager":
            strategy, backend = item.callspec.params["strategy"], item.callspec.params["backend"]
            runs[f"compile:{strategy}-{backend}"] = (strategy, 2, "--steps", "4", "--compile", backend)
        else:
            runs["compile:users"] = USERS
    return runs


demo_runs_ahead("compile", lambda item: item.path.name == "test_compile.py" and "tmp_path_factory" in getattr(
    item, "fixturenames", ()), _runs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return demo_run(tmp_path_factory, "compile:single", "single", 1, "--steps", "4")


def _same(result: dict, params: dict, reference: tuple[dict, dict], rename=lambda name: name) -> None:
    ref_result, ref_params = reference
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_result["losses"]), rtol=RTOL,
                               atol=ATOL)
    assert {rename(k) for k in ref_params} == params.keys()
    for name, value in ref_params.items():
        torch.testing.assert_close(params[rename(name)], value, rtol=RTOL, atol=PARAM_ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("strategy,backend", CASES)
def test_compiled_blocks_match_eager(tmp_path_factory, reference, strategy: str, backend: str):
    result, params = demo_run(tmp_path_factory, f"compile:{strategy}-{backend}", strategy, 2, "--steps", "4",
                              "--compile", backend)
    _same(result, params, reference)
    # Compiled, once: every block shares one graph (no recompile per step or per block), except tensor parallel,
    # whose collectives break the graph (each piece between them a graph of its own).
    assert result["compiled_graphs"] == 1 if strategy != "tp2" else result["compiled_graphs"] > 1
    if strategy == "tp2":  # the collectives ran eagerly, each counted as without compile
        assert result["comm_per_step"]["all_reduce/tp"]["calls"] == 4 * 2


def test_users_own_compile_moves_to_the_blocks(tmp_path_factory, reference):
    # The case that failed on the H100 (issue 19): the user's torch.compile'd model under ZeRO-3 (here with ac,
    # whose wrapper is what gets compiled). Its settings go to the blocks; its parameter names keep torch.compile's
    # prefix, as without the strategy.
    result, params = demo_run(tmp_path_factory, "compile:users", *USERS)
    _same(result, params, reference, rename=lambda name: name.replace("model.", "model._orig_mod.", 1))
    assert result["compiled_graphs"] == 1
