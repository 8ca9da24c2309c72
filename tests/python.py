"""The Python each process a test starts runs under.

Lightning's torchmetrics imports transformers wherever it is installed (for BERTScore), and transformers reads its
whole model tree at import: 1.9-2.7 s of CPU in every process that imports Lightning, a third of the suite's CPU
(about 290 processes; 29 November 2026). `scripts/setup.sh --dev` makes `.venv-core` beside `.venv`: the same
packages, linked, but transformers, as a user who did not ask for the `models` extra has the pack. What needs no
Hugging Face model runs there (`core()`), which also proves the pack needs transformers for nothing else; what
does runs under pytest's own interpreter (`full()`). A process given the core where it needs transformers fails
saying so (`strategies.cli.workload.needs`), never passes by chance.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_CORE = ROOT / ".venv-core" / "bin" / "python"


def core() -> str:
    """`.venv-core`'s Python where pytest runs from this checkout's `.venv` and it exists; else pytest's own."""
    ours = Path(sys.prefix).resolve() == (ROOT / ".venv").resolve()
    return str(_CORE) if ours and _CORE.exists() else sys.executable


def full() -> str:
    """pytest's own Python: everything installed (Hugging Face's models among it)."""
    return sys.executable


def for_args(args) -> str:
    """The Python for a process given ``args``: `full()` where they may name a Hugging Face model, else `core()`."""
    return full() if needs_hf(args) else core()


def needs_hf(args) -> bool:
    """Whether a `stratpack` command line (or a job's arguments) may name a Hugging Face model: a workload (`llama3-*`,
    `qwen2-*`, `gpt2-xl`, `hf-*`, `demos.sizes:LLAMA3_8B`), a config (`--hf-config`) or a checkpoint to convert
    (`--hf`). Wide on purpose: a line given the whole install for nothing is only slower."""
    return any(name in str(a).lower() for a in args for name in ("hf", "llama", "qwen", "gpt2-xl"))
