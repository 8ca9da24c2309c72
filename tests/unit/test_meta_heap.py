"""A rehearsal's heap (`measure.meta_heap.MetaHeap`) keeps offload's host memory apart from the device's.

On meta every tensor is on one device; a GPU rehearsed (``device_only``) must still leave out what offload keeps in
host memory: the copies made inside `tensors.host_memory`, and what is computed from host tensors alone (the
optimizer's state and its step's temporaries). Counted with the device's, 8B's `zero3_ac_offload` read 20.9 GiB on
the device for 22.7 (the host's gradient shard, freed by then, was subtracted from the peak all the same).
"""

from __future__ import annotations

import torch

from strategies.measure.meta_heap import MetaHeap
from strategies.tensors import host_memory

KIB4 = 1024 * 4  # 1,024 float32


def test_host_memory_is_counted_apart_and_left_out_of_a_devices_peak():
    for device_only in (True, False):
        heap = MetaHeap(device_only=device_only)
        with heap.tracking():
            shard = torch.empty(1024, device="meta")
            with host_memory():
                master = shard.detach().to("meta", copy=True)  # offload's host copy
            state = torch.zeros_like(master)  # the optimizer's state: from host tensors alone
            root = state.sqrt()  # a temporary of the host's step
            del root
            both = master + shard  # one device operand: the device's
            assert heap.host == 2 * KIB4, device_only
            assert heap.live == (2 if device_only else 4) * KIB4, device_only
            assert heap.peak == (2 if device_only else 4) * KIB4, device_only
            del master, state, both
            assert (heap.host, heap.live) == (0, KIB4)
