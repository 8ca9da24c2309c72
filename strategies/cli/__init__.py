"""stratpack: distributed-training strategies for PyTorch Lightning, compared and measured.

Everyday: compare (several strategies on one workload, a table), train (one strategy), plan (a strategy string's
layout, or the plans that fit a model), rehearse (one rank of a large job, alone on this machine), dashboard (the
run store, side by side), convert (a sharded checkpoint to one file or a Hugging Face directory).

Benchmarks and the pack's own measurements: bench (our engines against torch's and DeepSpeed's; --accelerator gpu:
one GPU against Lightning and a plain loop), bench-saves, drift, heap, large, sweep.

`stratpack COMMAND --help` for each.
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

# The everyday commands first, then the benchmarks (the order `stratpack --help` lists them in).
COMMANDS = (compare, train, plan, rehearse, dashboard, convert, bench, bench_saves, drift, heap, large, sweep)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stratpack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # (what `train` starts its other ranks with)
    from strategies.cli.workload import MissingExtra

    try:
        return args.func(args)
    except MissingExtra as missing:  # one line, not a traceback: what to install
        print(f"stratpack {args.command}: {missing}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
