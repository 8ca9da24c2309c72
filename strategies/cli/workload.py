"""What `stratpack train`, `compare` and `bench` train: a workload, found by name, so the pack never imports it.

A workload is an object with the methods of `Workload`. The pack's demos register the demo GPT as ``gpt`` (the
default) through the ``stratpack.workloads`` entry points of the installed distribution; a user's own is
``--workload my_package.my_module:my_workload``, or registered the same way in their own package.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any, Protocol

GROUP = "stratpack.workloads"
DEFAULT = "gpt"


class Workload(Protocol):
    """A model and its data, at the sizes the command line gives (``n_layer``, ``n_head``, ``n_embd``, ``seq_len``
    on the config), built the same way in every process for a given seed."""

    def lightning(self, config: Any) -> tuple[Any, Any]:
        """``(LightningModule, Dataset)`` for a `train.RunConfig`: what `stratpack train` fits."""

    def model_config(self, config: Any) -> dict[str, Any]:
        """The model's config as the estimator and the run store take it (``vocab_size``, ``n_layer``, ...)."""

    def bench_model(self, config: Any) -> Any:
        """The plain ``nn.Module`` a `bench.BenchConfig` trains in a hand-written loop."""

    def bench_batches(self, config: Any, rank: int) -> list[tuple[Any, Any]]:
        """``config.steps`` ``(inputs, targets)`` batches of ``config.batch_per_rank`` samples for ``rank`` (the
        same on every rank that shares one batch)."""

    def loss(self, output: Any, targets: Any) -> Any:
        """The loss of the model's ``output`` against ``targets`` (a scalar tensor)."""

    def pipeline_stage(self, model: Any, blocks: range, first: bool, last: bool) -> Any:
        """One stage of ``model`` as a module of its own for ``torch.distributed.pipelining`` (bench's peer): the
        blocks ``blocks``, with what comes before them on the first stage and after them on the last."""


class MissingExtra(ImportError):
    """What a workload needs and the installed pack lacks: `stratpack` says so in one line and exits 2."""


def needs(module: str, extra: str, what: str) -> Any:
    """``module`` imported, or `MissingExtra` naming the pack's extra that installs it (``what``: who needs it)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{what} needs {module}, which is not installed: pip install 'stratpack[{extra}]' (or "
                           f"bash scripts/setup.sh, which installs it)") from None


def find_workload(name: str = DEFAULT) -> Workload:
    """The workload called ``name`` (an entry point of the ``stratpack.workloads`` group), or ``module:object``."""
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"workload {name!r}: {err}") from None
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    if name not in found:
        known = ", ".join(sorted(found)) or "none (is the pack installed? pip install -e .)"
        raise ValueError(f"no workload named {name!r}; registered: {known}. Or pass module:object")
    return found[name].load()
