"""A DCP checkpoint's weights read box by box (`checkpoint.dcp_dir.DcpFiles`, behind `strategies.load_pretrained`):
torchtitan's layout (``model.*`` beside ``optimizer`` and ``train_state``), a plain ``dcp.save(model.state_dict())``
(names at the top) and Lightning's (``state_dict.*`` under the LightningModule's name for the model). The rows and
flat ranges the techniques ask for are the saved tensor's, and a rank reads only their bytes. Under a plan at 8 ranks:
`e2e/test_pretrained.py` (`_pretrained_job`'s ``dcp-gpt2`` case)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import strategies
from strategies.checkpoint.dcp_dir import DcpFiles


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 5), nn.LayerNorm(5))


class Wrapped(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 5), nn.LayerNorm(5))


LAYOUTS = {
    "torchtitan": lambda sd: {"model": sd, "optimizer": {"state": {"1.weight": {"exp_avg": torch.ones(5, 6)}}},
                              "train_state": {"step": torch.tensor(7)}},
    "plain": lambda sd: {**sd, "optimizer.step": torch.tensor(3)},
    "lightning": lambda sd: {"state_dict": {f"net.{k}": v for k, v in sd.items()},
                             "optimizer_0": {"state": {"net.1.weight": {"exp_avg": torch.ones(5, 6)}}}},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_weights_of_each_layout_are_found_and_read_by_box(tmp_path, layout: str):
    saved = _model().state_dict()
    dcp.save(LAYOUTS[layout](saved), checkpoint_id=tmp_path, no_dist=True)
    files = DcpFiles(tmp_path)
    prefix = "net." if layout == "lightning" else ""
    assert sorted(files.keys()) == sorted(prefix + k for k in saved)
    weight = saved["1.weight"]  # 5 x 6
    rows = files.lazy(prefix + "1.weight").index_select(0, torch.tensor([1, 2, 4]))
    assert torch.equal(rows.read_all(), weight.index_select(0, torch.tensor([1, 2, 4])))
    assert torch.equal(files.lazy(prefix + "1.weight").read_flat(8, 21), weight.reshape(-1)[8:21])
    assert torch.equal(files.lazy(prefix + "2.bias").read_all(), saved["2.bias"])


def test_a_box_reads_the_stored_chunks_it_overlaps_and_no_other(tmp_path):
    # 1.weight saved as five one-row chunks (as five ranks would hold it): elements 8-20 lie in rows 1-3
    from strategies.checkpoint.slices import Boxed, save_state

    saved = _model().state_dict()
    weight = saved["1.weight"]
    rows = Boxed(tuple(weight.shape), [((r, 0), (1, 6), weight[r : r + 1]) for r in range(5)])
    save_state({"model": {**saved, "1.weight": rows}}, str(tmp_path))
    files = DcpFiles(tmp_path)
    assert torch.equal(files.lazy("1.weight").read_flat(8, 21), weight.reshape(-1)[8:21])
    assert files.bytes_read == 3 * 6 * 4  # three stored rows: DCP reads a chunk whole, and these only


def test_load_pretrained_takes_a_torchtitan_checkpoint_and_a_lightning_one(tmp_path):
    saved = _model().state_dict()
    for layout in ("torchtitan", "lightning"):
        dcp.save(LAYOUTS[layout](saved), checkpoint_id=tmp_path / layout, no_dist=True)
        module = Wrapped()
        loaded = strategies.load_pretrained(module, tmp_path / layout, module=module.net)  # no plan: read whole
        assert loaded.tensors == len(saved) and loaded.unexpected == []
        for key, value in saved.items():
            assert torch.equal(module.net.state_dict()[key], value), (layout, key)


def test_a_checkpoint_of_another_model_is_refused_naming_what_is_missing(tmp_path):
    dcp.save({"model": {"0.weight": torch.zeros(11, 6)}}, checkpoint_id=tmp_path, no_dist=True)
    module = Wrapped()
    with pytest.raises(ValueError, match=r"no values for 4 of Sequential's entries \(1.bias, 1.weight"):
        strategies.load_pretrained(module, tmp_path, module=module.net)


def test_convert_writes_any_models_weights_as_torchtitans_dcp_one_tensor_at_a_time(tmp_path):
    from strategies.checkpoint.dcp_dir import save_lazily
    from strategies.cli import main

    saved = _model().state_dict()
    torch.save({"state_dict": {f"net.{k}": v for k, v in saved.items()}, "epoch": 3}, tmp_path / "last.ckpt")
    assert main(["convert", str(tmp_path / "last.ckpt"), str(tmp_path / "dcp"), "--dcp", "--strip-prefix", "net."]) == 0
    files = DcpFiles(tmp_path / "dcp")
    assert files.entries() == {k: (v.shape, v.dtype) for k, v in saved.items()}
    assert all(torch.equal(files.tensor(k), v) for k, v in saved.items())
    # ... and from that DCP (any layout) again, each tensor read when DCP writes it, into a file of its own (DCP's
    # writer holds every tensor of a file until the file is written: one file for all would hold them all)
    asked: list[str] = []
    save_lazily(files.entries(), lambda name: asked.append(name) or files.tensor(name), tmp_path / "again")
    assert sorted(asked) == sorted(saved) and len(list((tmp_path / "again").glob("*.distcp"))) == len(saved)
    assert all(torch.equal(DcpFiles(tmp_path / "again").tensor(k), v) for k, v in saved.items())
    assert main(["convert", str(tmp_path / "last.ckpt"), str(tmp_path / "none"), "--dcp", "--strip-prefix", "x."]) == 2


class Trained(Wrapped):
    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.lr, self.start = lr, None

    def training_step(self, batch, index):
        if self.start is None:  # what the resume read, before the first step changes it
            optimizer = self.trainer.optimizers[0]
            moments = {n: optimizer.state[p]["exp_avg"].clone() for n, p in self.named_parameters()}
            weights = {k: v.clone() for k, v in self.state_dict().items()}
            self.start = (weights, moments, optimizer.param_groups[0]["lr"])
        return self.net(batch[0]).sum()

    def validation_step(self, batch, index):
        self.log("value", self.net(batch[0]).sum())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def _stepped() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.03)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    return model, optimizer


def _trainer() -> L.Trainer:
    return L.Trainer(strategy=strategies.PlanStrategy("dp"), accelerator="cpu", devices=1, max_steps=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


@pytest.mark.parametrize("groups", ["by parameter", "listed"])
def test_a_fit_resumes_from_torchtitans_layout_and_a_weights_only_one_is_refused_with_the_way(tmp_path, groups):
    # torchtitan saves `get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`: groups by parameter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from strategies.checkpoint.directory import CheckpointError

    model, optimizer = _stepped()
    options = StateDictOptions(flatten_optimizer_state_dict=groups == "by parameter")
    dcp.save({"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
              "train_state": {"step": torch.tensor(1)}}, checkpoint_id=tmp_path / "titan", no_dist=True)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.tensor([[4, 5, 6]])), batch_size=1)
    module = Trained()
    _trainer().fit(module, data, ckpt_path=tmp_path / "titan")
    weights, moments, lr = module.start
    assert weights.keys() == {f"net.{k}" for k in model.state_dict()}
    assert all(torch.equal(weights[f"net.{k}"], v) for k, v in model.state_dict().items())
    assert all(torch.equal(moments[f"net.{n}"], optimizer.state[p]["exp_avg"]) for n, p in model.named_parameters())
    assert lr == 0.03  # the checkpoint's, not configure_optimizers' 0.01
    dcp.save({"model": model.state_dict()}, checkpoint_id=tmp_path / "weights", no_dist=True)
    with pytest.raises(CheckpointError, match="no optimizer state.*load_pretrained"):
        _trainer().fit(Trained(), data, ckpt_path=tmp_path / "weights")
    got = _trainer().validate(Trained(), data, ckpt_path=tmp_path / "weights", verbose=False)
    with torch.no_grad():
        assert got[0]["value"] == pytest.approx(float(model(torch.tensor([[4, 5, 6]])).sum()))


_CONVERT = """
import sys, threading, time
import torch, torch.distributed.checkpoint as dcp
from strategies.checkpoint import sharded
folder = sys.argv[1]
dcp.save({"state_dict": {f"model.w{i}": torch.full((1024, 1024), float(i)) for i in range(16)}},
         checkpoint_id=f"{folder}/big.ckpt", no_dist=True)  # 16 x 4 MiB
torch.save({"epoch": 0}, f"{folder}/big.ckpt/meta.pt")
def anon():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon")) / 1024
base, peak = anon(), [0.0]
def sample():
    while True:
        peak[0] = max(peak[0], anon())
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
sharded.convert(f"{folder}/big.ckpt", f"{folder}/model.pt", model_only=True)
time.sleep(0.02)
print("ANON", peak[0] - base)
"""


def test_convert_to_one_file_passes_the_checkpoint_through_mapped_files_not_memory(tmp_path):
    # DCP -> one torch.save file: each tensor's storage a file beside the output, mapped (`dcp_dir._spilled`), so the
    # process's own memory holds a few tensors, not the checkpoint (64 MiB here: 9-13 MiB above the start, 1 December;
    # planted, read into memory as before: 78). The folder is gone after.
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", _CONVERT, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    grew = float(proc.stdout.split("ANON", 1)[1])
    assert grew < 32, grew
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(loaded[f"model.w{i}"], torch.full((1024, 1024), float(i))) for i in range(16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.ckpt", "model.pt"]
