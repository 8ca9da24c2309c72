"""Users' own scripts, not the suite's: a plain Lightning script that ends after ``fit`` (`_user_script.py`) exits 0
under every plan, with a ``training_step`` that reads values, its model built in ``__init__`` and in
``configure_model``. Before: the pipeline's trace on shapes stopped at ``loss.item()`` of a model built on meta, and
a script under pp could abort at exit ("terminate called without an active exception") after training well.
At 8 ranks, `zero3_tp2_pp2` ends so too: the SGD job's fits (built in ``__init__``, `_sgd_job.py`) and the
meta-built ones (`_deferred_job.py`) are scripts of this kind, whose steps read ``loss.item()``."""

from __future__ import annotations

import os
import subprocess
from functools import partial
from pathlib import Path

from tests import lane, python

SCRIPT = Path(__file__).with_name("_user_script.py")
TWO_RANKS = ["dp", "zero3", "tp2", "cp2", "ep2", "pp2_1f1b_mb4", "pp2_gpipe_mb4", "pp2_interleaved_v2_mb4",
             "pp2_zb1p_mb4", "pp2_zbv_mb4", "pp2_dualpipev_mb4"]


def _script(factory, devices: int, plans: tuple[str, ...], **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = factory.mktemp("user") / "fits.txt"
    return lane.run([python.core(), str(SCRIPT), str(out), str(devices), *plans], timeout=900,
                    cwd=Path(__file__).parents[2], env={**os.environ, **env}), out


def _fit_then_test(factory) -> dict:
    done, folder = {}, factory.mktemp("fit_test")
    for plan, devices in FIT_TEST:
        out = folder / f"{plan}@{devices}"
        done[plan, devices] = lane.run([python.core(), str(SCRIPT.with_name("_fit_test_job.py")), str(out),
                                        str(devices), plan, "configure_model"], timeout=600,
                                       cwd=Path(__file__).parents[2]), out
    return done


# (plan, devices): the data-parallel ones train on 2 batches a step, the others (and dp at 1) on one
FIT_TEST = [("dp", 2), ("zero2", 2), ("zero3", 2), ("dp", 1), ("tp2", 2), ("pp2", 2), ("zero2_tp2", 4),
            ("zero3_tp2_pp2", 8)]


def _slices(factory) -> tuple[list[subprocess.CompletedProcess], Path]:
    """`_slices_job.py`: saved by slice under zero3_tp2_pp2@8, then loaded by slice into zero2@2."""
    out, job = factory.mktemp("slices") / "zero3_tp2_pp2", str(SCRIPT.with_name("_slices_job.py"))
    saved = lane.run([python.core(), job, str(out), "8", "zero3_tp2_pp2"], timeout=600, cwd=Path(__file__).parents[2])
    loaded = lane.run([python.core(), job, f"{out}-loaded", "2", "zero2", str(out)], timeout=600,
                      cwd=Path(__file__).parents[2])
    return [saved, loaded], out


def _save_heap(factory) -> tuple[list[subprocess.CompletedProcess], Path]:
    """`_save_heap_job.py`: a fit under zero3@4 saved, resumed under tp2_pp2@4 and saved, resumed under
    zero3_tp2_pp2@8 and saved (MKL's buffer cache off, as `stratpack train --heap`)."""
    from strategies.cli.train import HEAP_ENV

    folder, job, runs = factory.mktemp("save_heap"), str(SCRIPT.with_name("_save_heap_job.py")), []
    for plan, devices, steps, source in SAVE_HEAP:
        runs.append(lane.run([python.core(), job, str(folder / plan), str(devices), plan, str(steps),
                              *([str(folder / f"{source}.ckpt")] if source else [])], timeout=600,
                             cwd=Path(__file__).parents[2], env={**os.environ, **HEAP_ENV}))
    return runs, folder


def _interop(factory) -> tuple[list[subprocess.CompletedProcess], Path]:
    """`_interop_job.py`: Lightning's ModelParallelStrategy (FSDP2) at 2 ranks saves, the pack resumes it under
    zero3_tp2_pp2@8 and saves, ModelParallelStrategy resumes that."""
    folder, job, runs = factory.mktemp("interop"), str(SCRIPT.with_name("_interop_job.py")), []
    for out, devices, strategy, steps, source in INTEROP:
        runs.append(lane.run([python.core(), job, str(folder / out), str(devices), strategy, str(steps),
                              *([str(folder / f"{source}.ckpt")] if source else [])], timeout=600,
                             cwd=Path(__file__).parents[2]))
    return runs, folder


def _unused(factory) -> tuple[list[subprocess.CompletedProcess], Path]:
    """`_unused_job.py`: saved under tp2@2 after 2 steps, resumed for a third."""
    folder, job = factory.mktemp("unused"), str(SCRIPT.with_name("_unused_job.py"))
    first = lane.run([python.core(), job, str(folder / "a.ckpt"), "tp2", "2"], timeout=600,
                     cwd=Path(__file__).parents[2])
    return [first, lane.run([python.core(), job, str(folder / "b.ckpt"), "tp2", "3", str(folder / "a.ckpt")],
                            timeout=600, cwd=Path(__file__).parents[2])], folder


def _buffers(factory) -> tuple[list[subprocess.CompletedProcess], Path]:
    """`_buffers_job.py`: saved by slice under pp2 after 2 steps, resumed under pp2 for a third."""
    folder, job = factory.mktemp("buffers"), str(SCRIPT.with_name("_buffers_job.py"))
    runs = [lane.run([python.core(), job, str(folder / "a"), "pp2_1f1b_mb2", "2"], timeout=600,
                     cwd=Path(__file__).parents[2])]
    return runs + [lane.run([python.core(), job, str(folder / "b"), "pp2_1f1b_mb2", "3",
                             str(folder / "a" / "last.ckpt")], timeout=600, cwd=Path(__file__).parents[2])], folder


INTEROP = [("mps", 2, "mps", 2, None), ("pack", 8, "zero3_tp2_pp2", 3, "mps"), ("mps_again", 2, "mps", 4, "pack"),
           ("pack_titan", 8, "zero3_tp2_pp2", 3, "mps-titan")]

SAVE_HEAP = [("zero3", 4, 3, None), ("tp2_pp2", 4, 6, "zero3"), ("zero3_tp2_pp2", 8, 9, "tp2_pp2")]

WORK = {"test_two_rank_plans_from_a_script_that_ends_after_fit": (_script, 2, tuple(TWO_RANKS)),
        "test_each_rank_saves_its_slice_of_a_fit_and_plain_dcp_reads_it_whole": (_slices,),
        "test_a_save_and_a_resume_hold_a_ranks_slice_and_a_tensor_more_than_its_steps": (_save_heap,),
        "test_lightnings_model_parallel_strategy_and_the_pack_resume_each_others_checkpoints": (_interop,),
        "test_a_parameter_no_step_reached_resumes_without_optimizer_state": (_unused,),
        "test_a_pipelines_buffers_are_saved_by_slice_from_the_stage_that_uses_them": (_buffers,),
        "test_an_error_at_set_up_of_a_model_built_on_meta_is_the_last_thing_the_script_prints": (
            partial(_script, BATCH="6", BUILDS="configure_model"), 2, ("pp2_1f1b_mb4",)),
        "test_fit_then_test_from_the_best_checkpoint_with_a_model_built_in_configure_model": (_fit_then_test,)}


def _ran(request):
    """What the test's scripts did: run ahead on the suite's second lane (tests/lane.py), or here."""
    test = request.node.originalname
    fn, *args = WORK[test]
    return lane.result(f"user:{test}", partial(fn, request.getfixturevalue("tmp_path_factory"), *args))


lane.register("user scripts", lambda item: item.path.name == "test_user_scripts.py", lambda factory, readers: [
    (f"user:{item.originalname}", partial(WORK[item.originalname][0], factory, *WORK[item.originalname][1:]))
    for item in readers])


def test_two_rank_plans_from_a_script_that_ends_after_fit(request):
    proc, out = _ran(request)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "terminate called" not in proc.stderr
    lines = out.read_text().split()
    assert [(p, b) for p, b in zip(lines[::3], lines[1::3])] == [(p, b) for p in TWO_RANKS
                                                                  for b in ("init", "configure_model")]
    assert all(float(x) > 1 for x in lines[2::3])  # the perplexity logged from loss.item()


def test_an_error_at_set_up_of_a_model_built_on_meta_is_the_last_thing_the_script_prints(request):
    # The fit stops at its first batch, which does not split into 4 microbatches, with the model still on meta.
    # Teardown used to add its own traceback under it ("Cannot copy out of meta tensor").
    proc, _ = _ran(request)
    assert proc.returncode != 0
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert "does not split into mb4 equal microbatches" in last, proc.stderr[-3000:]
    assert "meta tensor" not in proc.stderr


def test_fit_then_test_from_the_best_checkpoint_with_a_model_built_in_configure_model(request):
    # Lightning's flow (`_fit_test_job.py`): fit with a ModelCheckpoint, validate on the weights fit left (no ckpt_path:
    # the slices each rank kept, `deferred.KeptSlices`), then test(ckpt_path="best"), predict from it, and a new
    # Trainer's fit from the last checkpoint, tested from its own. Where every rank holds the weights whole
    # (dp, ZeRO-1/2) the module keeps them after fit; where the plan split them (ZeRO-3, tp, pp) fit leaves them in the
    # ranks' slices (a host copy each, taken up by the next set-up under the plan) and the module the user wrote on
    # meta, which a checkpoint fills by slice (it used to be refused, and tp's layers stayed in place, which nothing
    # could fill; then made whole). Plain SGD: the plans that see the same batches give the same figures (measured:
    # zero3 and zero3_tp2_pp2@8 = dp@2 to the last digit of all four, tp2 = dp@1, pp2 within 5e-7 of it). Planted,
    # the slices not kept: validate refuses the module, the job fails.
    figures = {}
    for key, (proc, out) in _ran(request).items():
        assert proc.returncode == 0, proc.stderr[-4000:]
        figures[key] = [float(v) for v in out.read_text().split()]
    for plan, devices, same in (("zero2", 2, ("dp", 2)), ("zero3", 2, ("dp", 2)), ("tp2", 2, ("dp", 1)),
                                ("pp2", 2, ("dp", 1)), ("zero2_tp2", 4, ("dp", 2)), ("zero3_tp2_pp2", 8, ("dp", 2))):
        mine, theirs = figures[plan, devices], figures[same]
        assert len(mine) == len(theirs) and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(mine, theirs)), figures
    assert abs(figures["dp", 1][0] - figures["dp", 2][0]) > 1e-3  # (the two references differ: each pair told apart)
    assert figures["dp", 1][1] < figures["dp", 1][0]  # the resumed fit trained on (two more steps)
    # Tested from the checkpoint, rank 0 keeps the plan's slices (`PlanStrategy._evaluate_in_slices`): ZeRO-3 its shard
    # (its units gathered one at a time for their forward), tp its slices, pp its stage (cut at the first test batch);
    # measured 0.50, 0.67, 0.51, 0.17 at 8 ranks and zero2_tp2@4 0.67 (ZeRO-2's weights whole, tp's slices; its
    # flats not built to evaluate: the slices fit left are taken up as parameters). Before: made whole (1.0).
    shares = {key: out.with_name(out.name + ".held").read_text().split() for key, (_, out) in _ran(request).items()}
    held = {key: float(test) for key, (test, _) in shares.items()}
    assert held["dp", 2] == 1.0 and held["zero3", 2] <= 0.55 and held["tp2", 2] <= 0.75, held
    assert held["pp2", 2] <= 0.55 and held["zero3_tp2_pp2", 8] <= 0.25 and held["zero2_tp2", 4] <= 0.75, held
    # The fit's sanity check, before any training batch: under pp the stages are cut at its batch, the training step
    # traced on its shapes (`PlanStrategy._before_cut`), each making its own (before: the whole model, 1.0)
    sanity = {key: float(value) for key, (_, value) in shares.items()}
    assert sanity["pp2", 2] <= 0.55 and sanity["zero3_tp2_pp2", 8] <= 0.25, sanity


