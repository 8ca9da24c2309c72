"""A SIGTERM during a run raises Lightning's flag, stops the launcher's children once and runs the handlers registered
before, without a collective inside the handler (`strategies.lightning.signals`), from the run's start."""

from __future__ import annotations

import os
import signal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from strategies import PlanStrategy
from strategies.lightning.signals import _Notifier, quiet_sigterm


class _Launcher:
    def __init__(self) -> None:
        self.killed = []

    def kill(self, signum) -> None:
        self.killed.append(signum)


def _sigterms(monkeypatch, quiet: bool) -> tuple[list, list, list, bool]:
    """SIGTERM twice to this process during a run of a Trainer on a rank of two: (broadcasts, the user's handler's
    calls, the launcher's kills, Lightning's flag)."""
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    broadcasts, users, launcher = [], [], _Launcher()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *args, **kwargs: broadcasts.append(args))
    monkeypatch.setattr(L.Trainer, "world_size", property(lambda self: 2))
    monkeypatch.setattr(type(trainer.strategy), "launcher", property(lambda self: launcher))
    before = signal.signal(signal.SIGTERM, lambda signum, frame: users.append(signum))
    connector = trainer._signal_connector
    try:
        if quiet:
            quiet_sigterm(trainer)
        connector.register_signal_handlers()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        flag = connector.received_sigterm
    finally:
        connector.teardown()
        restored = signal.signal(signal.SIGTERM, before)
    assert getattr(restored, "signal_handlers", None) is None  # the run's end put the user's handler back
    return broadcasts, users, launcher.killed, flag


def test_a_sigterm_raises_the_flag_once_without_a_broadcast_and_keeps_the_users_handler(monkeypatch):
    broadcasts, users, killed, flag = _sigterms(monkeypatch, quiet=True)
    assert broadcasts == [] and flag and killed == [signal.SIGTERM] and users == [signal.SIGTERM] * 2


def test_lightnings_own_handler_broadcasts_inside_the_handler(monkeypatch):
    """What the replacement removes (if Lightning stops doing it, `signals` can go)."""
    broadcasts, users, killed, flag = _sigterms(monkeypatch, quiet=False)
    assert len(broadcasts) == 2 and flag and users == [signal.SIGTERM] * 2


class _Seen(Callback):
    def on_train_start(self, trainer, pl_module):  # (Lightning's handlers registered)
        self.notifiers = list(signal.getsignal(signal.SIGTERM).signal_handlers)


def test_the_strategy_puts_it_in_place_before_lightning_registers_its_handlers(tmp_path):
    module = BoringModel()
    seen = _Seen()
    trainer = L.Trainer(strategy=PlanStrategy("dp"), accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[seen], default_root_dir=tmp_path)
    trainer.fit(module)
    assert any(isinstance(h, _Notifier) for h in seen.notifiers), seen.notifiers
