"""The strategies inside a real Lightning Trainer: same losses and parameters as one device.

Tolerance: fp32, relative 1e-5 on per-step losses and final parameters, absolute 5e-5 on parameters. The
runs differ only in the order of floating-point sums (losses agree to ~1e-7 relative). The absolute floor
is for attention's key bias, whose exact gradient is zero (softmax ignores a constant added to every
key): its float noise, ~1e-11, differs between runs, and AdamW's normalised update turns that noise into
steps of a few 1e-6 (observed 3.9e-6 after 5 steps under dp, 1.2e-5 under tp2, which reorders more sums).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests import python
from tests.e2e._sgd_job import CLIP, CLIPPED, SHARED, model
from tests.e2e._sgd_job import reference as sgd_reference
from tests.helpers import ATOL, DEEP, PARAM_ATOL, RTOL
from tests.helpers import train_demo as _train


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("single"), "single", 1)


TORCHRUN = (python.core(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")


# Every data mode, tp and pipeline path against one process through the Trainer, with AdamW and with plain SGD, and
# their bytes per step, run in shared processes: tests/e2e/test_sgd_matrix.py (`_sgd_job`). Here: torchrun
# launching the ranks, Lightning only joining them, through `stratpack train`.
def test_ranks_launched_by_torchrun_match_one_process(tmp_path, reference):
    ref_result, ref_params = reference
    result, params = _train(tmp_path, "dp", 2, launcher=TORCHRUN)
    assert result["world_size"] == 2 and result["steps"] == ref_result["steps"] == 5
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_result["losses"]), rtol=RTOL, atol=ATOL)
    assert params.keys() == ref_params.keys()
    for name in params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=RTOL, atol=PARAM_ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    psi_bytes = result["num_params"] * 4
    assert result["comm_per_step"]["all_reduce/dp"]["bytes_sent"] == pytest.approx(psi_bytes)  # 2(N-1)/N at N=2


def test_pipeline_bubble_and_activations_gpipe_vs_1f1b(sgd_jobs):
    # The fits of `_sgd_job` at 2 ranks (AdamW; 1F1B on gloo's program), as the monitor reads them.
    gpipe, one_f_one_b = (sgd_jobs[2]["extras"][case, 1] for case in ("pp2_gpipe_mb4+adamw",
                                                                       "pp2_1f1b_mb4+adamw+gloo"))
    # Rank 0 is stage 0: GPipe holds all 4 microbatches' activations at its peak, 1F1B at most pp = 2.
    ratio = gpipe["activations_peak"] / one_f_one_b["activations_peak"]
    assert 1.8 < ratio <= 2.05, ratio
    for result, order in ((gpipe, "F0.0 F0.1 F0.2 F0.3 B0.0 B0.1 B0.2 B0.3"),
                          (one_f_one_b, "F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3")):
        pipeline = result["pipeline"]
        assert pipeline["bubble_ideal"] == pytest.approx(1 / 5)  # (p-1) / (m+p-1)
        assert 0 < pipeline["bubble_measured"] < 1
        assert " ".join(e["action"] for e in pipeline["timeline"]) == order  # what ran, in the table's order
        assert all(e["end"] >= e["start"] >= 0 for e in pipeline["timeline"])


def test_a_pipeline_without_a_schedule_runs_the_one_predicted_fastest_and_says_why(tmp_path):
    result, _ = _train(tmp_path, "pp2_mb4", 2, *DEEP)
    pipeline, predicted = result["pipeline"], result["predicted"]
    # The run chose on its first batch what `stratpack train` predicted before it, among the schedules the plan allows.
    assert pipeline["schedule"] in ("1f1b", "zb1p", "zbv", "dualpipev", "interleaved", "gpipe")
    assert f"_{pipeline['schedule']}_" in predicted["plan"] + "_"
    assert pipeline["schedule_choice"].startswith(pipeline["schedule"] + ": the fastest predicted")
    assert "others, s/step:" in pipeline["schedule_choice"] and predicted["schedule_choice"]


def test_activation_checkpointing_keeps_less_for_backward(sgd_jobs):
    kept, kept_ac = (sgd_jobs[2]["extras"][case, 1]["activations_peak"] for case in ("dp+adamw", "dp_ac+adamw"))
    assert 0 < kept_ac < kept / 3, (kept_ac, kept)  # only each block's input, not its internals


def test_a_weights_half_copy_is_made_once_per_step_and_changes_no_bit(sgd_jobs):
    # bf16-mixed, plain SGD, rank 0 of pp2_mb4 (1F1B: stage 0, two blocks, two microbatches in flight at its peak) and
    # of pp2_zbv_mb4 (the V's first and last stages; the deferred linears cast for W): the weights' copies made once
    # per step (`mixed_precision`, the default) against Lightning's cast at every call (share_casts=False).
    job, per_block = sgd_jobs[2], 2 * sum(m.weight.numel() for m in model().blocks[0].modules()
                                          if isinstance(m, nn.Linear))
    for shared, each in zip(SHARED[::2], SHARED[1::2], strict=True):
        states = [job["states"][case] for case in (shared, each)]
        peaks = [job["extras"][case]["activations_peak"] for case in (shared, each)]
        assert all(torch.equal(states[0][k], states[1][k]) for k in states[0]), shared  # the same values
        assert peaks[1] - peaks[0] == 2 * per_block, shared  # two blocks' copy: two in flight, one kept


# bf16-mixed against a bf16-mixed single process, with a tolerance from a measured spread that planted errors
# exceed: tests/e2e/test_sgd_matrix.py (plain SGD; under AdamW any bound large enough for bf16 noise is loose).


@pytest.mark.parametrize("case", [case for case, _ in CLIPPED])
def test_gradient_clipping_through_the_trainer_is_global(sgd_jobs, case: str):
    # Lightning clips in its precision plugin, over the optimizer's params: under ZeRO the shards, under pipeline
    # parallel each stage's. The norm must be the whole gradient's, or the ranks clip differently. SGD, since Adam
    # is nearly invariant to rescaled gradients and would hide a wrong norm. The fits of `_sgd_job` at 2 ranks.
    clipped, unclipped = sgd_reference(clip=CLIP), sgd_reference()
    assert max(float((clipped[k] - unclipped[k]).abs().max()) for k in clipped) > 1e-3  # the clip bites
    state = sgd_jobs[2]["states"][case, 1]
    for name, value in clipped.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
