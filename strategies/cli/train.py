"""``stratpack train``: fit a workload (the demo GPT by default) once with one strategy, and return what the
StrategyMonitor measured.

Every strategy sees the same global batches: Lightning's DistributedSampler shuffles with the global seed and gives
rank r the positions r, r+N, ... of one permutation, so a step's union over the data-parallel ranks is a contiguous
slice of it. The single-device run draws that permutation itself (``DistributedSampler`` with one replica), so its
batch k is the same set of samples.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from dataclasses import asdict, dataclass, fields, is_dataclass, replace
from typing import Any

NO_MKL_CACHE = "MKL_DISABLE_FAST_MM"
# torch's own c10d flight recorder (gloo too) keeps its last calls, 0.5-2 KB each, in a ring of 2,000 by default: its
# first 2,000 collectives grow the heap by megabytes, step after step (measured), then it stays. `--heap` measures the
# steady state, so it runs without it (the pack's own recorder, `comm.recorder`, keeps 12 calls).
HEAP_ENV = {NO_MKL_CACHE: "1", "TORCH_FR_BUFFER_SIZE": "0"}
SINGLE = "single"  # one process, Lightning's default single-device strategy: the reference
HF_WORKLOAD = "hf-config"  # the workload of `--hf-config` (demos.sizes.HF_CONFIG)


PARAM_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # --param-dtype -> torch's name


@dataclass(frozen=True)
class RunConfig:
    strategy: str = "dp"
    devices: int = 2  # processes per node
    num_nodes: int = 1  # nodes (each runs `devices` processes: torchrun --nnodes, SLURM)
    steps: int = 30
    batch_size: int = 16  # global: split over the data-parallel ranks
    accumulate: int = 1
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    experts: int = 0  # the demo GPT's MLPs as a mixture of this many experts (0: dense)
    top_k: int = 2  # ... each token sent to this many of them
    data: str | None = None
    max_chars: int = 200_000
    seed: int = 0
    precision: str = "32-true"
    param_dtype: str | None = None  # bf16 / fp16: a plan computes with half copies of every weight (`ParamDtype`)
    warmup_steps: int = 3
    gradient_clip_val: float | None = None
    optimizer: str = "adamw"
    lr: float = 3e-3
    epoch_steps: int | None = None  # optimizer steps per epoch (default: the whole dataset)
    checkpoint_dir: str | None = None  # save a checkpoint there at the end of every epoch
    checkpoint_every: int | None = None  # ... or every this many optimizer steps (mid-epoch too)
    async_save: bool = False  # a plan's checkpoints written by a background thread (`checkpoint.async_save`)
    checkpoint_format: str = "dcp"  # a plan's: by slice in DCP, or "gathered" (`PlanOptions.checkpoint_format`)
    resume: str | None = None  # a checkpoint to resume from (sharded directory or single file)
    runs_dir: str | None = None  # the run store (default $STRATPACK_RUNS or ./runs)
    comparison: str | None = None  # the id shared by the runs of one `stratpack compare`
    wandb: str = "auto"  # auto (offline unless logged in; off without wandb), offline, online, off
    accelerator: str = "cpu"  # "gpu" / "auto" on a machine with GPUs (nccl)
    workload: str = "gpt"  # what to train (`workload.find_workload`)
    hf_config: str | None = None  # a Hugging Face config.json (file or folder): the ``hf-config`` workload's model
    compile: str | None = None  # torch.compile each block with this backend (inductor, aot_eager); None: eager
    heap: bool = False  # sample the C heap through the run (CPU): memory_bytes["heap_peak"] (slows the run)
    check_first_batch: bool = True  # a plan's first loss against the whole model's (`lightning.first_batch`)
    configure_model: bool = False  # the model built in configure_model: on meta, each rank making its slice
    vocab: int | None = None  # a sized workload's vocabulary (`gpt-shape`); the demo's is its corpus's characters
    profile: str | None = None  # trace two steps before the timed ones with torch's profiler, into this folder
    label: str | None = None  # the run's name in the run store (default: the strategy)


def data_parallel_degree(strategy: str, devices: int) -> int:
    """How many ranks split the global batch: the plan's dp degree, or all devices for other strategies."""
    if strategy == SINGLE:
        return 1
    from strategies.lightning.names import looks_like_plan
    from strategies.plan import ParallelPlan

    if looks_like_plan(strategy):
        return ParallelPlan.parse(strategy).resolve(devices).dp
    return devices


