"""A planted error for `scripts/stress.sh` (STRESS_PLANT=teardown_waits): after a failure the strategy's teardown
undoes the split as after a healthy fit (gathers, the mesh's groups released), talking to ranks that are gone or
stuck elsewhere, so a fault is waited out instead of seen. `tests/safety/test_faults.py` must fail with it (its bound:
the job stops within the collective timeout). Python imports this at every interpreter's start where its folder is on
PYTHONPATH, the ranks' too."""

from strategies.lightning import strategy

_seen = strategy.PlanStrategy.on_exception


def on_exception(self, exception):
    _seen(self, exception)
    self._failed = None


strategy.PlanStrategy.on_exception = on_exception
