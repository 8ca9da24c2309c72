"""Where a command's report goes: printed first, then written (the benchmarks, the heap and drift tables, the
rehearsal matrix), so that a command runs from any folder and minutes of measuring are not lost to a path."""

from __future__ import annotations

import os
import sys


def write_report(text: str, path: str | None, name: str) -> str | None:
    """A benchmark's markdown to stdout first, then to ``path`` (its folder made; default
    ``<run store>/reports/<name>-<today>.md``, wherever the command runs from); the path, or None where it could not
    be written (said, and the table already printed: minutes of measuring are not lost to a path)."""
    import datetime

    from strategies.runs import runs_dir

    print(text, flush=True)
    path = path or os.path.join(str(runs_dir()), "reports", f"{name}-{datetime.date.today().isoformat()}.md")
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    except OSError as error:
        print(f"the report was printed above; it could not be written to {path}: {error}", file=sys.stderr)
        return None
    print(f"written to {path}", file=sys.stderr)
    return path
