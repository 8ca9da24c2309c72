"""Several optimizers (manual optimization, as Lightning 2 has them) saved by slice (#59: they were saved gathered):
each under ``optimizer_<i>`` of the DCP checkpoint, and a resume reads each into its own. One process under ``dp``:
the resumed fit ends where the uninterrupted one does, bit for bit (AdamW's moments and SGD's momentum both read:
planted, the second optimizer not read: its momentum starts at zero, and the run ends elsewhere). Resumed at an epoch's
end (`max_epochs`): a save after a fit stopped mid-epoch by ``max_steps`` does not resume exactly under manual
optimization, in either format (Lightning's loop state; see docs/checkpoints.md)."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import strategies


class TwoOptimizers(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

    def training_step(self, batch, index):
        body, head = self.optimizers()
        loss = self.head(torch.tanh(self.body(batch[0]))).pow(2).mean()
        body.zero_grad()
        head.zero_grad()
        self.manual_backward(loss)
        body.step()
        head.step()

    def configure_optimizers(self):
        return (torch.optim.AdamW(self.body.parameters(), lr=0.01),
                torch.optim.SGD(self.head.parameters(), lr=0.1, momentum=0.9))


def _fit(epochs: int, source=None) -> tuple[TwoOptimizers, L.Trainer]:
    module = TwoOptimizers()
    trainer = L.Trainer(strategy=strategies.PlanStrategy("dp"), accelerator="cpu", devices=1, max_epochs=epochs,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    data = TensorDataset(torch.randn(12, 4, generator=torch.Generator().manual_seed(1)))
    trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path=source)
    return module, trainer


def test_each_optimizer_is_saved_by_slice_and_read_back_into_its_own(tmp_path):
    whole, _ = _fit(2)
    _, trainer = _fit(1)
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    saved = dcp.FileSystemReader(str(tmp_path / "two.ckpt")).read_metadata().state_dict_metadata
    assert {"optimizer_0.state.body.weight.exp_avg", "optimizer_1.state.head.weight.momentum_buffer"} <= set(saved)
    resumed, _ = _fit(2, tmp_path / "two.ckpt")
    for key, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
