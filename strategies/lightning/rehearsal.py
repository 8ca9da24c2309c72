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
from strategies.checkpoint.dcp_dir import MODEL, SliceLoad, optimizer_key
from strategies.checkpoint.slices import Boxed, leaves, make_optimizer_state
from strategies.lightning.strategy import PlanStrategy
from strategies.measure.meta_heap import uncounted
from strategies.tensors import meta_cast

META = torch.device("meta")
REHEARSED = "<a rehearsed checkpoint>"  # the path a rehearsed resume reads from (`RehearsalStrategy.resume`)


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
                 device: torch.device | str | None = None, resume: bool = False, save_at_end: bool = False,
                 **options: Any) -> None:
        options.setdefault("check_first_batch", False)  # it needs the whole model's values
        self.real = torch.device(device) if device is not None else None
        super().__init__(plan, parallel_devices=[self.real or torch.device("cpu")],
                         cluster_environment=RehearsalEnvironment(rank, world_size), **options)
        self.backend = backend  # whose buffers the collectives hold (`comm.set_rehearsal`): gloo, nccl
        self.resume = resume  # the fit resumes from a checkpoint by slice (rehearsed: `load_state_by_slice`)
        self.save_at_end = save_at_end  # a checkpoint by slice saved once the last step is done (`rehearse_save`)
        self.heap: Any = None  # the rehearsal's `MetaHeap`, for the checkpoint's peaks
        self.checkpoint_peaks: dict[str, int] = {}  # "save", "resume": the heap's peak while each ran

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
        if self.resume:  # as Lightning's restore of a DCP checkpoint: the weights once the slices exist ...
            self._slice_load = (SliceLoad(REHEARSED, MODEL), True)
        super().setup(trainer)
        if self.resume:  # ... and the optimizer's state after set-up (under pp: once the first batch cut it)
            self.load_optimizer_state_dict({"optimizer_states": [SliceLoad(REHEARSED, optimizer_key(0))]})

    # A checkpoint by slice, rehearsed as torch's DCP file system writer and reader run (`dcp_dir`): what this rank
    # holds as it lies (`state_by_slice`: views, nothing new), each piece copied to the host one at a time. On a GPU
    # that holds nothing more on the device; on a CPU a piece that is a view of a larger storage is copied into one of
    # its own to be written, and a read lands in a tensor of the chunk's size before it is copied in place, the
    # previous one still held while the next is made (the writer's loop).

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.save_at_end:
            self.rehearse_save()

    def rehearse_save(self) -> None:
        """A save by slice at this point of the fit: its peak in ``checkpoint_peaks["save"]``."""
        with self._window("save"):
            _copied_one_at_a_time(self.state_by_slice(optimizer=True), self.backend == "gloo", fresh=False)

    @override
    def load_state_by_slice(self, path: str, optimizer: bool = True, strict: bool = True, model: bool = True,
                            index: int = 0) -> None:
        if path != REHEARSED:
            return super().load_state_by_slice(path, optimizer, strict, model, index)
        with self._window("resume"):
            if optimizer:  # (made by a step on zero gradients, as the real resume does)
                make_optimizer_state(self._raw_optimizer())
            state = self.state_by_slice(optimizer, load=True)
            if not model:
                del state[MODEL]
            _copied_one_at_a_time(state, self.backend == "gloo", fresh=True)
            for technique in self.techniques if model else ():
                technique.after_slice_load()
        return None

    @contextlib.contextmanager
    def _window(self, name: str) -> Iterator[None]:
        """The heap's peak while the block runs, into ``checkpoint_peaks[name]``, the heap's own peak kept."""
        heap = self.heap
        outer, heap.peak = heap.peak, heap.live
        try:
            yield
        finally:
            self.checkpoint_peaks[name] = max(self.checkpoint_peaks.get(name, 0), heap.peak)
            heap.peak = max(outer, heap.peak)

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


def _copied_one_at_a_time(state: dict[str, Any], on_cpu: bool, fresh: bool) -> None:
    """Each piece of ``state`` (`slices.Boxed`'s, and plain tensors) copied as DCP's writer (or, ``fresh``, its
    reader) copies it on a CPU, the previous copy freed once the next is made; on a GPU nothing is made on the device
    (the copies are the host's)."""
    held = None
    for _, leaf in leaves(state):
        for data in ([d for _, _, d in leaf.pieces] if isinstance(leaf, Boxed) else
                     [leaf] if isinstance(leaf, torch.Tensor) else []):
            whole = data.untyped_storage().nbytes() == data.numel() * data.element_size()
            if on_cpu and (fresh or not whole):
                held = torch.empty_like(data)  # (made before the last one is let go)
    del held


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
