"""``stratpack``: compare strategies on a workload, train once, bench against the peers, plan, convert, dashboard.

One module per command, each with ``add_parser(subparsers)`` and ``command(args)``; what the commands train is a
workload (`workload`), the demo GPT unless told otherwise.
"""

from __future__ import annotations

import argparse
import sys

from strategies.cli import (
    bench,
    bench_saves,
    compare,
    convert,
    dashboard,
    drift,
    heap,
    large,
    plan,
    rehearse,
    sweep,
    train,
)

COMMANDS = (compare, train, bench, bench_saves, drift, heap, large, sweep, dashboard, convert, plan, rehearse)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stratpack", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
