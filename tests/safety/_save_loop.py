"""Saves checkpoint after checkpoint over one path until killed: ``python _save_loop.py PATH``.

Checkpoint k holds tensors full of k and {"k": k}; it prints ``saved k`` after each save completes."""

import sys

import torch

from strategies.checkpoint import sharded as ckpt

path = sys.argv[1]
k = 0
while True:
    k += 1
    state = {"state_dict": {"a": torch.full((2_000_000,), float(k)), "b": torch.full((3, 1001), float(k))},
             "k": k}
    ckpt.save_sharded(state, path, rank=0, world_size=1, broadcast=lambda o: o, gather=lambda o: [o],
                      barrier=lambda: None, info={"plan": "test"})
    print(f"saved {k}", flush=True)
