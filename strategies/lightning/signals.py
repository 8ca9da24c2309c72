"""Lightning's SIGTERM handling, without the collective it runs inside the signal handler.

Lightning (2.6, `_SignalConnector._sigterm_notifier_fn`) answers a SIGTERM by broadcasting a flag over the world group
from inside the handler, wherever the main thread happens to be. A launcher sends SIGTERM to the ranks it stops after
one of them died (torchrun's agent, before its SIGKILL 30 s later): a rank caught between two calls then waits in
that broadcast on a group with a dead member, and the restart waits with it. Seen in the suite's restart test: the
failing ranks held 30 s in the handler, where alone they exit in under a second. The handler need only raise the flag:
each rank that got the signal stops at the end of its batch, and Lightning broadcasts rank 0's flag at each training
batch's start (`training_epoch_loop._broadcast_sigterm_tensor`, a point every rank reaches).
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message

log = logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector")


class _Notifier:
    """Lightning's notifier less its broadcast: the flag, then the launcher's children stopped, once."""

    def __init__(self, connector: _SignalConnector) -> None:
        self.connector = connector

    def __call__(self, signum: int, frame: Any) -> None:
        connector = self.connector
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", connector.trainer.local_rank))
        first, connector.received_sigterm = not connector.received_sigterm, True
        launcher = connector.trainer.strategy.launcher
        if first and launcher is not None:
            launcher.kill(signum)


def quiet_sigterm(trainer: Any) -> None:
    """Have Lightning register `_Notifier` where it would register its own notifier, for every run of ``trainer``
    from here on: called before Lightning registers its handlers (`PlanStrategy.setup`), so no part of the run, its
    start-up and callbacks included, has the broadcasting one. (An attribute of the connector shadows its method.)"""
    connector = trainer._signal_connector
    if not isinstance(connector._sigterm_notifier_fn, _Notifier):
        connector._sigterm_notifier_fn = _Notifier(connector)