def test_each_rank_saves_its_slice_of_a_fit_and_plain_dcp_reads_it_whole(request):
    """#59: at the end of a Lightning fit under `zero3_tp2_pp2` at 8 ranks (the demo GPT built in configure_model,
    AdamW), each rank writes what it holds as it lies (`PlanStrategy.state_by_slice`: its ZeRO-3 shards of its tp
    slices of its stage's blocks, placed in the whole tensors; `slices.save_state`), and plain
    `torch.distributed.checkpoint.load` in one process reads the weights and AdamW's state whole, equal to the
    strategy's own gather (`full_state`, `optimizer_state`). No rank's file holds half the state. Also run by hand,
    equal: dp@2, zero1@2, zero3@2, tp2@2, pp2@2, tp2_pp2@4, zero2_tp2_sp_vp@4 (30 November).

    Then a fit under `zero2` at 2 ranks, from other weights, loads that checkpoint by slice
    (`PlanStrategy.load_state_by_slice`: each rank reads the chunks that overlap its boxes, ZeRO makes its full
    parameters from the loaded shards) and gathers exactly the saved weights and AdamW's state, and its module
    computes with them (also by hand: tp2@2, zero3@4, dp@1, zero1_pp2@2; planted, no load, or ZeRO's full
    parameters not made again from the loaded shards: fails)."""
    import torch
    import torch.distributed.checkpoint as dcp

    procs, out = _ran(request)
    assert all(proc.returncode == 0 for proc in procs), [proc.stderr[-4000:] for proc in procs]
    gathered = torch.load(f"{out}.pt")
    weights, moments = gathered["weights"], gathered["moments"]
    loaded = {k: torch.full_like(v, float("nan")) for k, v in weights.items()}
    state = {k: {m: torch.full_like(v, float("nan")) if v.dim() else torch.tensor(0.0) for m, v in e.items()}
             for k, e in moments.items()}
    dcp.load({"state_dict": loaded, "optimizer_0": {"state": state}}, checkpoint_id=f"{out}.dcp", no_dist=True)
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)
    assert moments.keys() == weights.keys() and all(
        torch.equal(state[k][m].float(), torch.as_tensor(v).float()) for k, e in moments.items() for m, v in e.items())
    loaded = torch.load(f"{out}-loaded.pt")
    assert all(torch.equal(loaded["weights"][k], v) for k, v in weights.items())
    assert loaded["module"] and all(torch.equal(v, weights[k]) for k, v in loaded["module"].items())  # (ZeRO-2's)
    assert all(torch.equal(torch.as_tensor(loaded["moments"][k][m]).float(), torch.as_tensor(v).float())
               for k, e in moments.items() for m, v in e.items())
    # What each rank's file holds (DCP's record of where every box lies): its boxes' bytes, a few times less than
    # the whole (here 9.2-19.6 KB of 114.6; each box also costs DCP about 2 KB of its own), all of them together the
    # whole once (a replicated box written by one rank), with AdamW's steps.
    whole = sum(3 * v.numel() * v.element_size() for v in weights.values())  # weights and AdamW's two moments
    payload = _payload_per_file(f"{out}.dcp")
    assert len(payload) == 8 and max(payload.values()) < whole / 4, (payload, whole)
    assert whole <= sum(payload.values()) <= whole + 8 * len(weights), (payload, whole)