def run(config: RunConfig, params_out: str | None = None) -> dict[str, Any]:
    """Fit the workload for ``config.steps`` optimizer steps; the monitor's summary plus the config.

    ``params_out``: rank 0 also saves the final parameters there (``torch.save`` of the state dict)."""
    import lightning as L

    import strategies  # noqa: F401  (registers the plan names)
    from strategies.cli.workload import find_workload
    from strategies.measure.predict import predict_run

    _check_saving(config)  # (before anything starts)
    L.seed_everything(config.seed, workers=True, verbose=False)
    module, dataset = find_workload(config.workload).lightning(config)
    if config.compile and not _is_plan(config.strategy):  # a plan compiles the blocks itself, after its techniques
        from strategies.compile import compile_blocks

        compile_blocks(module, {"backend": config.compile})
    dataset = _check_batches(config, dataset)
    model = _model_config(module, config.seq_len)
    predicted = predict_run(config.strategy, _world(config), model, config.batch_size, config.accumulate,
                            estimator_precision(config), config.accelerator, optimizer=config.optimizer,
                            deferred=config.configure_model and _is_plan(config.strategy))
    trainer, monitor, final = _trainer(config, predicted, params_out)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(module, _loader(config, dataset), _validation(config, dataset), ckpt_path=_ckpt_path(config))
    _finish_wandb(trainer)
    result = {"config": asdict(config), "label": config.strategy, "rank": trainer.global_rank, **monitor.summary}
    mesh = getattr(trainer.strategy, "mesh", None)
    result["node_of_rank"] = list(mesh.nodes) if mesh is not None else [0]
    result["model"] = model  # the shape the estimator needs (strategies.measure.estimate)
    result["predicted"] = predicted  # what the estimator expected of this run (also in its meta.json)
    # What this rank's loggers saw last (rank 0 writes the logs): e.g. train_loss of the last step.
    result["logged"] = {k: float(v) for k, v in trainer.callback_metrics.items()
                        if getattr(v, "numel", lambda: 1)() == 1}
    from torch._dynamo.utils import counters  # (imported by Lightning already)
    result["compiled_graphs"] = int(counters["stats"]["unique_graphs"])  # by torch.compile on this rank
    result.update(first_batch_check=_first_batch(trainer), **final.result)
    _goodbye()
    return result


def _check_saving(config: RunConfig) -> None:
    if config.async_save and not (config.checkpoint_dir and _is_plan(config.strategy)):
        raise ValueError("--async-save writes a plan's sharded checkpoints in the background: give --checkpoint-dir "
                         f"and a plan ({config.strategy!r} is not one)" if config.checkpoint_dir else
                         "--async-save needs --checkpoint-dir (where the checkpoints go)")


def _first_batch(trainer: Any) -> dict[str, Any] | None:
    """What the first-batch check found (both losses and the tolerance, or why it was skipped); None without it."""
    outcome = getattr(trainer.strategy, "first_batch", None)
    return asdict(outcome) if outcome is not None else None


def _world(config: RunConfig) -> int:
    """The run's ranks: every node's processes (one for the single-device reference)."""
    return 1 if config.strategy == SINGLE else config.devices * config.num_nodes


def _is_plan(strategy: str) -> bool:
    from strategies.lightning.names import looks_like_plan

    return strategy != SINGLE and looks_like_plan(strategy)


def _ckpt_path(config: RunConfig) -> str | None:
    """What the fit resumes from: ``--resume``'s checkpoint; with ``--resume auto`` a plan's strategy finds the newest
    complete one itself (`lightning.auto_resume`), and one process is given it here."""
    if config.resume != "auto":
        return config.resume
    if not config.checkpoint_dir:
        raise ValueError("--resume auto resumes from the newest complete checkpoint of --checkpoint-dir: give one")
    if _is_plan(config.strategy):
        return None
    from strategies.lightning.auto_resume import resume_path

    return resume_path(config.checkpoint_dir)


