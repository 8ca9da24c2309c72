"""Several job scripts' fits in one set of ranks: ``python _jobs.py OUT WORLD JOB[=ARG] ...``, each JOB a module of
this folder (``_sgd_job``, ``_ep_job``, ...) whose ``main(WORLD[, ARG])`` runs its Trainer fits and returns what it
measured. Ranks cost most of a job's time at this size (each imports torch and Lightning, several seconds), so the
session pays for them once per world size (`conftest.jobs`). Like each job, it is a plain Lightning script: Lightning's
popen launcher re-runs it for the other ranks, the later Trainers find the process group there, and it ends as a
user's script ends (no barrier, no destroy). Rank 0 saves {JOB: its results} to OUT."""

import importlib
import sys

import torch

if __name__ == "__main__":
    out, world = sys.argv[1], int(sys.argv[2])
    results = {}
    for spec in sys.argv[3:]:
        name, _, arg = spec.partition("=")
        job = importlib.import_module(f"tests.e2e.{name}")
        results[name] = job.main(world, *([arg] if arg else []))
    if torch.distributed.get_rank() == 0:
        torch.save(results, out)
