"""The sharded checkpoint format: every rank writes its part, any world size reads it back whole; truncated,
incomplete and foreign directories fail with a message; an interrupted save leaves the previous one."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from strategies import comm
from strategies.checkpoint import sharded as ckpt
from strategies.comm import Axis, CommStats
from strategies.testing import run_ranks


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "state_dict": {"big": torch.randn(3, 3001, generator=g), "small": torch.arange(7),
                       "bf16": torch.randn(5000, generator=g).to(torch.bfloat16)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4097, generator=g)}},
                              "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]}],
        "epoch": 2, "loops": {"fit": [1, 2, (3, "x")]}, "hyper_parameters": {"name": "gpt", "n": None},
    }


def _save(rank: int, world_size: int, path: str) -> None:
    world = Axis.of_group("world", dist.group.WORLD, CommStats())
    ckpt.save_sharded(_state(), path, rank=rank, world_size=world_size,
                      broadcast=lambda obj: comm.broadcast_object(obj, world),
                      gather=lambda obj: comm.all_gather_object(obj, world), barrier=lambda: comm.barrier(world),
                      info={"plan": "test"})


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ckpt") / "epoch=0-step=3.ckpt")
    run_ranks(_save, 3, path)
    return path


def test_every_rank_writes_a_part_and_one_process_reads_it_whole(saved):
    manifest = json.load(open(os.path.join(saved, ckpt.MANIFEST)))
    assert manifest["world_size"] == 3 and manifest["plan"] == "test"
    sizes = {name: os.path.getsize(os.path.join(saved, name)) for name in os.listdir(saved) if name.startswith("shard")}
    assert len(sizes) == 3 and all(size > 4 * 3000 for size in sizes.values())  # the big tensors are split 3 ways
    _assert_same(ckpt.load_sharded(saved), _state())
    assert not [n for n in os.listdir(os.path.dirname(saved)) if ".tmp-" in n]  # renamed into place


def _damaged_copy(saved: str, tmp_path, damage) -> str:
    import shutil

    path = str(tmp_path / "copy.ckpt")
    shutil.copytree(saved, path)
    damage(path)
    return path


def _truncate(path: str) -> None:
    shard = os.path.join(path, ckpt.shard_name(1, 3))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)


@pytest.mark.parametrize("damage,message", [
    (_truncate, "is truncated or altered: shard-00001-of-00003.pt has"),
    (lambda p: os.remove(os.path.join(p, ckpt.shard_name(2, 3))), "is incomplete: shard-00002-of-00003.pt is missing"),
    (lambda p: os.remove(os.path.join(p, ckpt.MANIFEST)), "has no manifest.json"),
    (lambda p: open(os.path.join(p, ckpt.MANIFEST), "w").write('{"format": "other"}'), "is not a stratpack-sharded"),
    (lambda p: open(os.path.join(p, ckpt.MANIFEST), "w").write("{not json"), "manifest.json is unreadable"),
])
def test_damaged_checkpoints_fail_with_a_clear_error(saved, tmp_path, damage, message):
    path = _damaged_copy(saved, tmp_path, damage)
    with pytest.raises(ckpt.CheckpointError, match=message.replace("(", r"\(").replace(".", r"\.")):
        ckpt.load_any(path)


def test_interrupted_save_leaves_the_previous_checkpoint(saved, tmp_path, monkeypatch):
    import shutil

    path = str(tmp_path / "last.ckpt")
    shutil.copytree(saved, path)
    calls = {"n": 0}
    real_write = ckpt._write

    def crash_on_second_file(obj, file):
        calls["n"] += 1
        if calls["n"] == 2:  # after the shard, while writing the metadata: the process dies here
            raise KeyboardInterrupt("killed mid-save")
        return real_write(obj, file)

    monkeypatch.setattr(ckpt, "_write", crash_on_second_file)
    new_state = {"state_dict": {"big": torch.zeros(10000)}}
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_sharded(new_state, path, rank=0, world_size=1, broadcast=lambda o: o, gather=lambda o: [o],
                          barrier=lambda: None)
    _assert_same(ckpt.load_any(path), _state())  # the previous checkpoint, whole
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith("last.ckpt.tmp-")]
    assert len(leftovers) == 1
    with pytest.raises(ckpt.CheckpointError, match="has no manifest.json"):
        ckpt.load_any(str(tmp_path / leftovers[0]))
    monkeypatch.setattr(ckpt, "_write", real_write)
    ckpt.save_sharded(new_state, path, rank=0, world_size=1, broadcast=lambda o: o, gather=lambda o: [o],
                      barrier=lambda: None)
    _assert_same(ckpt.load_any(path), new_state)  # a completed save replaces it


def test_missing_checkpoint_names_an_interrupted_save(tmp_path):
    os.makedirs(tmp_path / "run.ckpt.tmp-abc123")
    with pytest.raises(ckpt.CheckpointError, match="an interrupted save left run.ckpt.tmp-abc123"):
        ckpt.load_any(str(tmp_path / "run.ckpt"))


class Custom:
    """Stands for any object a pickle could carry (and run code when unpickled)."""


def test_single_file_checkpoints_load_without_unpickling_objects(tmp_path):
    plain, hostile = tmp_path / "plain.ckpt", tmp_path / "hostile.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, plain)
    torch.save({"state_dict": {"w": torch.ones(2)}, "obj": Custom()}, hostile)
    assert torch.equal(ckpt.load_any(str(plain))["state_dict"]["w"], torch.ones(2))
    with pytest.raises(ckpt.CheckpointError, match="weights_only=True"):
        ckpt.load_any(str(hostile))


def test_convert_writes_what_load_state_dict_accepts(saved, tmp_path):
    out = tmp_path / "model.pt"
    ckpt.convert(saved, out, model_only=True)
    module = torch.nn.Module()
    module.register_buffer("big", torch.empty(3, 3001))
    module.register_buffer("small", torch.empty(7, dtype=torch.long))
    module.register_buffer("bf16", torch.empty(5000, dtype=torch.bfloat16))
    module.load_state_dict(torch.load(out, weights_only=True))
    assert torch.equal(module.big, _state()["state_dict"]["big"])


def _save_failing_on_rank1(rank: int, world_size: int, path: str) -> str:
    if rank == 1:  # this rank's disk is full
        def full(obj, file):
            raise OSError(28, "No space left on device")

        ckpt._write = full
    try:
        _save(rank, world_size, path)
    except ckpt.CheckpointError as err:
        return str(err)
    return "saved"


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(tmp_path):
    messages = run_ranks(_save_failing_on_rank1, 3, str(tmp_path / "x.ckpt"), timeout_s=60.0)
    for message in messages:  # every rank raises at once, none waits for the timeout
        assert "failed writing its part of it (rank 1: OSError: [Errno 28] No space left on device)" in message
    assert not os.path.exists(tmp_path / "x.ckpt")


def test_saving_over_something_that_is_not_a_checkpoint_is_refused(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(ckpt.CheckpointError, match="exists and is not a checkpoint"):
        ckpt.save_sharded({"w": torch.ones(2)}, str(precious), rank=0, world_size=1, broadcast=lambda o: o,
                          gather=lambda o: [o], barrier=lambda: None)
    assert (precious / "notes.txt").read_text() == "keep me"


def _save_model(rank: int, world_size: int, path: str, name: str) -> None:
    from tests.models import zoo

    world = Axis.of_group("world", dist.group.WORLD, CommStats())
    state = {"state_dict": {f"net.{k}": v for k, v in zoo.build(name).model.state_dict().items()}, "epoch": 0}
    ckpt.save_sharded(state, path, rank=rank, world_size=world_size,
                      broadcast=lambda obj: comm.broadcast_object(obj, world),
                      gather=lambda obj: comm.all_gather_object(obj, world), barrier=lambda: comm.barrier(world))


@pytest.mark.parametrize("name", ["llama_tied", "gpt2"])
def test_convert_hf_writes_a_directory_from_pretrained_loads(tmp_path, name: str):
    """`stratpack convert CKPT OUT --hf CONFIG`: a sharded checkpoint of a Hugging Face model (its tensors cut over 2
    ranks' files) as a save_pretrained directory, one tensor read at a time: from_pretrained gives the model's
    logits; a tied head is written once, as save_pretrained writes it. Without the module's prefix: refused."""
    transformers = pytest.importorskip("transformers")
    from strategies.cli import main
    from tests.models import zoo

    path, out, config = str(tmp_path / "ckpt"), str(tmp_path / "hf"), str(tmp_path / "config")
    run_ranks(_save_model, 2, path, name)
    model = zoo.build(name).model.eval()  # the Hugging Face model inside the zoo's wrapper
    model.config.save_pretrained(config)
    # keys under "net.": another prefix finds none (exit 2); none given, the one that fits is found
    assert main(["convert", path, str(tmp_path / "bad"), "--hf", config, "--strip-prefix", "model."]) == 2
    assert main(["convert", path, out, "--hf", config]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = zoo.batches(1, batch=2)[0]
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        written = json.load(f)["weight_map"]
    tied = [n for n in model.state_dict() if n not in written]
    assert len(written) > 1 and tied == (["lm_head.weight"] if name == "llama_tied" else tied)
