"""A planted error for `scripts/stress.sh` (STRESS_PLANT=no_workspace): the rehearsal leaves out MKL's workspace
inside each matmul (the error `tests/e2e/test_rehearse.py` was first shown to catch: zero3 15% short). The rehearsal's
heap checks must fail with it. Python imports this at every interpreter's start where its folder is on PYTHONPATH."""

from strategies.cli import rehearse

rehearse._cpu_workspace = lambda world_size: (lambda rows, inner, cols: 0)