def _strategy(config: RunConfig) -> Any:
    """The Trainer's strategy: a plan's (the class its name registers) with the run's options, the first-batch check
    and compile; Lightning's own strategies by name."""
    if not _is_plan(config.strategy):
        return config.strategy
    import dataclasses

    from lightning.pytorch.strategies import StrategyRegistry

    strategy = StrategyRegistry.get(config.strategy)
    # --heap measures memory: the check's copy of the model would sit in its set-up figure.
    options: dict[str, Any] = {"check_first_batch": config.check_first_batch and not config.heap,
                               "resume": "auto" if config.resume == "auto" else None,
                               "async_save": config.async_save, "checkpoint_format": config.checkpoint_format,
                               "param_dtype": param_dtype(config)}
    if config.compile:
        options["compile"] = {"backend": config.compile}
    strategy.options = dataclasses.replace(strategy.options, **options)
    return strategy


def param_dtype(config: RunConfig) -> Any:
    """``--param-dtype`` as torch's dtype (None: autocast's casts alone)."""
    import torch

    return getattr(torch, PARAM_DTYPES[config.param_dtype]) if config.param_dtype else None


def estimator_precision(config: RunConfig) -> str:
    """The run's precision as the estimator reads it, with ``--param-dtype`` (`estimate.with_param_dtype`)."""
    from strategies.measure.estimate import with_param_dtype

    return with_param_dtype(config.precision, config.param_dtype is not None)


def _model_config(module: Any, seq_len: int | None = None) -> dict[str, Any]:
    """The module's config as a dict (a dataclass ``config`` attribute, as the demo GPT has; a Hugging Face config's
    ``to_dict``, which names its ``model_type``), else empty; with the run's ``seq_len`` where it has none (a Hugging
    Face config gives only the longest, which the estimator would otherwise take)."""
    config = getattr(module, "config", None)
    if callable(getattr(config, "to_dict", None)):  # (before asdict: transformers' configs are dataclasses too)
        out = config.to_dict()
    elif is_dataclass(config):
        out = asdict(config)
    else:
        out = dict(vars(config)) if config is not None else {}
    return {**out, "seq_len": seq_len} if out and seq_len and "seq_len" not in out else out


def _check_batches(config: RunConfig, dataset: Any) -> Any:
    """``dataset``, cut to whole epochs of ``config.epoch_steps``; a clear error for a batch that does not split."""
    from torch.utils.data import Subset

    replicas = data_parallel_degree(config.strategy, _world(config))
    if config.batch_size % replicas:
        raise ValueError(f"global batch {config.batch_size} does not split over {replicas} data-parallel ranks")
    if config.epoch_steps and config.steps % config.epoch_steps:
        raise ValueError(f"steps ({config.steps}) must be a whole number of epochs of epoch_steps "
                         f"({config.epoch_steps})")
    if config.epoch_steps:
        # An epoch of exactly epoch_steps optimizer steps: a dataset of that many global batches (rather than
        # limit_train_batches, which a resumed run does not honour for the epoch it resumes in).
        dataset = Subset(dataset, range(config.epoch_steps * config.batch_size * config.accumulate))
    return dataset


def _loader(config: RunConfig, dataset: Any) -> Any:
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = None
    if config.strategy == SINGLE:
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=config.seed)
    per_rank = config.batch_size // data_parallel_degree(config.strategy, _world(config))
    loader = DataLoader(dataset, batch_size=per_rank, sampler=sampler, drop_last=True)
    if config.strategy == SINGLE:  # a plan's strategy makes it resumable mid-epoch itself; Lightning's does not
        from strategies.lightning.resume import resumable

        loader = resumable(loader)
    return loader


def _validation(config: RunConfig, dataset: Any) -> Any:
    """With checkpoints, a one-batch validation after each epoch (the checkpoint is saved after it), as in a real
    run; else none."""
    from torch.utils.data import DataLoader, Subset

    if not config.checkpoint_dir:
        return None
    per_rank = config.batch_size // data_parallel_degree(config.strategy, _world(config))
    return DataLoader(Subset(dataset, range(config.batch_size)), batch_size=per_rank)


