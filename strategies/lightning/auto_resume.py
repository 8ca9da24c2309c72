"""``PlanStrategy(resume="auto")``: a fit given no checkpoint resumes from the newest complete one by itself.

Lightning fixes the checkpoint a fit resumes from before the strategy sees the Trainer: ``Trainer.fit`` hands its
``ckpt_path`` to the strategy's launcher, which runs the fit with it, and Lightning fills it in by itself only on
SLURM (``"hpc"``). The launcher is the first object of the strategy's that sees the call, so `AutoResume` wraps it
and, where the caller left ``ckpt_path`` out, puts in the newest complete checkpoint of the ModelCheckpoint's folder
(`checkpoint.newest`). Each process does so as it starts (torchrun starts every worker; Lightning's own launcher
re-runs the script for each rank), before any process group exists; the strategy then checks at set-up that every
rank chose the same (`agree`).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from strategies.checkpoint.newest import newest_checkpoint


class AutoResume:
    """A Lightning launcher that fills a fit's missing ``ckpt_path`` (see the module's docstring); the rest is
    ``launcher``'s. ``chosen``: the checkpoint this process resumes from ("" for none), once a fit has started."""

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher
        self.chosen: str | None = None

    @property
    def is_interactive_compatible(self) -> bool:
        return self.launcher.is_interactive_compatible

    def kill(self, signum: Any) -> None:
        self.launcher.kill(signum)

    def __getattr__(self, name: str) -> Any:  # the wrapped launcher's other attributes (Lightning reads a few)
        if name == "launcher":  # not set yet (an unpickled copy, under spawn): no recursion
            raise AttributeError(name)
        return getattr(self.launcher, name)

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if getattr(function, "__name__", "") == "_fit_impl":
            bound = inspect.signature(function).bind(*args, **kwargs)
            if bound.arguments.get("ckpt_path") is None:
                self.chosen = resume_path(checkpoint_folder(trainer)) or ""
                bound.arguments["ckpt_path"] = self.chosen or None
                args, kwargs = bound.args, bound.kwargs
        return self.launcher.launch(function, *args, trainer=trainer, **kwargs)


def resume_path(folder: str) -> str | None:
    """The newest complete checkpoint in ``folder``, or None (said either way, and each newer one passed over)."""
    path, skipped = newest_checkpoint(folder)
    for line in skipped:
        rank_zero_info(f"resume='auto': passed over {line}")
    rank_zero_info(f"resume='auto': resuming from {path}" if path else
                   f"resume='auto': no complete checkpoint in {folder} yet: starting fresh")
    return path


def checkpoint_folder(trainer: Any) -> str:
    """The folder of ``trainer``'s ModelCheckpoint (refused where there is none, or no folder of its own)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    found = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    if not found or found[0].dirpath is None:
        raise ValueError("resume='auto' resumes from the folder a ModelCheckpoint writes to: give the Trainer one with "
                         "a folder of its own, ModelCheckpoint(dirpath=...), which is the same at every start (its "
                         "default folder is a new logger version each time)")
    return os.fspath(found[0].dirpath)


def agree(chosen: str | None, theirs: str | None, rank: int) -> None:
    """Raise on a rank whose choice (``chosen``) is not rank 0's (``theirs``): the ranks would load different
    states (a checkpoint folder that is not shared, or one written to while they started)."""
    if chosen != theirs:
        raise RuntimeError(f"resume='auto': rank {rank} chose {chosen or 'no checkpoint'!r} and rank 0 "
                           f"{theirs or 'no checkpoint'!r}. Every rank must see the same checkpoint folder (a shared "
                           "file system) with no save in progress; or pass ckpt_path to fit")
