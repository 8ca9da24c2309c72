"""A save interrupted at any point leaves the previous checkpoint loadable; a checkpoint from another format or
pack version fails naming both; loading never unpickles objects unless asked.

(The damaged-file, disk-full and another-model cases are in tests/multirank/test_sharded_checkpoint.py and
tests/e2e/test_reshard.py.)"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time

import pytest
import torch

from strategies.checkpoint import sharded as ckpt
from tests import python

LOOP = os.path.join(os.path.dirname(__file__), "_save_loop.py")


def _save(state, path) -> None:
    ckpt.save_sharded(state, path, rank=0, world_size=1, broadcast=lambda o: o, gather=lambda o: [o],
                      barrier=lambda: None, info={"plan": "test"})


def _state(k: int) -> dict:
    return {"state_dict": {"a": torch.full((1000,), float(k)), "b": torch.full((3, 7), float(k))}, "k": k}


def _k_of(loaded: dict) -> int:
    """Which checkpoint this is, after checking that every part of it is the same one."""
    k = loaded["k"]
    for t in loaded["state_dict"].values():
        assert torch.all(t == k), "a checkpoint mixing two saves"
    return k


def _load_or_recover(path: str) -> int:
    """The checkpoint at ``path``; after a crash between a save's two renames, the one the error points to."""
    try:
        return _k_of(ckpt.load_any(path))
    except ckpt.CheckpointError as err:
        found = re.search(r"the previous checkpoint is whole at (\S+?)[,;]", str(err))
        assert found, str(err)  # the only failure allowed: the rename window, named
        return _k_of(ckpt.load_any(os.path.join(os.path.dirname(path), found.group(1))))


class Crash(BaseException):
    """The process dying at this point (a BaseException: nothing in the save catches it)."""


def test_a_crash_at_every_write_and_rename_of_a_save_leaves_a_whole_checkpoint(tmp_path, monkeypatch):
    # Count the save's steps that touch the disk (each file's write and each rename), then crash at each in turn.
    calls = []
    real_replace, real_write = os.replace, ckpt._write

    def step(kind, fn):
        def wrapped(*args, **kwargs):
            calls.append(kind)
            if len(calls) == crash_at:
                raise Crash(f"died at {kind} #{crash_at}")
            return fn(*args, **kwargs)
        return wrapped

    def watched(on: bool) -> None:
        monkeypatch.setattr(os, "replace", step("replace", real_replace) if on else real_replace)
        monkeypatch.setattr(ckpt, "_write", step("write", real_write) if on else real_write)

    crash_at = 0
    path = str(tmp_path / "dry.ckpt")
    _save(_state(1), path)
    watched(True)
    _save(_state(2), path)
    watched(False)
    points = len(calls)
    assert points >= 5 and calls.count("replace") >= 4, calls  # shard, meta, manifest written; 2 renames
    for crash_at in range(1, points + 1):
        calls.clear()
        path = str(tmp_path / f"c{crash_at}" / "last.ckpt")
        os.makedirs(os.path.dirname(path))
        _save(_state(1), path)
        watched(True)
        with pytest.raises(Crash):
            _save(_state(2), path)
        watched(False)
        # The previous checkpoint, whole (or, after the last rename, the new one: the save had finished).
        assert _load_or_recover(path) in (1, 2)
        if crash_at < points:
            assert _load_or_recover(path) == 1, crash_at


@pytest.mark.parametrize("seed", [0, 1])
def test_a_process_killed_while_saving_leaves_a_whole_checkpoint(tmp_path, seed):
    # SIGKILL, at random moments, a process that saves over one path again and again (each save ~16 MB).
    rng = random.Random(seed)
    path = str(tmp_path / "last.ckpt")
    seen = set()
    for _ in range(4):
        proc = subprocess.Popen([python.core(), LOOP, path], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().startswith("saved")  # at least one whole checkpoint exists
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        seen.add(_load_or_recover(path))  # the next round saves over whatever this kill left behind
    assert seen and all(k >= 1 for k in seen)


def test_a_checkpoint_of_another_format_version_names_both(tmp_path):
    path = str(tmp_path / "x.ckpt")
    _save(_state(1), path)
    manifest_path = os.path.join(path, ckpt.MANIFEST)
    manifest = json.load(open(manifest_path))
    manifest.update(version=ckpt.VERSION + 1, pack_version="9.9.9")
    json.dump(manifest, open(manifest_path, "w"))
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_any(path)
    message = str(err.value)
    assert f"format version {ckpt.VERSION + 1}" in message and f"reads version {ckpt.VERSION}" in message
    assert "stratpack 9.9.9" in message  # who wrote it, so the user knows which version to install


def test_a_full_pickle_is_refused_with_what_to_do_and_loads_when_trusted(tmp_path):
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "hparams": Namespace(lr=0.1)}, path)
    with pytest.raises(ckpt.CheckpointError,
                       match=r"pass weights_only=False \(trainer.fit\(..., weights_only=False\)\)"):
        ckpt.load_any(str(path))
    assert ckpt.load_any(str(path), weights_only=False)["hparams"].lr == 0.1


class Namespace:
    def __init__(self, **kwargs) -> None:
        self.__dict__.update(kwargs)
