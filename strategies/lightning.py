"""The Lightning Strategy that runs a ParallelPlan: ranks and launching from Lightning, the rest from the pieces.

Lightning owns processes (its launchers, torchrun, SLURM), ranks, the loops and precision. This class only
resolves the plan against the world size (at Trainer construction, in the main process), builds the mesh
once the process group exists, attaches the data-parallel gradient sync, and routes Lightning's own
reduce / broadcast / barrier through comm.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Generator
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor, nn
from torch.distributed import ReduceOp
from typing_extensions import override

from strategies import comm
from strategies.runstore import pack_version
from strategies.sharded_checkpoint import load_any, save_sharded
from strategies.comm import CommStats
from strategies.data_parallel import (
    DEFAULT_BUCKET_CAP_MB,
    BucketedDataParallel,
    GradSync,
    NaiveDataParallel,
    broadcast_module,
)
from strategies.memory import SavedTensorsMeter, model_state_bytes
from strategies.mesh import ParallelMesh
from strategies.zero import ZeroGradSync, shard_model, shard_slices
from strategies.clipping import clip_pieces
from strategies.checkpointing import apply_activation_checkpointing, remove_activation_checkpointing
from strategies.lightning_pipeline import PipelineStepsMixin
from strategies.lightning_state import StateRoutingMixin
from strategies.pipeline.engine import PipelineEngine
from strategies.pipeline.stages import find_blocks
from strategies.sequence_parallel import SequenceParallel
from strategies.plan import DataMode, ParallelPlan
from strategies.options import check_options, collective_timeout
from strategies.tp_plan import apply_plan, detect_plan, restore_full_layers, split_params
from strategies.zero3 import Zero3GradSync

class PlanStrategy(PipelineStepsMixin, StateRoutingMixin, ParallelStrategy):
    """Train a LightningModule, written as for one device, with a parallel plan such as ``"dp"`` or ``"naive"``.

    Args:
        plan: a strategy string (``"dp"``, ``"naive_dp4"``, ...) or a ParallelPlan.
        bucket_cap_mb: DDP bucket size (torch's default, 25 MB).
        find_unused_parameters: allow parameters that get no gradient in a step (they are reduced as zeros).
        ring_all_reduce: reduce DDP buckets with the explicit p2p ring of comm.py instead of the backend's
            all-reduce (synchronous: it shows the algorithm; the backend's is faster).
        server_rank: the parameter server's index on the data-parallel axis, for ``naive``.
        zero3_units: ZeRO-3's wrapping policy: ``module -> [(name, submodule), ...]`` gathered together
            (default: the blocks of every ModuleList/Sequential, then each other module owning parameters).
        tp_plan: which submodules tensor parallel splits, ``{"*.attn.qkv": Colwise(chunks=3), ...}``
            (`strategies.tp_plan`); by default the shipped plan that fits the model.
        pipeline_blocks: the name of the list of blocks pipeline parallel cuts into stages and activation
            checkpointing wraps (e.g. ``"model.layers"``); by default the longest ``nn.ModuleList`` /
            ``nn.Sequential`` of the module.
        pipeline_balance: cut the stages by parameter count (``"params"``), or by the forward time of each
            block measured on the first training batch (``"time"``, agreed by all ranks).
        process_group_backend: ``"gloo"`` / ``"nccl"``; by default from the device.
        timeout: how long a collective may wait for the other ranks before the job fails with each rank's last
            collectives (a timedelta or seconds); by default ``$STRATPACK_TIMEOUT`` seconds, else 30 minutes.
        start_method: ``"popen"`` (re-run the script, like ``ddp``) or ``"spawn"`` / ``"fork"``.
        stop_on_nonfinite_loss: a NaN or infinite loss ends the job with ``FloatingPointError`` naming the
            rank and step (default), instead of training on with parameters it would poison.
    """

    strategy_name = "plan"

    def __init__(
        self,
        plan: str | ParallelPlan = "dp",
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        find_unused_parameters: bool = False,
        ring_all_reduce: bool = False,
        server_rank: int = 0,
        zero3_units: Any = None,
        tp_plan: dict | None = None,
        pipeline_blocks: str | None = None,
        pipeline_balance: Literal["params", "time"] = "params",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        stop_on_nonfinite_loss: bool = True,
    ) -> None:
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
        )
        self.plan = plan if isinstance(plan, ParallelPlan) else ParallelPlan.parse(plan)
        check_options(bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters,
                      ring_all_reduce=ring_all_reduce, server_rank=server_rank, zero3_units=zero3_units,
                      tp_plan=tp_plan, pipeline_blocks=pipeline_blocks, pipeline_balance=pipeline_balance,
                      process_group_backend=process_group_backend, start_method=start_method,
                      stop_on_nonfinite_loss=stop_on_nonfinite_loss)
        self._stop_on_nonfinite = stop_on_nonfinite_loss
        self._sync_options = dict(bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters,
                                  ring=ring_all_reduce, server=server_rank, units=zero3_units)
        self._process_group_backend = process_group_backend
        self._timeout = collective_timeout(timeout)
        self._start_method = start_method
        self._num_nodes = 1
        self.resolved_plan: ParallelPlan | None = None
        self.comm_stats = CommStats()
        self.mesh: ParallelMesh | None = None
        self.grad_sync: GradSync | None = None
        self._tp_plan = tp_plan
        self.tp_layers: dict = {}  # module name -> style, once tensor parallel has split the model
        self.sequence_parallel: SequenceParallel | None = None
        self._pipeline_blocks = pipeline_blocks
        self._pipeline_balance = pipeline_balance
        self._pipeline_deferred = False  # balanced by time: the engine is built at the first training step
        self.pipeline: PipelineEngine | None = None
        self._pipeline_grads: dict[int, Tensor] = {}  # gradients the schedule made, handed back in backward()
        self._new_window = True  # no gradient accumulated since the last optimizer step
        self._checkpointed: list = []  # blocks whose forward activation checkpointing wraps
        self._in_schedule = False
        self.activation_bytes = self.peak_activation_bytes = 0
        self._failed: BaseException | None = None  # set by on_exception: teardown must not wait on other ranks

    # -- where ranks come from -------------------------------------------------------------------------

    @property
    def is_distributed(self) -> bool:
        # Lightning injects a DistributedSampler and syncs self.log(sync_dist=True) only when this is True.
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Tensor- and pipeline-parallel peers must read the same samples: shard over the dp axis only.
        plan = self.resolved_plan or self.plan.resolve(self.world_size)
        return {"num_replicas": plan.dp, "rank": plan.coordinates(self.global_rank)["dp"]}

    def set_world_ranks(self) -> None:
        # Lightning calls this in the main process while the Trainer is built, so an impossible plan fails
        # there, before any process is launched, with the arithmetic in the message.
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        self.resolved_plan = self.plan.resolve(self.world_size)
        dp, server = self.resolved_plan.dp, self._sync_options["server"]
        if self.plan.data is DataMode.NAIVE and server >= dp:
            raise ValueError(f"server_rank={server} is not on the data-parallel axis of '{self.resolved_plan}' "
                             f"(indices 0..{dp - 1}); pass a server_rank below {dp}")

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _ExitingMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)
        comm.RECORDER.timeout = self._timeout
        self.mesh = ParallelMesh(self.resolved_plan, self.root_device.type, self.comm_stats)

    # -- model ------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None and self.mesh is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.resolved_plan.tp > 1 and not self.tp_layers:
            plan = self._tp_plan if self._tp_plan is not None else detect_plan(self.model)
            self.tp_layers = apply_plan(self.model, plan, self.mesh.tp)  # split the full, initialised layers
            if self.resolved_plan.sp:
                split = set(split_params(self.model, self.tp_layers))
                self.sequence_parallel = SequenceParallel(self.model, self.tp_layers, split, self.mesh.tp)
        if self.resolved_plan.ac and not self._checkpointed:
            blocks = self.model.get_submodule(find_blocks(self.model, self._pipeline_blocks))
            self._checkpointed = apply_activation_checkpointing(blocks)
        broadcast_module(self.model, self.mesh.dp)
        if self.resolved_plan.pp > 1 and self.pipeline is None:
            if getattr(self.precision_plugin, "scaler", None) is not None:
                raise ValueError("pipeline parallel does not support fp16 loss scaling (16-mixed) yet; use "
                                 "precision='bf16-mixed' or '32-true'")
            # After the broadcast: this replaces the parameters other stages own by placeholders. Balanced by
            # time, it waits for the first training batch to measure the blocks on.
            self._pipeline_deferred = self._pipeline_balance == "time" and trainer.state.fn == TrainerFn.FITTING
            if not self._pipeline_deferred:
                self.pipeline = PipelineEngine(self.model, self.resolved_plan, self.mesh, self._pipeline_blocks)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)  # before the sync: ZeRO builds its flats from the optimizer's groups
            if not self._pipeline_deferred:
                self._setup_grad_sync()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _setup_grad_sync(self) -> None:
        self.grad_sync = self._make_grad_sync(self.model)
        # Lightning clips by norm in the precision plugin, over the optimizer's params (here shards, slices or
        # one stage's): this instance's clip-by-norm takes the whole model's norm across the mesh instead.
        self.precision_plugin.clip_grad_by_norm = lambda optimizer, clip_val: self.clip_grad_norm(float(clip_val))
        if isinstance(self.grad_sync, ZeroGradSync):  # fp16: one rank's overflow skips the step everywhere
            self.grad_sync.sync_nonfinite = getattr(self.precision_plugin, "scaler", None) is not None

    def _make_grad_sync(self, module: torch.nn.Module) -> GradSync:
        options, axis = self._sync_options, self.mesh.dp
        if self.plan.data.is_zero:
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"ZeRO shards one optimizer, but configure_optimizers returned {len(self.optimizers)}; "
                    "use one optimizer (with several param groups if needed), or the 'dp' plan"
                )
            return shard_model(module, self.optimizers[0], axis, stage=self.plan.data.stage, offload=self.plan.offload,
                               bucket_cap_mb=options["bucket_cap_mb"],
                               find_unused_parameters=options["find_unused_parameters"], units=options["units"])
        if self.plan.data is DataMode.NAIVE:
            return NaiveDataParallel(module, axis, server=options["server"],
                                     find_unused_parameters=options["find_unused_parameters"])
        return BucketedDataParallel(module, axis, bucket_cap_mb=options["bucket_cap_mb"],
                                    find_unused_parameters=options["find_unused_parameters"], ring=options["ring"])

    def held_grads(self) -> list[tuple[str, nn.Parameter, Tensor]]:
        """``(name, parameter, gradient)`` for the gradient this rank holds: under ZeRO its shard of each flat,
        cut at parameter boundaries (a piece of that parameter's gradient); else each parameter's ``.grad``
        (this stage's, possibly tp-sliced, parameters)."""
        if isinstance(self.grad_sync, ZeroGradSync):
            return [(flat.names[i], flat.params[i], piece) for flat in self.grad_sync.flats
                    if flat.master.grad is not None for i, piece in shard_slices(flat, flat.master.grad)]
        return [(name, p, p.grad) for name, p in self.lightning_module.named_parameters() if p.grad is not None]

    def gradient_pieces(self) -> list[tuple[Tensor, bool]]:
        """The gradient this rank holds, as ``(tensor, split over tp?)`` pieces (`held_grads`)."""
        split = {name for name, _ in split_params(self.lightning_module, self.tp_layers).values()} \
            if self.tp_layers else set()
        return [(grad, name in split) for name, _, grad in self.held_grads()]

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip every rank's gradient by the whole model's norm (over tp slices, ZeRO shards and pipeline
        stages); returns that norm. Every rank must call it."""
        disjoint = [self.mesh.pp] + ([self.mesh.dp] if isinstance(self.grad_sync, ZeroGradSync) else [])
        return clip_pieces(self.gradient_pieces(), max_norm, tp=self.mesh.tp, disjoint=disjoint,
                           norm_type=norm_type, device=self.root_device)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._new_window = True
        if isinstance(self.grad_sync, ZeroGradSync):
            self.grad_sync.after_step()  # all-gather the updated shards (ZeRO-1/2), refresh offloaded ones
        return output

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # Measure what autograd keeps for backward (the activations) on every step: cheap, one hook per save.
        # Under pipeline parallel the backwards run inside too, so this is the peak held across the schedule.
        flats = getattr(self.grad_sync, "flats", [])
        with SavedTensorsMeter(self.lightning_module, lambda: [f.full for f in flats]) as meter:
            if self.pipeline is not None or self._pipeline_deferred:
                output = self._pipeline_training_step(*args, **kwargs)
            else:
                output = super().training_step(*args, **kwargs)
        self.activation_bytes = meter.bytes
        self.peak_activation_bytes = max(self.peak_activation_bytes, meter.bytes)
        if self._stop_on_nonfinite and self.pipeline is not None:
            # The schedule already ran backward; raising here still skips the optimizer step.
            self._check_finite(output)
        return output

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        # Before backward, automatic or manual (`manual_backward` comes here too): a NaN loss would make NaN
        # gradients, the all-reduce would spread them to every rank and the step would poison the parameters.
        if self._stop_on_nonfinite and self.pipeline is None:
            self._check_finite(closure_loss)
        super().pre_backward(closure_loss)

    def _check_finite(self, output: Any) -> None:
        loss = output.get("loss") if isinstance(output, dict) else output
        if isinstance(loss, Tensor) and not bool(torch.isfinite(loss.detach()).all()):
            step = self.lightning_module.trainer.global_step if self.lightning_module is not None else "?"
            raise FloatingPointError(
                f"the loss is {loss.detach().float().reshape(-1)[0].item()} at step {step} on rank "
                f"{self.global_rank}. Look at that rank's batch, lower the learning rate or clip gradients "
                f"(Trainer(gradient_clip_val=...)); PlanStrategy(..., stop_on_nonfinite_loss=False) trains on")

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients, optimizer states (and offloaded host state) this rank holds."""
        assert self.lightning_module is not None
        return model_state_bytes(self.lightning_module, self.optimizers, self.grad_sync)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # Lightning calls this after every backward; on the last micro-step (outside block_backward_sync) the
        # gradients are averaged here, before clipping and the optimizer step see them.
        if self.grad_sync is not None:
            self.grad_sync.finish()
            if self.sequence_parallel is not None and self.grad_sync.require_sync:
                self.sequence_parallel.reduce_partial_grads(self._partial_grads())  # norms saw 1/tp of the sequence

    def _partial_grads(self) -> list[Tensor]:
        # Sequence parallel's partial gradients, where this rank holds them: whole under dp/naive, pieces in the
        # shards under ZeRO (flats are laid out alike on every tp rank, so tp peers hold the same pieces).
        partial = {id(p) for p in self.sequence_parallel.partial}
        return [grad for _, p, grad in self.held_grads() if id(p) in partial]

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this on gradient-accumulation micro-steps: no communication there.
        if self.grad_sync is None:
            yield
            return
        with self.grad_sync.no_sync():
            yield

    # -- checkpoints: every rank writes its part (strategies.checkpoint) ------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("PlanStrategy's sharded checkpoints take no storage_options")
        world = self.mesh.world
        save_sharded(checkpoint, filepath, rank=self.global_rank, world_size=self.world_size,
                     broadcast=lambda obj: comm.broadcast_object(obj, world, src=0),
                     gather=lambda obj: comm.all_gather_object(obj, world), barrier=lambda: comm.barrier(world),
                     info={"plan": str(self.resolved_plan), "pack_version": pack_version()})

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # A sharded directory from any plan and world size, or a single-file checkpoint (single process, ddp).
        return load_any(checkpoint_path, weights_only=weights_only)

    # -- Lightning's own collectives, through comm.py on the world axis -------------------------------------

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self.mesh is not None:
            comm.barrier(self.mesh.world)
        elif dist.is_available() and dist.is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.mesh is None:
            return obj
        return comm.broadcast_object(obj, self.mesh.world, src=src)

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        """Every rank's ``tensor`` stacked in rank order (no gradient flows back through it)."""
        if sync_grads:
            raise NotImplementedError("PlanStrategy.all_gather does not propagate gradients (sync_grads=True)")
        if self.mesh is None:
            return tensor.unsqueeze(0)
        out = torch.empty((self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        comm.all_gather(out.view(-1), tensor.detach().contiguous().view(-1), self.mesh.world)
        return out

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if not isinstance(tensor, Tensor) or self.mesh is None:
            return tensor
        if self._in_schedule:  # only the last stage's ranks get here: a world all-reduce would hang
            raise RuntimeError(
                "under pipeline parallel, training_step runs on the last stage's ranks only, so "
                "self.log(..., sync_dist=True) inside it cannot reduce over every rank. Log with sync_dist=False "
                "(the loss training_step returns is already the same on every rank), or log in "
                "validation_step, which runs on every rank."
            )
        mean = reduce_op is None or (isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg"))
        if not mean and reduce_op not in (ReduceOp.SUM, "sum"):
            raise ValueError(f"reduce supports 'mean' and 'sum', got {reduce_op!r}")
        out = tensor.detach().clone()  # Lightning's callers may still use the tensor they passed
        if mean and not out.is_floating_point():
            out = out.float()
        comm.all_reduce(out, self.mesh.world)
        return out / self.world_size if mean else out

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Name the rank in the message: with N processes writing to one terminal, the traceback alone does not
        # say whose it is. Then teardown skips everything that talks to other ranks (they may be waiting in a
        # different collective, or be gone), so this process exits and the launcher stops the others.
        self._failed = exception
        hint = ""
        if isinstance(exception, torch.OutOfMemoryError):
            hint = (f"\n[rank {self.global_rank}] out of memory under '{self.plan}': a plan that holds less per "
                    "rank (zero3, ac, offload, more tp/pp), a smaller batch or more microbatches; `stratpack plan` "
                    "ranks plans by predicted memory")
        print(f"[rank {self.global_rank}] {self.plan} failed: {type(exception).__name__}: {exception}{hint}",
              file=sys.stderr, flush=True)

    @override
    def teardown(self) -> None:
        # After a failure, only local undoing (hooks): gathering would wait on ranks that may be gone or stuck
        # elsewhere, and the module is left as it was when the step failed.
        gather = self._failed is None and self.lightning_module is not None
        if gather and isinstance(self.grad_sync, Zero3GradSync):
            self.grad_sync.gather_all()  # leave a normal module behind: every parameter full again
        if gather and self.pipeline is not None:
            self.pipeline.restore_full_model()  # every parameter back from its stage: a whole module again
        self.pipeline = None
        remove_activation_checkpointing(self._checkpointed)
        self._checkpointed = []
        if self.sequence_parallel is not None:
            self.sequence_parallel.remove()
            self.sequence_parallel = None
        if gather and self.tp_layers:
            restore_full_layers(self.lightning_module, self.tp_layers, self.mesh.tp)  # the same for tp
        self.tp_layers = {}
        if self.grad_sync is not None:
            self.grad_sync.remove()
            self.grad_sync = None
        super().teardown()


class _ExitingMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, whose workers end with ``os._exit(0)`` once their results are handed
    back. Workers of ours sometimes (about 1 run in 4 of a fit with validation and checkpoints, never in a
    plain loop) aborted in C++ teardown at interpreter exit ("terminate called without an active
    exception"), failing a finished run; the root cause is not found yet. Nothing is left to do by then."""

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class NaiveDataParallelStrategy(PlanStrategy):
    """Parameter-server data parallel (the plan ``naive``): all gradients go through one server rank."""

    def __init__(self, server_rank: int = 0, **kwargs: Any) -> None:
        super().__init__("naive", server_rank=server_rank, **kwargs)


class DataParallelStrategy(PlanStrategy):
    """Our DDP (the plan ``dp``): bucketed all-reduce overlapped with backward."""

    def __init__(self, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, find_unused_parameters: bool = False,
                 ring_all_reduce: bool = False, **kwargs: Any) -> None:
        super().__init__("dp", bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters,
                         ring_all_reduce=ring_all_reduce, **kwargs)