def _trainer(config: RunConfig, predicted: dict | None, params_out: str | None = None) -> tuple[Any, Any, Any]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from strategies.checkpoint import ShardedCheckpointIO
    from strategies.measure.monitor import StrategyMonitor

    single = config.strategy == SINGLE
    monitor = StrategyMonitor(warmup_steps=config.warmup_steps, runs_dir=config.runs_dir,
                              comparison=config.comparison, label=config.label or config.strategy,
                              meta={"seed": config.seed, "run_config": asdict(config), "predicted": predicted},
                              heap=config.heap)
    final = _final_parameters(params_out)
    callbacks: list = [monitor, final]
    if config.profile:
        from strategies.measure.profile import ProfileSteps

        # the last two untimed steps but one: the trace's export (seconds) falls in the step before the timing
        callbacks.append(ProfileSteps(config.profile, first=max(0, config.warmup_steps - 3), count=2))
    if config.checkpoint_dir:
        every = {"every_n_train_steps": config.checkpoint_every} if config.checkpoint_every else {"every_n_epochs": 1}
        callbacks.append(ModelCheckpoint(dirpath=config.checkpoint_dir, save_top_k=-1, **every))
    trainer = L.Trainer(
        accelerator=config.accelerator, devices=1 if single else config.devices,
        num_nodes=1 if single else config.num_nodes,
        strategy="auto" if single else _strategy(config),
        # With epochs of a known length, the run is counted in epochs: Lightning 2.6 resumes an epoch-end checkpoint
        # of a max_steps run as an unfinished epoch (one batch too many), not of a max_epochs run.
        max_steps=-1 if config.epoch_steps else config.steps,
        max_epochs=config.steps // config.epoch_steps if config.epoch_steps else None,
        accumulate_grad_batches=config.accumulate, precision=config.precision,
        gradient_clip_val=config.gradient_clip_val, logger=_wandb_logger(config) or False,
        enable_checkpointing=bool(config.checkpoint_dir), enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, limit_val_batches=1 if config.checkpoint_dir else 0,
        # One process reads the pack's sharded checkpoints too (a plan's strategy reads them itself).
        plugins=[ShardedCheckpointIO()] if single else None,
    )
    return trainer, monitor, final


def _final_parameters(params_out: str | None) -> Any:
    """A callback that, as fit ends (while the plan still holds the model: one built on meta is left in slices),
    counts the parameters and takes their norm in the single-device view one block at a time (a collective, every
    rank), rank 0 saving them to ``params_out``; its ``result`` then holds the count and the norm."""
    import lightning as L
    import torch

    from strategies.lightning.pretrained import full_state_blocks

    class FinalParameters(L.Callback):
        result: dict[str, Any] = {}

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            count, squares, kept = 0, 0.0, {}
            for block in full_state_blocks(pl_module):
                count += sum(v.numel() for v in block.values())
                squares += sum(float(v.detach().double().square().sum()) for v in block.values())
                if params_out and trainer.global_rank == 0:
                    kept.update({k: v.detach().cpu() for k, v in block.items()})
            if kept:
                torch.save(kept, params_out)
            self.result = {"num_params": count, "final_param_norm": squares**0.5}

    return FinalParameters()


