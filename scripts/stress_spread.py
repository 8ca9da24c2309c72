"""The spread of each sampled figure over the runs of `scripts/stress.sh`: for each test's key (a plan and its stage
or rank), the relative error against what it is compared with (min, median, max over the runs), or the time."""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def _rows(path: str):
    for line in open(path):
        r = json.loads(line)
        test = r["test"]
        if test == "heap":  # a stage's median rank against the estimator (5% allowed)
            yield f"heap {r['plan']} stage {r['stage']}", (r["predicted"] - r["median"]) / r["median"]
        elif test == "rehearse":  # a rehearsed rank against the highest real rank of its stage (5% allowed)
            how = "real" if r["real"] else "meta"
            yield f"rehearse {r['plan']} rank {r['rank']} {how}", (r["rehearsed"] - r["reached"]) / r["reached"]
        elif test == "setup":  # set-up peak over its limit (at most 1)
            yield f"setup {r['plan']} rank {r['rank']}", r["setup_peak"] / r["limit"] - 1
        elif test == "faults":  # seconds to stop (under 60)
            yield f"faults {r['world']} ranks (s)", r["elapsed"]
        elif test == "restart":  # seconds from the checkpoint's step to the restart's start (no bound)
            yield f"restart {r['plan']}@{r['world']} {r['fault']}, time lost (s)", r["time_lost_s"]


def main(path: str) -> None:
    spread = defaultdict(list)
    for key, value in _rows(path):
        spread[key].append(value)
    for key, values in sorted(spread.items()):
        fmt = (lambda v: f"{v:.1f}") if key.endswith("(s)") else (lambda v: f"{100 * v:+.1f}%")
        print(f"{key}: n={len(values)} min {fmt(min(values))} median {fmt(statistics.median(values))} "
              f"max {fmt(max(values))}")


if __name__ == "__main__":
    main(sys.argv[1])
