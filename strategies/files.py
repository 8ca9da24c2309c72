"""How the pack writes files (the run store's JSON, checkpoint parts): whole or not at all, stamped with its version."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def atomic_write(path: str | os.PathLike, write: Callable[[IO], Any], binary: bool = False) -> int:
    """Write a file whole or not at all: ``write(f)`` into a temp file in the same folder, flushed to disk,
    then ``os.replace`` onto ``path``. Returns the file's size."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb" if binary else "w") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name`` (None when it is not installed), without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def pack_version() -> str | None:
    """The installed stratpack's version (None when run from a tree that is not installed)."""
    return package_version("stratpack")
