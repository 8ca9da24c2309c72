"""A rehearsal: one rank of an N-rank job, run alone on this machine, through the real strategy and techniques.

`RehearsalStrategy` is a `PlanStrategy` whose model lives on the meta device (``compute_device``): shapes, no
memory, no values. The process joins torch's fake process group as rank R of N, so the mesh, every technique and
the pipeline's programs see the job's real axes; the one place that communicates (`strategies.comm`) counts every
collective and message as it would be sent and sends none (`comm.set_rehearsal`). Lightning's own control values
(a stop signal, a loader's length) stay real tensors on the CPU and get what every rank alike would give. What a
rehearsal measures (`strategies.measure.meta_heap`, `stratpack rehearse`): every byte the rank's tensors would
take, by category and over the step, and every byte it would send, per collective and axis.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from typing_extensions import override

from strategies import comm
from strategies.lightning.strategy import PlanStrategy
from strategies.measure.meta_heap import uncounted
from strategies.tensors import meta_cast

META = torch.device("meta")


class RehearsalEnvironment(LightningEnvironment):
    """Rank ``rank`` of ``world_size``, in a process nobody launched and that launches nothing."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self._rank, self._world = rank, world_size

    @property
    def creates_processes_externally(self) -> bool:
        return True

    def world_size(self) -> int:
        return self._world

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:  # the strategy sets what it computes: this rank is given
        pass

    def set_world_size(self, size: int) -> None:
        pass

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return 0


def join_fake_world(rank: int, world_size: int) -> None:
    """Make this process rank ``rank`` of a ``world_size``-rank fake process group (torch's testing backend: groups
    and ranks as in the job, collectives that do nothing), unless one is already set up."""
    if dist.is_initialized():
        if dist.get_backend() != "fake" or dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError("a rehearsal runs in a process of its own: torch.distributed is already initialized")
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def leave_fake_world() -> None:
    comm.set_rehearsal(False)
    if dist.is_initialized():
        dist.destroy_process_group()


class RehearsalStrategy(PlanStrategy):
    """`PlanStrategy` for rank ``rank`` of ``world_size``, rehearsed (see the module's docstring). The model must be
    built on meta (``configure_model``, ``trainer.init_module(empty_init=True)``): the rank makes its own slice only.

    ``device``: where the rank's compute runs for real, with real tensors (a GPU, or this CPU), so that its
    allocator's peak and its kernels' time are real; nothing is sent still, a receive reads zeros and a collective
    leaves what every rank alike would give (`comm.set_rehearsal`). None (the default): on meta, no values at all."""

    strategy_name = "rehearsal"

    def __init__(self, plan: str, *, rank: int, world_size: int, backend: str = "nccl",
                 device: torch.device | str | None = None, **options: Any) -> None:
        options.setdefault("check_first_batch", False)  # it needs the whole model's values
        self.real = torch.device(device) if device is not None else None
        super().__init__(plan, parallel_devices=[self.real or torch.device("cpu")],
                         cluster_environment=RehearsalEnvironment(rank, world_size), **options)
        self.backend = backend  # whose buffers the collectives hold (`comm.set_rehearsal`): gloo, nccl

    @property
    @override
    def compute_device(self) -> torch.device:
        return self.root_device if self.real is not None else META

    @override
    def setup_environment(self) -> None:
        join_fake_world(self.global_rank, self.world_size)
        comm.set_rehearsal(True, self.backend)
        super().setup_environment()

    @override
    def setup(self, trainer: Any) -> None:
        if not any(p.device.type == "meta" for p in self.lightning_module.parameters()):
            raise ValueError("a rehearsal needs the model built on meta: build it in configure_model() (or under "
                             "trainer.init_module(empty_init=True)); this one holds real weights")
        super().setup(trainer)

    # What is meta in a real run too costs nothing there: the model's shapes before its slices are made (the build),
    # and the pipeline's trace on shapes (`measure.meta_heap.uncounted`)

    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Iterator[None]:
        with uncounted(), super().model_sharded_context():
            yield

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        with uncounted(), super().tensor_init_context(empty_init):
            yield

    @override
    def _tracing(self) -> contextlib.AbstractContextManager:
        return uncounted()

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        return super().batch_to_device(batch, self.compute_device, dataloader_idx)

    @override
    def teardown(self) -> None:
        # Lightning's teardown moves the module and the optimizers' states to the CPU: here they are shapes.
        module, self._lightning_module = self._lightning_module, None
        self.optimizers = []
        try:
            super().teardown()
        finally:
            self._lightning_module = module
            comm.set_rehearsal(False)


@contextlib.contextmanager
def target_kernels(device_type: str) -> Iterator[None]:
    """Inside, attention on meta tensors runs the fused kernel a ``device_type`` ("cpu", "cuda") device would choose,
    and the optimizers step with the kernels they would choose there.
    On meta, torch's ``scaled_dot_product_attention`` falls back to its math form, which keeps the whole attention
    matrix for backward; the fused kernels (flash on CUDA, its CPU twin) keep the output and one row statistic. Only
    the causal or unmasked call without dropout is redirected (grouped keys too, ``enable_gqa``): the rest keeps
    torch's own choice."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    fused = {"cpu": torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
             "cuda": torch.ops.aten._scaled_dot_product_flash_attention}[device_type]

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        heads, groups = query.shape[-3], key.shape[-3]
        simple = (query.device.type == "meta" and attn_mask is None and dropout_p == 0.0 and query.dim() == 4
                  and (heads == groups or (kwargs.get("enable_gqa", False) and heads % groups == 0)))
        if not simple:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, **kwargs)
        if torch.is_autocast_enabled("cpu"):  # (the wrapper is Python: `MetaAutocast` does not see it)
            query, key, value = meta_cast((query, key, value), torch.get_autocast_dtype("cpu"))
        if heads != groups:  # grouped keys and values: read in place by the kernel (here a view, no copy)
            key, value = (t.as_strided(query.shape[:2] + t.shape[2:], (t.stride(0), 0, *t.stride()[2:]))
                          for t in (key, value))
        return fused(query, key, value, 0.0, is_causal, scale=scale)[0]

    F.scaled_dot_product_attention = attention
    try:
        with _optimizer_kernels(device_type):
            yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def _optimizer_kernels(device_type: str) -> Iterator[None]:
    """The optimizers' step as on ``device_type``: on CUDA torch's optimizers run their foreach kernels by default
    (one temporary the size of all their parameters: AdamW's square roots), elsewhere one tensor at a time."""
    import torch.optim.optimizer as optim

    devices = optim._get_foreach_kernels_supported_devices
    if device_type == "cuda":
        optim._get_foreach_kernels_supported_devices = lambda: [*devices(), "meta"]
    try:
        yield
    finally:
        optim._get_foreach_kernels_supported_devices = devices
