"""A planted error for `scripts/stress.sh` (STRESS_PLANT=walk_short): the estimator's walk over a step finds 10% too
little (activations and temporaries: as if it forgot one tensor in ten), 6.8-8.8% of the peak on the heap tests'
plans. `tests/e2e/test_heap.py` must fail with it. Python imports this at every interpreter's start where its folder
is on PYTHONPATH, the ranks' too."""

import dataclasses

from strategies.measure import peak

_walk = peak.walk


def _short(*args, **kwargs) -> peak.Peak:
    found = _walk(*args, **kwargs)
    return dataclasses.replace(found, activations=0.9 * found.activations, temporaries=0.9 * found.temporaries)


peak.walk = _short