def test_a_save_and_a_resume_hold_a_ranks_slice_and_a_tensor_more_than_its_steps(request):
    """#59: Lightning's ``trainer.save_checkpoint`` of a fit of a model built in configure_model (AdamW) under zero3@4,
    tp2_pp2@4 and zero3_tp2_pp2@8, and the resumes of the last two from the one before (another plan, another world
    size), each rank's C heap at most 10% above its steady peak (the steps after the first) plus the largest tensor,
    during the save and during the resume's reads. Measured (MiB above the heap before the fit, per rank): zero3
    steady 43, save 17-23; tp2_pp2 steady 20-22, load 15, save 15-16; zero3_tp2_pp2 steady 21, load 9-10, save 10-13
    (30 November). Planted, the gather back (``checkpoint_format="gathered"``: the whole state on every rank): zero3's
    save 62, above its bound of 48, fails."""
    import json

    runs, folder = _ran(request)
    assert all(run.returncode == 0 for run in runs), [run.stderr[-3000:] for run in runs]
    for plan, devices, _, source in SAVE_HEAP:
        for rank in range(devices):
            heap = json.loads((folder / f"{plan}.rank{rank}.json").read_text())
            bound = 1.10 * heap["steady"] + heap["largest"]
            assert heap["save"] <= bound, (plan, rank, heap)
            assert source is None or 0 < heap["load"] <= bound, (plan, rank, heap)


