"""The Lightning Strategy that runs a ParallelPlan: ranks, launching and the loops from Lightning, the rest a loop
over the plan's techniques.

Lightning owns processes (its launchers, torchrun, SLURM), ranks, the loops and precision. This class resolves the
plan against the world size (at Trainer construction, in the main process), builds the mesh once the process group
exists, applies the plan's techniques (`assemble`) and keeps them in a list, and routes each of Lightning's hooks
through them (`strategies.technique`: state, gradients, steps, teardown); steps go through `steps`, Lightning's own
reduce / broadcast / barrier through `strategies.comm`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
from collections.abc import Generator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp
from typing_extensions import override

from strategies import comm, deferred
from strategies.checkpoint import load_any, save_sharded
from strategies.checkpoint.async_save import AsyncSaver, SaveStalls, save_axis
from strategies.checkpoint.dcp_dir import (
    FOREIGN,
    MODEL,
    SliceLoad,
    load_into,
    load_rest,
    optimizer_key,
    read_metadata,
    save_dcp,
)
from strategies.checkpoint.directory import CheckpointError, is_dcp
from strategies.checkpoint.layout import Layout, layout_of
from strategies.checkpoint.pretrained import model_prefix
from strategies.checkpoint.slices import fill_boxes, keep_boxes, make_optimizer_state, rank_state, share_replicas
from strategies.clipping import clip_pieces
from strategies.comm import CommStats
from strategies.deferred import (
    Deferred,
    KeptSlices,
    has_meta_parameters,
    holds_whole_weights,
    leave_in_slices,
    refill_left_in_slices,
    refuse_left_in_slices,
    take_kept,
)
from strategies.files import pack_version
from strategies.lightning import assemble
from strategies.lightning.auto_resume import AutoResume, agree
from strategies.lightning.first_batch import FirstBatchCheck, Outcome
from strategies.lightning.launcher import ExitingMultiProcessingLauncher, elastic_store
from strategies.lightning.options import PlanOptions
from strategies.lightning.resume import resumable
from strategies.lightning.signals import quiet_sigterm
from strategies.lightning.steps import (
    DirectSteps,
    LossWatch,
    PipelineSteps,
    check_finite,
    deferred_logs,
    frees_grads_early,
)
from strategies.measure.memory import SavedTensorsMeter, model_state_bytes
from strategies.mesh import ParallelMesh
from strategies.mixed_precision import ParamDtype, check_param_dtype, share_casts, step_casts, unshare_casts
from strategies.pipeline import PipelineParallel
from strategies.pipeline.stages import split_microbatches
from strategies.plan import DataMode, ParallelPlan, PipelineSchedule
from strategies.technique import HeldGrad, OptimizerState, Technique, optimizer_names, outside_all
from strategies.tensors import StandInReads

_TRACE_READ = (
    "training_step read a tensor's value while the pipeline traced it on shapes ({error}). A model built in "
    "configure_model has no values until each stage makes its own part, and the pipeline learns where to cut it by "
    "running training_step once on meta tensors first. Numbers read there (loss.item(), float(loss), int(n)) get a "
    "stand-in; a truth value (an `if` or `assert` on a tensor), .tolist() or .numpy() cannot. Guard that line with "
    "`if not loss.is_meta:` (true only in this trace), or build the model in __init__.")


class PlanStrategy(ParallelStrategy):
    """Train a LightningModule, written as for one device, with a parallel plan such as ``"zero3_tp2_pp2"``.

    Args:
        plan: a strategy string (``"dp"``, ``"naive_dp4"``, ``"zero3_tp2_pp2"``...) or a ParallelPlan.
        **options: `PlanOptions` (bucket size, tp plan, pipeline blocks, timeout, launcher...), checked here.
    The named classes (`DataParallelStrategy`, `ZeroStrategy`...) are this class with the plan spelled out.
    """

    strategy_name = "plan"

    def __init__(self, plan: str | ParallelPlan = "dp", *, accelerator: Any = None,
                 parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None, **options: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.plan = plan if isinstance(plan, ParallelPlan) else ParallelPlan.parse(plan)
        self.options = PlanOptions(**options)
        assemble.check_options(self.plan, self.options)
        self._process_group_backend = self.options.process_group_backend
        self._num_nodes = 1
        self.resolved_plan: ParallelPlan | None = None
        self.comm_stats = CommStats()
        self.mesh: ParallelMesh | None = None
        self.techniques: list[Technique] = []  # in the order applied (`strategies.technique`)
        self._steps = DirectSteps(self._lightning_hook)
        self._accumulating = False  # inside an accumulation window's micro-step: gradients stay local
        self._open_no_sync: contextlib.ExitStack | None = None  # the no_sync in force, which new techniques join
        self._pending_optimizer: dict[str, Any] | None = None  # a resumed optimizer state, until the pipeline is cut
        self._pending_model: tuple[dict[str, Any], bool] | None = None  # weights for a meta model, until the cut
        self._slice_load: tuple[SliceLoad, bool] | None = None  # a DCP checkpoint's weights, until the slices exist
        self._slices_at_cut = False  # fitting a meta model under pp: its slices exist once the first batch cut it
        self._kept: KeptSlices | None = None  # what a fit left in slices, taken up by this set-up (`take_kept`)
        self._flat_groups: list[list[str]] | None = None  # evaluating alone: the groups ZeRO's flats followed
        self._fitting = False
        self.activation_bytes = self.peak_activation_bytes = 0
        self.schedule_choice: str | None = None  # for pp<N> without a schedule: which the pipeline took, and why
        self._failed: BaseException | None = None  # set by on_exception: teardown must not wait on other ranks
        self._first_batch: FirstBatchCheck | None = None  # the whole model kept for the first-batch check
        self.first_batch: Outcome | None = None  # what the check found (both losses, or why it was skipped)
        self._deferred: Deferred | None = None  # a model built on meta, until every technique made its part
        self._sliced = False  # built on meta under a plan that splits it: left in slices at teardown
        self.built_num_params = 0
        self._saver: AsyncSaver | None = None  # async_save: the save in flight
        self.save_stalls = SaveStalls()  # how long training waited on each save
        self._losses_to_check = LossWatch()  # one process on a GPU: losses checked without stalling the host
        self._grads_stale = False  # an optimizer step ran: its gradients are freed before the next forward ...
        self._free_grads_early: bool | None = None  # ... where Lightning's zero_grad is not customised (each fit)
        self._shared_casts = False  # *-mixed: each weight cast once per training step (`mixed_precision`)
        self._param_dtype: ParamDtype | None = None  # options.param_dtype: every module computes in half copies

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
    def compute_device(self) -> torch.device:
        """Where the model's tensors live and compute: the root device (a rehearsal's are meta, while Lightning's own
        control values stay on the root device, `strategies.lightning.rehearsal`)."""
        return self.root_device

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
        dp, server = self.resolved_plan.dp, self.options.server_rank
        if self.plan.data is DataMode.NAIVE and server >= dp:
            raise ValueError(f"server_rank={server} is not on the data-parallel axis of '{self.resolved_plan}' "
                             f"(indices 0..{dp - 1}); pass a server_rank below {dp}")

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.options.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = ExitingMultiProcessingLauncher(self, start_method=self.options.start_method)
        if self.options.resume == "auto":  # a fit given no ckpt_path takes the newest complete checkpoint
            self._launcher = AutoResume(self._launcher)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        device_id = self.root_device if self.root_device.type != "cpu" else None
        if backend == "nccl":  # what a hang needs to be diagnosed (the user's own settings win)
            debug = os.environ.get(comm.DEBUG_ENV, "") not in ("", "0")
            for key, value in comm.recorder.nccl_environment(debug).items():
                os.environ.setdefault(key, value)
            faulthandler.enable(all_threads=True)  # the watchdog's abort then prints where each thread was
        store = elastic_store(self.world_size, self.options.timeout)  # (a restarted torchrun attempt's own keys)
        _init_dist_connection(self.cluster_environment, backend, timeout=self.options.timeout, device_id=device_id,
                              **({"store": store} if store is not None else {}))
        comm.leave_group_at_exit()  # a script that ends after fit, as Lightning's docs show, exits 0
        comm.RECORDER.timeout = self.options.timeout
        self.mesh = ParallelMesh(self.resolved_plan, self.root_device.type, self.comm_stats)
        comm.set_ordered_sums(self.options.deterministic)  # for this run (teardown turns it off)
        self._saver = AsyncSaver(save_axis(self.options.timeout)) if self.options.async_save else None

    # -- model ------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None and self.mesh is not None
        quiet_sigterm(trainer)  # (Lightning registers its signal handlers after this hook)
        self._take_or_refuse_left()
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._fitting, self._flat_groups = fitting, None
        self._grads_stale, self._free_grads_early = False, None  # (asked again for this fit's module and callbacks)
        if fitting and isinstance(self._launcher, AutoResume) and (chosen := self._launcher.chosen) is not None:
            agree(chosen, comm.broadcast_object(chosen, self.mesh.world), self.global_rank)
        self.accelerator.setup(trainer)
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        assemble.check_precision(self.precision_plugin, self.resolved_plan)
        assemble.check_optimization(self.lightning_module, self.resolved_plan)
        assemble.check_router_loss(self.lightning_module, self.resolved_plan)
        self.precision_plugin.convert_module(self.model)
        # Built on meta (configure_model, init_module(empty_init=True)): each technique makes only what it keeps.
        meta = has_meta_parameters(self.model)
        self._deferred = Deferred(self.lightning_module, self.compute_device) if meta else None
        # left in slices after fit where the plan split them; else kept, for test(ckpt_path="best") (larger-models.md)
        self._sliced = fitting and self._deferred is not None and not holds_whole_weights(self.resolved_plan)
        self.built_num_params = sum(p.numel() for p in self.lightning_module.parameters())  # whole, before any split
        self.model_to_device()
        if fitting and self.options.check_first_batch and self.first_batch is None:
            self._prepare_first_batch_check(str(trainer.precision))
        self.techniques = assemble.model_techniques(self.model, self.resolved_plan, self.mesh, self.options,
                                                    self._deferred)
        self._steps = self._make_steps(fitting)
        if self._deferred is not None and not fitting:
            self._evaluate_in_slices()
        if fitting:
            self.setup_optimizers(trainer)  # before the sync: ZeRO builds its flats from the optimizer's groups
            if self.resolved_plan.pp == 1:  # else the first batch builds the pipeline, then the sync
                self._add_grad_sync()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._slices_at_cut = self.resolved_plan.pp > 1 and self._deferred is not None
        self._load_slices()  # a DCP checkpoint given before set-up (Lightning's order), now that the slices exist

    def _take_or_refuse_left(self) -> None:
        """A module a fit left in slices (`deferred.leave_in_slices`): taken up again where that fit ran under this
        plan and ranks, the plan as it resolved then (its stages cut alike), its slices put back once this set-up has
        made its own (`_take_up_kept`); else refused, saying why."""
        self._kept = take_kept(self.lightning_module, self.plan, self.world_size, self.global_rank)
        if self._kept is not None:
            self.resolved_plan = ParallelPlan.parse(self._kept.plan).resolve(self.world_size)
        refuse_left_in_slices(self.lightning_module)

    def _evaluate_in_slices(self, cut: bool = False) -> None:
        """test/validate/predict alone of a model built on meta: ZeRO-3 shards it as a fit would, its units gathered
        for their forward only, over an optimizer that is never stepped (it only groups the weights into flats),
        and each rank then reads its shard of a checkpoint (`_load_slices`). Under pp the first batch evaluated
        cuts the stages (as a fit's first training batch does: `_build_pipeline`), and this runs again then (``cut``)
        for what the stage keeps. Where the weights are whole anyway, they are made whole."""
        plan = self.resolved_plan
        self._sliced = not holds_whole_weights(plan)  # (left so at teardown: never gathered whole)
        if plan.pp > 1 and not cut:
            self._steps.cut_on_eval = True
            return
        if plan.data.stage != 3 or plan.ep > 1 or plan.offload or self.mesh.data.size == 1:
            self._deferred.rest()
            return
        named = dict(self.lightning_module.named_parameters())
        groups = self._kept.groups if self._kept is not None and self._kept.groups else [
            [n for n, p in named.items() if p.requires_grad]]  # (as the fit's, whose slices are kept: its flats)
        grouping = torch.optim.SGD([{"params": [named[n] for n in group]} for group in groups], lr=0.0)
        self._flat_groups = groups
        for sync in assemble.gradient_syncs(self.model, [grouping], plan, self.mesh, self.options, self.techniques,
                                            fp16_scaler=False, deferred=self._deferred):
            self._adopt(sync)
        self._deferred = None
        self._gather_in_half()  # (under pp, after set-up's: the units made at the cut)

    def _prepare_first_batch_check(self, precision: str) -> None:
        """The whole model's structure kept, before any technique splits it (its weights: at the first batch)."""
        with self.mesh.stats.uncounted():
            self._first_batch = FirstBatchCheck.prepare(self.lightning_module, precision,
                                                        self.precision_plugin.train_step_context, self.mesh.world)

    @override
    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        self._shared_casts = self.options.share_casts and share_casts(self.precision_plugin)
        if self.options.param_dtype is not None and self._param_dtype is None:
            check_param_dtype(self.options, self.precision_plugin)
            self._param_dtype = ParamDtype(self.lightning_module, self.options.param_dtype)
            if self._first_batch is not None and self._first_batch.copy is not None:  # its reference, the same way
                ParamDtype(self._first_batch.copy, self.options.param_dtype)
        self._gather_in_half()

    def _gather_in_half(self) -> None:
        """Under a half param_dtype, ZeRO-3 gathers its units in it (FSDP2's way) and the policy computes with them."""
        for technique in self.techniques if self._param_dtype is not None else ():
            params = technique.compute_in(self._param_dtype.dtype)
            if params:
                self._param_dtype.gathered(params, technique.half_weight)

    def _make_steps(self, fitting: bool) -> DirectSteps:
        if self.resolved_plan.pp == 1:
            return DirectSteps(self._lightning_hook)
        # Cut on the first training batch, after tracing it (`assemble.traced_pipeline`); until then every rank
        # holds and runs the whole model. Evaluating alone a model built on meta: on the first batch evaluated.
        return PipelineSteps(self._lightning_hook, self.lightning_module, self.compute_device, self._no_sync, None,
                             self._build_pipeline, self.options.stop_on_nonfinite_loss)

    def _build_pipeline(self, batch: Any, batch_idx: int, *args: Any, step: str = "training_step") -> PipelineParallel:
        if self.resolved_plan.schedule is PipelineSchedule.AUTO:
            self.resolved_plan, self.schedule_choice = assemble.choose_schedule(
                self.lightning_module, batch, self.resolved_plan, self.mesh, self.root_device,
                self.lightning_module.trainer, self.techniques)
        assemble.check_split(self.resolved_plan, self.techniques)
        # a training batch's first microbatch; an evaluation's whole batch (its program does not split it)
        micro = split_microbatches(batch, self.resolved_plan.microbatches)[0] if step == "training_step" else batch

        if self._deferred is not None:  # the model is on meta: traced with shapes only
            micro = apply_to_collection(micro, Tensor, lambda t: t.to("meta"))

        on_shapes = self._deferred is not None

        def run_forward() -> None:  # set-up, not a step: what it logs is dropped, what it draws is given back
            # (a resumed run traces at its first step too: a draw here would shift its dropout masks)
            devices = [self.root_device] if self.root_device.type == "cuda" else []
            reads = StandInReads() if on_shapes else contextlib.nullcontext()  # loss.item() in the user's step
            with torch.no_grad(), deferred_logs(self.lightning_module), torch.random.fork_rng(devices=devices), \
                    self._tracing(), reads:
                try:
                    self._lightning_hook(step, micro, batch_idx, *args)
                except (RuntimeError, NotImplementedError) as error:
                    if on_shapes and "meta" in str(error):
                        raise RuntimeError(_TRACE_READ.format(error=error)) from error
                    raise

        pipeline = assemble.traced_pipeline(self.model, self.resolved_plan, self.mesh, self.options, run_forward,
                                            self._deferred)
        self._after_cut(pipeline, fitting=step == "training_step")
        return pipeline

    def _after_cut(self, pipeline: PipelineParallel, fitting: bool) -> None:
        """The stages cut: the data-parallel technique over what this rank's stage keeps (evaluating alone, what it
        keeps made: `_evaluate_in_slices`), then the weights and optimizer state given before the cut, read."""
        self._adopt(pipeline)
        if fitting:
            self._add_grad_sync()
        else:  # evaluating alone (`_evaluate_in_slices`): what the stage keeps is made now
            self._evaluate_in_slices(cut=True)
            self._deferred = None
        self._slices_at_cut = False
        self._load_slices()
        if self._pending_model is not None:  # weights given before the cut (`load_pretrained`): each stage its own
            self.load_model_state_dict(*self._pending_model)
            self._pending_model = None
        if self._pending_optimizer is not None:  # each stage (and ZeRO shard) now takes its part of it
            self._steps.pipeline = pipeline
            self.load_optimizer_state_dict(self._pending_optimizer)
            self._pending_optimizer = None

    def _tracing(self) -> contextlib.AbstractContextManager:
        """Around the pipeline's trace (a rehearsal counts no memory there: `lightning.rehearsal`)."""
        return contextlib.nullcontext()

    def _add_grad_sync(self) -> None:
        scaler = getattr(self.precision_plugin, "scaler", None) is not None
        for sync in assemble.gradient_syncs(self.model, self.optimizers, self.resolved_plan, self.mesh, self.options,
                                            self.techniques, fp16_scaler=scaler, deferred=self._deferred):
            self._adopt(sync)
        self._deferred = None  # everything is made
        self._gather_in_half()  # (under pp the policy came first)
        # Lightning clips by norm in the precision plugin, over the optimizer's params (here shards, slices or
        # one stage's): this instance's clip-by-norm takes the whole model's norm across the mesh instead.
        self.precision_plugin.clip_grad_by_norm = lambda optimizer, clip_val: self.clip_grad_norm(float(clip_val))

    @property
    def pipeline(self) -> PipelineParallel | None:
        """The pipeline technique once built (its last step's timeline and bubble), else None."""
        return self._steps.pipeline

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # Resumable mid-epoch: the loader's position and every rank's random state go into the checkpoint.
        trainer = self.lightning_module.trainer
        return resumable(dataloader, rank=self.global_rank, world_size=self.world_size,
                         gather=lambda obj: comm.all_gather_object(obj, self.mesh.world),
                         epoch_batches=lambda: trainer.num_training_batches)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        deferred.to_device(self.model, self.compute_device)  # what is on meta stays there, to be made by slice

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        # trainer.init_module(empty_init=True): parameters on meta, made by slice at set-up (`strategies.deferred`)
        with deferred.meta_parameters(), self.root_device, self.precision_plugin.tensor_init_context():
            yield

    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # Around configure_model(): its parameters are built on meta and made by slice at set-up.
        with deferred.meta_parameters():
            yield

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients, optimizer states (and offloaded host state) this rank holds."""
        assert self.lightning_module is not None
        extra: dict[str, list[Tensor]] = {}
        for technique in self.techniques:
            for category, tensors in technique.memory_tensors().items():
                extra.setdefault(category, []).extend(tensors)
        return model_state_bytes(self.lightning_module, self.optimizers, extra)

    # -- steps and gradients ----------------------------------------------------------------------------

    def _lightning_hook(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Lightning's own Strategy.<name> (training_step, validation_step...): the user's step."""
        return getattr(ParallelStrategy, name)(self, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._grads_stale:  # the last step's gradients, freed before this forward (`frees_grads_early`)
            self._grads_stale = False
            if self._free_grads_early is None:
                self._free_grads_early = frees_grads_early(self.lightning_module)
            for optimizer in self.optimizers if self._free_grads_early else ():
                optimizer.zero_grad(set_to_none=True)
        check, self._first_batch = self._first_batch, None
        if check is None:
            return self._training_step(*args, **kwargs)
        if check.active:  # the whole model's loss on this batch first, as one process, with the plan's weights now
            with self.mesh.stats.uncounted():
                state = self.full_state()  # every rank (the ranks agreed at set-up)
            with outside_all(self.techniques):
                plan = self.resolved_plan
                check.reference(state, args, plan.microbatches if plan.pp > 1 else 1)
            del state
        try:
            output = self._training_step(*args, **kwargs)
        except Exception as error:
            raise check.failed(error, str(self.resolved_plan)) from error
        with self.mesh.stats.uncounted():
            self.first_batch = check.compare(output, str(self.resolved_plan), self.mesh.world)
        return output

    def _training_step(self, *args: Any, **kwargs: Any) -> Any:
        # Measure what autograd keeps for backward (the activations) on every step: cheap, one hook per save.
        # Under pipeline parallel the backwards run inside too, so this is the peak held across the schedule.
        buffers = lambda: [b for technique in self.techniques for b in technique.parameter_buffers()]  # noqa: E731
        store = getattr(getattr(self._steps, "pipeline", None), "weights", None)  # a zero-bubble schedule's W stash
        casts = step_casts() if self._shared_casts else contextlib.nullcontext()
        with SavedTensorsMeter(self.lightning_module, buffers) as meter, casts:
            if store is not None:
                store.keeper = meter.keep
            output = self._steps.training_step(*self._local(args), **kwargs)
        self.activation_bytes = meter.bytes
        self.peak_activation_bytes = max(self.peak_activation_bytes, meter.bytes)
        for technique in self.techniques:
            output = technique.step_output(output)
        return output

    def _before_cut(self, args: tuple) -> None:
        """A meta-built model evaluated before the first training batch cuts the pipeline (the sanity check). In a
        fit the stages are cut at this batch (``args``: the step's, this rank's part) as the first training batch
        would cut them, the training step traced on its shapes, each stage making only its own. Where it cannot
        stand in for a training batch (it does not split into the plan's microbatches) the model is made whole,
        since every rank runs the whole model until the cut."""
        if self._deferred is None or self.resolved_plan.pp == 1 or self.pipeline is not None or \
                self._steps.cut_on_eval:
            return
        if self._fitting and len(args) > 1 and _splits(args[0], self.resolved_plan.microbatches):
            self._steps.pipeline = self._build_pipeline(*args[:2])  # (a training step takes no dataloader_idx)
            return
        rank_zero_info("the model built on meta is made whole to be evaluated before the pipeline is cut: this "
                       f"batch does not split into mb{self.resolved_plan.microbatches} (num_sanity_val_steps=0 keeps "
                       "each stage to its own layers)")
        self._deferred.rest()
        self._deferred = None
        self._slices_at_cut = False
        self._load_slices()
        if self._pending_model is not None:  # weights given for the cut (`load_pretrained`): taken whole now
            pending, self._pending_model = self._pending_model, None
            self.load_model_state_dict(*pending)

    def _local(self, args: tuple) -> tuple:
        """A step's arguments with this rank's part of the batch (the first)."""
        if not args:
            return args
        batch = args[0]
        for technique in self.techniques:
            batch = technique.local_batch(batch)
        return (batch, *args[1:])

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        args = self._local(args)
        self._before_cut(args)
        return self._steps.eval_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        args = self._local(args)
        self._before_cut(args)
        return self._steps.eval_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        args = self._local(args)
        self._before_cut(args)
        return self._steps.eval_step("predict_step", *args, **kwargs)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        # Before backward, automatic or manual (`manual_backward` comes here too): a NaN loss would make NaN
        # gradients, the all-reduce would spread them to every rank and the step would poison the parameters.
        # (Under pipeline parallel the schedule's own backward runs in training_step, which checks there.)
        if self.options.stop_on_nonfinite_loss:
            module = self.lightning_module
            step = module.trainer.global_step if module is not None else "?"
            if self.world_size == 1 and self.compute_device.type == "cuda":
                # Nothing to spread it to: the loss is read once the backward is queued, before the step (a read
                # here would stall the host until the forward is done, and the GPU while backward is launched).
                self._losses_to_check.add(closure_loss, self.global_rank, step)
            else:
                check_finite(closure_loss, self.global_rank, step)
        super().pre_backward(closure_loss)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        return self._steps.backward(closure_loss, lambda: super(PlanStrategy, self).backward(
            closure_loss, optimizer, *args, **kwargs), self.post_backward)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # Lightning calls this after every backward. Outside an accumulation window's micro-steps the techniques
        # complete the gradients here (the dp average, sequence parallel's partial sums), before clipping and the
        # optimizer step see them.
        for technique in reversed(self.techniques):
            technique.finish_backward(self.held_grads, sync=not self._accumulating)

    def _adopt(self, technique: Any) -> None:
        """Add a technique built during a step (under pp, the pipeline and the gradient sync are built by the first
        training batch). Inside an accumulation micro-step it joins the no_sync in force: built syncing, ZeRO would
        reduce (and drop) that micro-step's gradients before the window is complete."""
        self.techniques.append(technique)
        if self._open_no_sync is not None:
            self._open_no_sync.enter_context(technique.no_sync())

    @contextlib.contextmanager
    def _no_sync(self) -> Generator[None, None, None]:
        """Backwards inside accumulate locally: no technique communicates (nor one added meanwhile: `_adopt`)."""
        with contextlib.ExitStack() as stack:
            for technique in self.techniques:
                stack.enter_context(technique.no_sync())
            outer, self._open_no_sync = self._open_no_sync, stack
            try:
                yield
            finally:
                self._open_no_sync = outer

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this on gradient-accumulation micro-steps: no communication there.
        with self._no_sync():
            self._accumulating = True
            try:
                yield
            finally:
                self._accumulating = False

    def held_grads(self) -> list[HeldGrad]:
        """The gradient this rank holds, as the techniques leave it: each parameter's ``.grad`` (this stage's,
        possibly tp-sliced), or under ZeRO its shard of each flat cut at parameter boundaries."""
        module = self.lightning_module
        grads = [HeldGrad(name, p, p.grad) for name, p in module.named_parameters() if p.grad is not None]
        for technique in reversed(self.techniques):
            grads = technique.held_grads(grads)
        return grads

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip every rank's gradient by the whole model's norm (over tp slices, ZeRO shards and pipeline
        stages); returns that norm. Every rank must call it."""
        split = [axis for technique in self.techniques for axis in technique.split_axes()]
        disjoint = [axis for technique in self.techniques for axis in technique.disjoint_axes()]
        held = self.held_grads()
        return clip_pieces([(g.grad, g.split) for g in held if g.counted], max_norm, split=split, disjoint=disjoint,
                           norm_type=norm_type, device=self.compute_device,
                           copies=[g.grad for g in held if not g.counted])

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        def checked() -> Any:  # the losses read after the backward was queued, before clipping and the step
            out = closure()
            self._losses_to_check.check()
            return out

        output = super().optimizer_step(optimizer, checked, model, **kwargs)
        self._grads_stale = True
        self._steps.optimizer_stepped()
        for technique in self.techniques:
            technique.after_step()  # ZeRO: all-gather the updated shards, refresh offloaded ones
        if self._saver is not None and not self._saver.staged and self._by_slice():
            # the host copies an asynchronous save fills, made once the optimizer's state exists: the first save's
            # stall is then a copy, not the pages' first touch (1.8 s of 2.2 for 0.8 GB here)
            self._saver.stage_ahead(self._saved_by_slice(self.state_by_slice(optimizer=True)))
        return output

    # -- state: every technique undoes its own split, so any plan's state loads under any other ------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.save_stalls.start()  # (Lightning's dump of a checkpoint starts here: the stall of a save)
        refuse_left_in_slices(self.lightning_module)
        if self._by_slice():  # what this rank holds, as it lies (`save_checkpoint` writes it in DCP)
            return self.state_by_slice(optimizer=False)[MODEL]
        return self.full_state()

    def _by_slice(self) -> bool:
        """Whether checkpoints are written by slice, or gathered (`options.checkpoint_format`)."""
        return self.options.checkpoint_format == "dcp"

    def full_state(self, names: set[str] | None = None) -> dict[str, Any]:
        """The single-process state (every rank must call this), or its entries ``names`` only: each technique
        undoes its split of just that part (`save_pretrained` takes one block at a time)."""
        refuse_left_in_slices(self.lightning_module)
        state = {k: v.detach() for k, v in self.lightning_module.state_dict().items() if names is None or k in names}
        for technique in reversed(self.techniques):
            state = technique.full_model_state(state)
        return state

    def state_by_slice(self, optimizer: bool = True, load: bool = False, index: int | None = None) -> dict[str, Any]:
        """This rank's part of the single-process state as it lies, in DCP boxes placed in the whole tensors
        (`checkpoint.slices.rank_state`, each technique saying what it holds: ZeRO's shards, tp's slices, the
        pipeline stages' parameters), under Lightning's names (`dcp_dir`: ``state_dict``, and with ``optimizer``
        ``optimizer_<i>`` for each optimizer, or for optimizer ``index`` only: its state alike and its param groups by
        parameter name). Nothing is gathered. The buffers in the state dict: the copies in use (a pipeline stage's
        own), or to ``load``, every copy the rank has."""
        held = (lambda name: True) if load else (lambda name: all(t.holds_buffer(name) for t in self.techniques))
        flats = self._sliced_flats()
        raws = [(i, raw) for i, raw in enumerate(self._raw_optimizers() if optimizer else []) if index in (None, i)]
        states = [self._rank_state(flats, raw, held) for _, raw in raws] or [self._rank_state(flats, None, held)]
        return {MODEL: states[0]["model"], **{optimizer_key(i): s["optim"] for (i, _), s in zip(raws, states)}}

    def _rank_state(self, flats: list, raw: Any = None, buffers: Any = None) -> dict[str, Any]:
        """`rank_state` of the module: ``flats``' shards, each technique placing its boxes and saying what it holds;
        with ``raw``, that optimizer's state and its groups by name; ``buffers``: which buffers (`rank_state`)."""
        return rank_state(self.lightning_module, flats, self._place,
                          lambda name: all(t.holds(name) for t in self.techniques), raw,
                          self._named_groups(raw) if raw is not None else None, buffers)

    def _sliced_flats(self) -> list:
        return [flat for t in self.techniques for flat in t.sliced_flats()]

    def _raw_optimizers(self) -> list[Any]:
        """The optimizers as torch made them (not Lightning's wrappers)."""
        return [getattr(optimizer, "_optimizer", optimizer) for optimizer in self.optimizers]

    def _raw_optimizer(self, index: int = 0) -> Any:
        return self._raw_optimizers()[index]

    def _named_groups(self, raw: Any) -> list[list[str]]:
        """The optimizer's param groups by single-process name, alike on every rank (every stage's: pp keeps them)."""
        names = iter(optimizer_names(self.lightning_module, raw))
        groups = [[next(names) for _ in group["params"]] for group in raw.param_groups]
        for technique in self.techniques:
            groups = technique.named_groups(groups)
        return groups

    def _keep_slices(self) -> KeptSlices | None:
        """This rank's slices copied to host memory, before the techniques that hold them are undone (`teardown`);
        None where they cannot be taken up alike (expert parallel, offload, buffers under pp)."""
        if self.resolved_plan.offload or self.resolved_plan.ep > 1:
            return None
        try:
            boxes = self._held_boxes()
        except NotImplementedError:
            return None
        if any(data.device.type == "meta" for box in boxes.values() for _, _, data in box.pieces):
            return None  # (a rehearsal's: shapes, no values)
        groups = self._named_groups(self._raw_optimizer()) if self._fitting and self.optimizers else self._flat_groups
        return KeptSlices(str(self.resolved_plan), self.world_size, self.global_rank, keep_boxes(boxes), groups)

    def _held_boxes(self) -> dict[str, Any]:
        """The weights this rank holds, as boxes (`rank_state`): ZeRO-3's shards, tp's slices, a stage's own. ZeRO-1
        and 2 keep the weights whole, in flats that evaluating alone does not build: taken as the parameters."""
        return self._rank_state(self._sliced_flats() if self.resolved_plan.data.stage == 3 else [])["model"]

    def _place(self, name: str, box: Any) -> Any:
        for technique in self.techniques:
            box = technique.place_box(name, box)
        return box

    def load_state_by_slice(self, path: str, optimizer: bool = True, strict: bool = True, model: bool = True,
                            index: int = 0) -> None:
        """Fill this rank's part of the state (`state_by_slice`) from the DCP checkpoint at ``path``, saved under
        any plan and world size (the pack's, Lightning's ModelParallelStrategy's; torchtitan's and FSDP2's by their
        own keys, `checkpoint.layout`), each rank reading only what overlaps its boxes; then each technique remakes
        what it derives from them (ZeRO's full parameters). With ``optimizer``, its state is made first where no step
        has made it yet, and its hyperparameters read (optimizer ``index``'s); ``model=False``: the optimizer's part
        only (Lightning loads the two apart)."""
        path, key = os.fspath(path), optimizer_key(index)
        metadata = read_metadata(path)
        saved, layout = set(metadata.state_dict_metadata), self._layout(metadata, key)
        if optimizer and not layout.optimizer:
            raise CheckpointError(f"{path} holds weights and no optimizer state: read it with optimizer=False")
        raw, stated = self._raw_optimizer(index) if optimizer else None, layout.stated(saved)
        if raw is not None and stated:
            make_optimizer_state(raw)
            self._drop_unsaved_state(raw, stated)
        state = self.state_by_slice(optimizer, load=True, index=index)
        if not model:
            del state[MODEL]
        if raw is not None:
            groups = state[key].pop("param_groups")
            if not stated:
                state[key].pop("state")  # saved before a first step: the optimizer starts as it is
            count = layout.group_count(saved)
            if count is not None and count != len(raw.param_groups):
                raise ValueError(f"the checkpoint's optimizer has {count} param groups, this one "
                                 f"{len(raw.param_groups)}: it was saved from a different configure_optimizers")
            state[key]["param_groups"] = layout.groups(groups, saved)
        theirs = layout.saved(state)
        load_into(theirs, path, strict, metadata)
        for technique in self.techniques if model else ():
            technique.after_slice_load()
        if raw is not None:
            read = layout.read_groups(theirs[layout.optimizer]["param_groups"], groups)
            self._read_groups(raw, read, [[layout.name(n) for n in group["params"]] for group in groups])

    def _layout(self, metadata: Any, key: str) -> Layout:
        """The checkpoint's `Layout` (in Lightning's, its optimizer ``key``'s); outside Lightning's, the
        LightningModule's name for the model its names are under (``model.``) found where one prefix fits every
        saved weight."""
        layout = layout_of(metadata)
        if layout.lightnings:
            return replace(layout, optimizer=key)
        return replace(layout, prefix=model_prefix(set(layout.weights(metadata)), self.lightning_module.state_dict()))

    @staticmethod
    def _read_groups(optimizer: Any, read: list[dict[str, Any]], ours: list[list[str]]) -> None:
        """The hyperparameters a checkpoint's param groups hold (a scheduler's learning rate...) set on
        ``optimizer``'s, after checking that each holds the parameters ``ours`` names (alike on every rank)."""
        for i, (group, got) in enumerate(zip(optimizer.param_groups, read)):
            if "params" in got and sorted(got["params"]) != sorted(ours[i]):
                raise ValueError(f"the checkpoint's optimizer param group {i} holds other parameters than this one's "
                                 "(a different configure_optimizers)")
            group.update({k: v for k, v in got.items() if k != "params"})

    def _drop_unsaved_state(self, optimizer: Any, have: set[str]) -> None:
        """The state `make_optimizer_state` made for a parameter the checkpoint holds none for (``have``: the names
        it holds state for; one no step ever reached, unused) taken back: AdamW would count a step it never took."""
        names = {id(p): [n] for n, p in self.lightning_module.named_parameters()}
        names.update({id(flat.master): list(flat.names) for flat in self._sliced_flats()})
        for p in [p for group in optimizer.param_groups for p in group["params"]]:
            if not any(n in have for n in names.get(id(p), [])):
                optimizer.state.pop(p, None)

    def _take_up_kept(self) -> None:
        """The slices a fit left (`deferred.KeptSlices`) put back into this set-up's, which the same plan and ranks
        made alike (their boxes agreed by every rank); then each technique remakes what it derives from them, as
        after a load."""
        missing = fill_boxes(self._held_boxes(), self._kept.boxes)
        anywhere = [names for names in comm.all_gather_object(missing[:4], self.mesh.world) if names]
        if anywhere:  # (every rank raises: under pp the others would wait in the first step's messages)
            raise RuntimeError(f"the slices fit left do not fit this set-up's ({', '.join(anywhere[0])}): another "
                               "optimizer's param groups or pipeline schedule; pass ckpt_path=... instead")
        self._kept = None  # (else teardown puts them back on the module, for the next set-up)
        for technique in self.techniques:
            technique.after_slice_load()

    def _load_slices(self) -> None:
        """The DCP checkpoint Lightning gave (`load_model_state_dict`), read into this rank's slices once they exist:
        at the end of set-up, or under pp with a model built on meta once the first batch cut it."""
        if self._slices_at_cut:
            return
        if self._kept is not None:
            self._take_up_kept()
        if self._slice_load is None:
            return
        (given, strict), self._slice_load = self._slice_load, None
        self.load_state_by_slice(given.path, optimizer=False, strict=strict)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        # Lightning restores weights before setup (a full module, split afterwards); this path is for loads after
        # setup, where tensor-parallel layers hold slices, ZeRO's parameters live in flats, and other stages'
        # parameters are placeholders. A technique that loads its own entries has checked them.
        if isinstance(checkpoint.get("state_dict"), SliceLoad):  # a DCP directory: read by slice once they exist
            if strict:
                refill_left_in_slices(self.lightning_module)
            self._slice_load = (checkpoint["state_dict"], strict)
            return self._load_slices() if self.techniques else None
        if self._deferred is not None and self.resolved_plan.pp > 1 and self.pipeline is None:
            self._pending_model = (checkpoint, strict)  # loaded once the first batch cut the stages and made them
            return None
        state = checkpoint["state_dict"]
        if strict:
            refill_left_in_slices(self.lightning_module)
        refuse_left_in_slices(self.lightning_module)
        if not self.techniques and has_meta_parameters(self.lightning_module):
            # Lightning restores a checkpoint before set-up: a model built on meta is made whole to take it
            Deferred(self.lightning_module, self.compute_device).rest()
        for technique in self.techniques:
            state = technique.local_model_state(state, strict)
        # Weights read lazily (`load_pretrained`) that no technique cut: read whole now
        state = {k: v.read_all() if hasattr(v, "read_all") else v for k, v in state.items()}
        lenient = any(technique.loads_own_entries for technique in self.techniques)
        return self.lightning_module.load_state_dict(state, strict=strict and not lenient)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if self._by_slice():
            index = next(i for i, raw in enumerate(self._raw_optimizers()) if raw is optimizer)
            return self.state_by_slice(optimizer=True, index=index)[optimizer_key(index)]
        state = OptimizerState.of(self.lightning_module, optimizer)
        for technique in reversed(self.techniques):
            state = technique.full_optimizer_state(optimizer, state)
        return state.state_dict()

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if self.resolved_plan is not None and self.resolved_plan.pp > 1 and self.pipeline is None:
            self._pending_optimizer = checkpoint  # resumed before the first batch cuts the pipeline: load then
            return
        if any(isinstance(saved, SliceLoad) for saved in checkpoint["optimizer_states"]):
            if len(self.optimizers) != len(checkpoint["optimizer_states"]):
                raise ValueError(f"the checkpoint holds {len(checkpoint['optimizer_states'])} optimizers' state, this "
                                 f"module has {len(self.optimizers)}: saved from a different configure_optimizers")
            for index, saved in enumerate(checkpoint["optimizer_states"]):
                self.load_state_by_slice(saved.path, optimizer=True, model=False, index=index)
            return None
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            if len(saved["param_groups"]) != len(optimizer.param_groups):
                raise ValueError(f"the checkpoint's optimizer has {len(saved['param_groups'])} param groups, this "
                                 f"one {len(optimizer.param_groups)}: it was saved from a different "
                                 "configure_optimizers")
            names = optimizer_names(self.lightning_module, optimizer)
            for technique in self.techniques:
                names = technique.optimizer_names(names)
            state: OptimizerState | None = OptimizerState.from_state_dict(saved, names)
            for technique in self.techniques:
                state = technique.local_optimizer_state(optimizer, state) if state is not None else None
            if state is not None:  # no technique loaded it itself
                optimizer.load_state_dict(state.state_dict())

    # -- checkpoint files: every rank writes its part (strategies.checkpoint) --------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("PlanStrategy's sharded checkpoints take no storage_options")
        world, info = self.mesh.world, {"plan": str(self.resolved_plan), "pack_version": pack_version()}
        if self._by_slice():  # (alike on every rank, as what the dump above holds)
            state = {MODEL: checkpoint.pop("state_dict")}
            state = self._saved_by_slice({**state, **{optimizer_key(i): s for i, s in
                                                      enumerate(checkpoint.pop("optimizer_states", []))}})
            rest = {**checkpoint, "stratpack": info}
            if self._saver is not None:
                return self._saver.save_by_slice(state, rest, filepath, rank=self.global_rank)
            return save_dcp(state, rest, filepath, rank=self.global_rank, barrier=lambda: comm.barrier(world),
                            broadcast=lambda obj: comm.broadcast_object(obj, world, src=0))
        if self._saver is not None:  # training goes on while a thread writes (`checkpoint.async_save`)
            return self._saver.save(checkpoint, filepath, rank=self.global_rank, world_size=self.world_size, info=info)
        save_sharded(checkpoint, filepath, rank=self.global_rank, world_size=self.world_size,
                     broadcast=lambda obj: comm.broadcast_object(obj, world, src=0),
                     gather=lambda obj: comm.all_gather_object(obj, world), barrier=lambda: comm.barrier(world),
                     info=info)

    def _saved_by_slice(self, state: dict[str, Any]) -> dict[str, Any]:
        """What this rank writes of ``state`` (`state_by_slice`'s): each box several ranks hold alike written (and,
        asynchronously, copied) by one of them (`slices.share_replicas`, a collective)."""
        return share_replicas(state, self.global_rank, lambda obj: comm.all_gather_object(obj, self.mesh.world))

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        remove = super().remove_checkpoint
        if self._saver is None:
            return remove(filepath)
        # An older checkpoint stays until the save in flight is whole: until then it may be the newest whole one
        return self._saver.after_save(lambda: remove(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self._saver is not None:
            self._saver.wait()  # (the checkpoint may be the one in flight)
        if is_dcp(checkpoint_path):  # (Lightning's ModelParallelStrategy's too): its tensors read by slice later
            rest = load_rest(checkpoint_path, weights_only)
            return self._foreign(rest, os.fspath(checkpoint_path)) if FOREIGN in rest else rest
        # A sharded directory from any plan and world size, or a single-file checkpoint (single process, ddp).
        return load_any(checkpoint_path, weights_only=weights_only)

    def _foreign(self, rest: dict[str, Any], path: str) -> dict[str, Any]:
        """A DCP checkpoint that Lightning did not write (torchtitan's ``step-N``, a ``dcp.save`` of FSDP2's
        ``get_model_state_dict`` and ``get_optimizer_state_dict``) as Lightning's restore takes it: its weights and
        optimizer's state read by slice, by its own keys (`checkpoint.layout`); no loop state to read, so the loops,
        the learning-rate schedulers and the loader start afresh."""
        import lightning

        fitting = self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting and "optimizer_states" not in rest:
            raise CheckpointError(f"{path} holds a model's weights and no optimizer state, so a fit cannot resume from "
                                  "it: start one from its weights with strategies.load_pretrained(self, path) in "
                                  "on_fit_start (or pass it to trainer.test/validate/predict)")
        layout: Layout = rest.pop(FOREIGN)
        rank_zero_info(f"{path} is not a Lightning checkpoint (its weights under {layout.model or 'the top'!r}"
                       f"{f', the optimizer under {layout.optimizer!r}' if layout.optimizer else ''}): they are "
                       "read by slice; the loops, learning-rate schedulers and loader start afresh")
        return {**rest, "pytorch-lightning_version": lightning.__version__, "lr_schedulers": []}

    # -- Lightning's own collectives, through comm.py on the world axis -------------------------------------

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        if self.mesh is not None:
            comm.barrier(self.mesh.world)
        elif dist.is_available() and dist.is_initialized():
            dist.barrier()
        if name == "Trainer.save_checkpoint":  # Lightning's, right after the save: training goes on from here
            self.save_stalls.end()

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
        # On this rank's device: a caller's CPU tensor (a metric built with torch.tensor) cannot go over nccl.
        mine = tensor.detach().to(self.root_device).contiguous()
        out = torch.empty((self.world_size, *tensor.shape), dtype=tensor.dtype, device=self.root_device)
        comm.all_gather(out.view(-1), mine.view(-1), self.mesh.world)
        return out

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if not isinstance(tensor, Tensor) or self.mesh is None:
            return tensor
        if self._steps.in_schedule:  # only the last stage's ranks get here: a world all-reduce would hang
            raise RuntimeError(
                "under pipeline parallel, training_step runs on the last stage's ranks only, so "
                "self.log(..., sync_dist=True) inside it cannot reduce over every rank. Log with sync_dist=False "
                "(the loss training_step returns is already the same on every rank), or log in "
                "validation_step, which runs on every rank."
            )
        mean = reduce_op is None or (isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg"))
        if not mean and reduce_op not in (ReduceOp.SUM, "sum"):
            raise ValueError(f"reduce supports 'mean' and 'sum', got {reduce_op!r}")
        # A copy (Lightning's callers may still use the tensor they passed), on this rank's device: a CPU tensor
        # cannot go over nccl.
        out = tensor.detach().to(self.root_device, copy=True)
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
        healthy = self._failed is None and self.lightning_module is not None
        if healthy and self._saver is not None:
            self._saver.wait()  # the last save written before the fit returns (after a failure: left torn)
        # Built on meta and fit: nothing gathered (the whole model need not fit one rank); the module holds none,
        # and this rank's slices are kept in host memory for the next set-up under this plan (`KeptSlices`)
        whole = not self._sliced
        kept = self._kept or (self._keep_slices() if healthy and not whole else None)  # (not taken up: put back)
        for technique in reversed(self.techniques):
            technique.teardown(healthy and whole)
            if healthy and not whole:
                technique.leave_in_slices()
        comm.set_ordered_sums(False)
        unshare_casts(self.precision_plugin)
        if self._param_dtype is not None:
            self._param_dtype.remove()
            self._param_dtype = None
        self._first_batch = None
        self.techniques = []
        self._steps = DirectSteps(self._lightning_hook)
        module = self.lightning_module
        with deferred.meta_safe_cpu(module):  # (a failure can leave a model built on meta unmade: no data to move)
            super().teardown()  # (moves the module to the CPU: before its weights go to meta)
        if (healthy and not whole) or self._kept is not None:
            leave_in_slices(module, self.plan, kept)
        self._kept = None
        if healthy:  # the fit's own groups, not left to the interpreter's exit (the next fit builds its own)
            if self.mesh is not None:
                self.mesh.release()
            if self._saver is not None:
                comm.leave_groups([self._saver.axis.group])
                self._saver = None


def _splits(batch: Any, microbatches: int) -> bool:
    """Whether ``batch`` splits into ``microbatches`` equal microbatches (a training batch's first is traced)."""
    try:
        split_microbatches(batch, microbatches)
    except (TypeError, ValueError):
        return False
    return True
