"""Offline character-level text data for the demo GPT.

Everything here works without network access: the default corpus is built
from Python standard-library source files that ship with every interpreter,
so demos and tests run in sandboxes and on air-gapped clusters alike.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Sequence

import torch
from torch.utils.data import Dataset

# Fixed, ordered list of pure-Python stdlib modules used as the default corpus.
# They are plain ``.py`` files in every CPython install (never frozen or
# C-only), mix prose-like docstrings with code, and together give ~250k
# characters -- plenty for a small character-level model.
DEFAULT_CORPUS_MODULES: tuple[str, ...] = (
    "textwrap",
    "string",
    "json.decoder",
    "shlex",
    "difflib",
    "argparse",
)

_DATA_HINT = (
    "pass --data PATH pointing to an existing, non-empty UTF-8 text file, "
    "or omit --data to use the built-in default corpus"
)


def _module_source(name: str) -> str:
    """Return the source text of stdlib module ``name`` without importing it.

    ``find_spec`` locates the file without executing the module, which avoids
    import side effects and keeps corpus loading cheap.
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.has_location or not spec.origin:
        raise RuntimeError(f"stdlib module {name!r} has no source file on disk")
    if not spec.origin.endswith(".py"):
        raise RuntimeError(f"stdlib module {name!r} is not a .py file: {spec.origin}")
    return Path(spec.origin).read_text(encoding="utf-8", errors="replace")


def default_corpus() -> str:
    """Concatenate the sources of ``DEFAULT_CORPUS_MODULES`` in a fixed order.

    The result is deterministic for a given Python installation, but it varies
    a little between Python versions because the stdlib sources change.
    Modules whose source is unavailable (unusual, stripped installs) are
    skipped rather than failing the whole demo.
    """
    parts = []
    for name in DEFAULT_CORPUS_MODULES:
        try:
            source = _module_source(name)
        except (ImportError, OSError, RuntimeError):
            continue
        # A header line separates modules so the model sees file boundaries.
        parts.append(f"# ===== {name} =====\n{source}")
    if not parts:
        raise RuntimeError(
            "could not read any stdlib source for the default corpus; "
            "pass --data PATH pointing to a UTF-8 text file instead"
        )
    return "\n".join(parts)


def load_corpus(path: str | None = None, max_chars: int | None = None) -> str:
    """Load training text.

    Args:
        path: A UTF-8 text file to read (undecodable bytes are replaced, so any
            file works). ``None`` selects the built-in default corpus: the
            source of a fixed list of Python standard-library modules, read
            from disk with no download. That default is deterministic for a
            given interpreter but varies slightly between Python versions.
        max_chars: If given, keep only the first ``max_chars`` characters.

    Raises:
        FileNotFoundError: ``path`` does not exist or is not a regular file.
        ValueError: the file is empty, or ``max_chars`` is not positive.
    """
    if max_chars is not None and max_chars <= 0:
        raise ValueError(f"max_chars must be a positive integer, got {max_chars}")
    if path is None:
        text = default_corpus()
    else:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"data file not found: {str(path)!r}; {_DATA_HINT}")
        text = file.read_text(encoding="utf-8", errors="replace")
        if not text:
            raise ValueError(f"data file is empty: {str(path)!r}; {_DATA_HINT}")
    if max_chars is not None:
        text = text[:max_chars]
    return text


class CharTokenizer:
    """Character-level tokenizer whose vocabulary is the text's sorted charset.

    Sorting makes token ids independent of character order in the text, so
    the same corpus always yields the same vocabulary on every rank.
    """

    def __init__(self, text: str) -> None:
        if not text:
            raise ValueError("CharTokenizer needs non-empty text to build a vocabulary")
        self.chars: list[str] = sorted(set(text))
        self.stoi: dict[str, int] = {ch: i for i, ch in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Map ``text`` to a 1-D LongTensor of token ids."""
        try:
            ids = [self.stoi[ch] for ch in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the vocabulary") from None
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Map token ids (tensor of any shape, flattened, or a list) back to text."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return "".join(self.chars[int(i)] for i in ids)


class CharDataset(Dataset):
    """Non-overlapping next-character prediction windows over encoded text.

    Item ``i`` is ``(x, y)`` with ``x = data[i*L : (i+1)*L]`` and ``y`` the
    same window shifted right by one token, both LongTensors of shape ``[L]``.
    Non-overlapping windows keep an epoch short and make every token a target
    exactly once, which keeps throughput numbers easy to reason about.
    """

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if data.dim() != 1:
            raise ValueError(f"data must be a 1-D tensor of token ids, got shape {tuple(data.shape)}")
        if data.numel() < seq_len + 1:
            raise ValueError(
                f"text too short: {data.numel()} tokens cannot form one window of "
                f"seq_len={seq_len} (need at least {seq_len + 1})"
            )
        self.data = data.long()
        self.seq_len = seq_len

    def __len__(self) -> int:
        # The last token can only be a target, hence ``n - 1``.
        return (self.data.numel() - 1) // self.seq_len

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"index {idx} out of range for dataset of length {len(self)}")
        start = idx * self.seq_len
        chunk = self.data[start : start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


__all__ = ["DEFAULT_CORPUS_MODULES", "CharDataset", "CharTokenizer", "default_corpus", "load_corpus"]