def test_lightnings_model_parallel_strategy_and_the_pack_resume_each_others_checkpoints(request):
    """#59: one format both ways. A fit under Lightning's ``ModelParallelStrategy`` (FSDP2 over 2 ranks, the demo GPT
    built in configure_model, AdamW) saves with torch's DCP; a fit under the pack's ``zero3_tp2_pp2`` at 8 ranks
    resumes from it (each rank reading its ZeRO-3 shards of its tp slices of its stage) and saves by slice; a
    ``ModelParallelStrategy`` fit resumes from that. The same state saved in torchtitan's layout by a plain
    ``dcp.save`` (the model's own names under ``model``, the optimizer's flattened by parameter under ``optimizer``)
    resumes under ``zero3_tp2_pp2`` too. Each resumed fit's weights and AdamW state (gathered before its first step)
    are the saved ones exactly, and the learning rate the saved one."""
    import torch

    runs, folder = _ran(request)
    assert all(run.returncode == 0 for run in runs), [run.stderr[-3000:] for run in runs]
    assert torch.load(folder / "pack_titan-start.pt")["lr"] == 0.02  # (`_interop_job.TITAN_LR`; the module's: 0.01)
    for saved, resumed in (("mps", "pack"), ("pack", "mps_again"), ("mps", "pack_titan")):
        before, after = torch.load(folder / f"{saved}.pt"), torch.load(folder / f"{resumed}-start.pt")
        assert before["weights"].keys() == after["weights"].keys() and len(before["weights"]) == 30
        assert all(torch.equal(v, after["weights"][k]) for k, v in before["weights"].items()), (saved, resumed)
        assert before["moments"].keys() == after["weights"].keys()
        assert all(torch.equal(torch.as_tensor(v).float(), torch.as_tensor(after["moments"][k][m]).float())
                   for k, entry in before["moments"].items() for m, v in entry.items()), (saved, resumed)
    assert not torch.equal(torch.load(folder / "mps.pt")["weights"]["model.tok_emb.weight"],
                           torch.load(folder / "pack.pt")["weights"]["model.tok_emb.weight"])  # (the pack trained on)