def _goodbye() -> None:
    """A script that is done with its ranks says so, all ranks together (rank 0 hosts the store)."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _wandb_logger(config: RunConfig) -> Any:
    """A WandbLogger grouped by comparison: offline unless the user is logged in or asks for online; None when
    wandb is off or not installed (training never depends on it)."""
    if config.wandb == "off":
        return None
    try:
        import wandb  # noqa: F401
        from lightning.pytorch.loggers import WandbLogger
    except ImportError:
        if config.wandb != "auto":
            warnings.warn(f"wandb={config.wandb!r} asked for, but wandb is not installed: not logging to wandb")
        return None
    mode = os.environ.get("WANDB_MODE")
    if config.wandb in ("offline", "online"):
        mode = config.wandb
    elif mode is None:
        mode = "online" if _wandb_logged_in() else "offline"
    from strategies.runs import runs_dir

    save_dir = runs_dir(config.runs_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    return WandbLogger(project="stratpack", group=config.comparison, name=config.strategy, save_dir=str(save_dir),
                       offline=mode != "online", config=asdict(config))


def _finish_wandb(trainer: Any) -> None:
    from lightning.pytorch.loggers import WandbLogger

    if isinstance(trainer.logger, WandbLogger) and trainer.global_rank == 0:
        import wandb

        wandb.finish()  # flush the run to disk now: the CLI ends its processes with os._exit


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = os.path.expanduser("~/.netrc")
    return os.path.exists(netrc) and "api.wandb.ai" in open(netrc).read()


def write_result(result: dict[str, Any], path: str) -> None:
    """Write atomically (temp file + replace), from rank 0 only."""
    if result.get("rank", 0) != 0:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, allow_nan=True)
    os.replace(tmp, path)


# -- the command line ---------------------------------------------------------------------------------------


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The options of one run, shared by `train` and `compare`."""
    defaults = RunConfig()
    p.add_argument("--devices", type=int, default=defaults.devices, help="processes per node (CPU: gloo ranks)")
    p.add_argument("--num-nodes", type=int, default=defaults.num_nodes, help="nodes (torchrun --nnodes, SLURM)")
    p.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="global batch (samples)")
    p.add_argument("--accumulate", type=int, default=defaults.accumulate, help="gradient accumulation steps")
    for name in ("seq_len", "n_layer", "n_head", "n_embd", "max_chars", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    p.add_argument("--experts", type=int, default=defaults.experts,
                   help="the demo GPT's MLPs as a mixture of N experts (for ep<N>); 0: dense")
    p.add_argument("--top-k", type=int, default=defaults.top_k, help="experts each token is sent to")
    p.add_argument("--data", default=None, help="a text file to train on (default: Python stdlib sources)")
    _precision_options(p, defaults)
    p.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps, help="steps left out of timing")
    p.add_argument("--gradient-clip-val", type=float, default=None, help="clip by the global gradient norm")
    p.add_argument("--optimizer", choices=("adamw", "sgd", "sgd-plain"), default=defaults.optimizer)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--epoch-steps", type=int, default=None, help="optimizer steps per epoch (default: all data)")
    _checkpoint_options(p)
    p.add_argument("--accelerator", default=defaults.accelerator, help="cpu (gloo), or gpu / auto (nccl)")
    p.add_argument("--runs-dir", default=None, help="the run store (default $STRATPACK_RUNS or ./runs)")
    p.add_argument("--comparison", default=None, help="an id shared by the runs of one comparison")
    p.add_argument("--wandb", choices=("auto", "offline", "online", "off"), default=defaults.wandb,
                   help="auto: offline unless logged in (off when wandb is not installed)")
    p.add_argument("--compile", default=None, metavar="BACKEND",
                   help="torch.compile each block with this backend (inductor; aot_eager compiles fast, for tests)")
    p.add_argument("--configure-model", action="store_true",
                   help="build the model in configure_model: under the pack's plans on the meta device, each rank "
                        "making only the slice it keeps (docs/larger-models.md)")
    p.add_argument("--heap", action="store_true",
                   help="sample the C heap through the run (CPU, glibc): each rank's peak in the steps after the "
                        "first, as states + activations + temporaries, in memory_bytes['heap_peak'] (slows the run)")
    p.add_argument("--no-check-first-batch", dest="check_first_batch", action="store_false",
                   help="skip the first-batch check (a plan's first loss against the whole model's, which stops a "
                        "run that computes something else)")
    _workload_options(p, defaults)


def _precision_options(p: argparse.ArgumentParser, defaults: RunConfig) -> None:
    p.add_argument("--precision", default=defaults.precision, help="Lightning precision, e.g. 32-true, bf16-mixed")
    p.add_argument("--param-dtype", choices=["bf16", "fp16"], default=None,
                   help="under a plan and the matching *-mixed precision: every module computes with half copies of "
                        "its weights, cast once per step (FSDP2's param_dtype): the residual stream in half too")


