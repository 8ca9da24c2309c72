"""A planted error for `scripts/stress.sh` (STRESS_PLANT=torn_taken): resuming takes the newest checkpoint whether
or not its save finished (no manifest check). `tests/safety/test_restart.py`'s torn cases must fail with it. Python
imports this at every interpreter's start where its folder is on PYTHONPATH, the ranks' too."""

from strategies.checkpoint import newest

newest._incomplete = lambda path: None