def test_a_parameter_no_step_reached_resumes_without_optimizer_state(request):
    """#59: AdamW makes no state for a parameter without a gradient, so a checkpoint by slice holds none for it; the
    resume's step on zero gradients (which makes the state to read into) must not give it one (a strict load then
    refused the checkpoint; under pp only the stage holding it would have). Planted, the made state kept: fails."""
    runs, _ = _ran(request)
    assert all(run.returncode == 0 for run in runs), [run.stderr[-3000:] for run in runs]
    assert [run.stdout.split("OK", 1)[1].split() for run in runs] == [["2", "30"], ["3", "30"]]


def test_a_pipelines_buffers_are_saved_by_slice_from_the_stage_that_uses_them(request):
    """#59: a module with buffers in its state dict is saved by slice under pp too (it was saved gathered). Each block
    counts its forwards in a buffer; only the stage that runs a block counts, so the save writes that stage's copy, and
    a resume reads it into every rank's: 4 after 2 steps of 2 microbatches, 6 after a third. Planted (each stage's
    copies written, `holds_buffer` always true): stage 0's count of blocks 2 and 3, 0, fails."""
    from strategies.checkpoint.dcp_dir import load_whole
    from strategies.checkpoint.directory import is_dcp

    runs, folder = _ran(request)
    assert all(run.returncode == 0 for run in runs), [run.stderr[-3000:] for run in runs]
    for name, seen in (("a", 4), ("b", 6)):
        path = folder / name / "last.ckpt"
        assert is_dcp(path)
        counts = {k: int(v) for k, v in load_whole(path)["state_dict"].items() if k.endswith(".seen")}
        assert counts == {f"model.blocks.{i}.seen": seen for i in range(4)}, (name, counts)


def _payload_per_file(path: str) -> dict[str, int]:
    """Bytes of the tensors' boxes each file of a DCP checkpoint holds, from its metadata."""
    import math

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata, out = dcp.FileSystemReader(path).read_metadata(), {}
    for index, where in metadata.storage_data.items():
        tensor = metadata.state_dict_metadata[index.fqn]
        if isinstance(tensor, TensorStorageMetadata):
            chunk = next(c for c in tensor.chunks if c.offsets == index.offset)
            size = math.prod(chunk.sizes) * tensor.properties.dtype.itemsize
            out[where.relative_path] = out.get(where.relative_path, 0) + size
    return out
