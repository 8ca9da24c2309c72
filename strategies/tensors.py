"""Where a tensor's memory is, in a form that holds on the meta device too.

Every meta tensor has data pointer 0 (a rehearsal's, `strategies.lightning.rehearsal`, are all meta), so code that
asks "is this gradient already the slot of its bucket?" by ``data_ptr()`` would answer yes for any two. These answer
by the storage itself there.
"""

from __future__ import annotations

import torch


def storage_id(t: torch.Tensor) -> int:
    """One number per storage while it lives: its data pointer, or on meta the storage object's own."""
    storage = t.untyped_storage()
    return storage._cdata if t.device.type == "meta" else storage.data_ptr()


def address(t: torch.Tensor) -> tuple[int, int]:
    """Where ``t``'s first element is: (its storage, the byte offset in it); on a real device the same test as
    comparing ``data_ptr()``."""
    if t.device.type == "meta":
        return storage_id(t), t.storage_offset() * t.element_size()
    return t.data_ptr(), 0