def _checkpoint_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-dir", default=None, help="save a checkpoint there at the end of every epoch")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="with --checkpoint-dir: save every this many optimizer steps instead (mid-epoch resumes "
                        "continue with the next batch and the saved random state)")
    p.add_argument("--async-save", action="store_true",
                   help="with --checkpoint-dir under a plan: write checkpoints in the background, training waiting "
                        "only for each rank's copy to host memory (checkpoint/stall_s in the run store)")
    p.add_argument("--checkpoint-format", choices=("dcp", "gathered"), default="dcp",
                   help="under a plan: each rank writes its slice in torch's DCP format (default), or the gathered "
                        "format (every rank gathering the whole state: the pack's before #59)")
    p.add_argument("--resume", default=None, help="resume from this checkpoint (sharded directory or file); auto: "
                   "the newest complete one in --checkpoint-dir, if any (a job restarted by torchrun, SLURM)")


def _workload_options(p: argparse.ArgumentParser, defaults: RunConfig) -> None:
    p.add_argument("--label", default=None, help="the run's name in the run store (default: the strategy)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="trace two untimed steps with torch's profiler: the trace, the operators' table and the "
                        "device's split of a step, in DIR (give --warmup-steps 5 or more)")
    p.add_argument("--vocab", type=int, default=None,
                   help="the vocabulary of a workload built to a shape (gpt-shape); the demo's is its corpus's")
    p.add_argument("--workload", default=defaults.workload,
                   help="what to train: a registered workload (default: gpt, the demo) or module:object")
    p.add_argument("--hf-config", default=None, metavar="PATH",
                   help="a Hugging Face config.json (the file, or a folder that has one; Llama, Qwen2, Mistral, "
                        "Mixtral, GPT-2...): that model, from random weights, built in configure_model (workload "
                        "hf-config)")


def config_from(args: argparse.Namespace, strategy: str) -> RunConfig:
    names = {f.name for f in fields(RunConfig)} - {"strategy"}
    config = RunConfig(strategy=strategy, **{name: getattr(args, name) for name in names})
    return with_hf_config(config)


def with_hf_config(config: RunConfig) -> RunConfig:
    """``config`` with the ``hf-config`` workload where ``--hf-config`` is given (and no other ``--workload``)."""
    if config.hf_config is None or config.workload == HF_WORKLOAD:
        return config
    if config.workload != RunConfig.workload:
        raise SystemExit(f"stratpack: --hf-config builds the model of a config.json (workload {HF_WORKLOAD}); "
                         f"--workload {config.workload} names another: give one of them")
    return replace(config, workload=HF_WORKLOAD)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the workload (the demo GPT) once")
    p.add_argument("strategy", help="'single', a plan string (dp, naive, zero3_tp2...) or a Lightning name")
    p.add_argument("--out", default=None, help="write the result as JSON here (rank 0)")
    p.add_argument("--params-out", default=None, help="save the final parameters here (rank 0, torch.save)")
    add_run_options(p)
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    if args.heap and any(os.environ.get(k) != v for k, v in HEAP_ENV.items()):
        # MKL's fast allocator keeps the GEMM buffers it frees (1-4 MiB at the demo's sizes): the first step's heap
        # figure would count its cache (the steady peak starts above it anyway); torch's flight recorder grows the
        # heap for its first 2,000 calls (`HEAP_ENV`). Both read their switch once, when torch loads: start again with
        # them set (the launched ranks inherit them).
        os.environ.update(HEAP_ENV)
        os.execv(sys.executable, sys.orig_argv)
    from strategies.cli import ranks

    config = config_from(args, args.strategy)
    others = ranks.start_other_ranks(args.argv, config.devices) if (
        _is_plan(config.strategy) and ranks.starts_ranks(config.devices, config.num_nodes)) else []
    with ranks.ended_on_error(others):
        result = run(config, params_out=args.params_out)
    if args.out:
        write_result(result, args.out)
    elif result["rank"] == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=1))
    # The run is over and its results are written. Rarely (seen ~2 in 40 ZeRO-3 runs, never in a plain loop), a
    # rank then aborts in C++ teardown at interpreter exit ("terminate called without an active exception"),
    # turning a finished run into exit code 134. Skip that teardown: nothing is left to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(ranks.wait_for(others))
