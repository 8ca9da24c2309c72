"""Train the demo GPT once with one strategy and return what the StrategyMonitor measured.

Every strategy sees the same global batches: Lightning's DistributedSampler shuffles with the global seed
and gives rank r the positions r, r+N, ... of one permutation, so a step's union over the data-parallel
ranks is a contiguous slice of it. The single-device run draws that permutation itself
(``DistributedSampler`` with one replica), so its batch k is the same set of samples.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset

SINGLE = "single"  # one process, Lightning's default single-device strategy: the reference


@dataclass(frozen=True)
class RunConfig:
    strategy: str = "dp"
    devices: int = 2
    steps: int = 30
    batch_size: int = 16  # global: split over the data-parallel ranks
    accumulate: int = 1
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    data: str | None = None
    max_chars: int = 200_000
    seed: int = 0
    precision: str = "32-true"
    warmup_steps: int = 3
    gradient_clip_val: float | None = None
    optimizer: str = "adamw"
    lr: float = 3e-3
    epoch_steps: int | None = None  # optimizer steps per epoch (default: the whole dataset)
    checkpoint_dir: str | None = None  # save a checkpoint there at the end of every epoch
    resume: str | None = None  # a checkpoint to resume from (sharded directory or single file)
    runs_dir: str | None = None  # the run store (default $STRATPACK_RUNS or ./runs)
    comparison: str | None = None  # the id shared by the runs of one `stratpack compare`
    wandb: str = "auto"  # auto (offline unless logged in; off without wandb), offline, online, off
    accelerator: str = "cpu"  # "gpu" / "auto" on a machine with GPUs (nccl)


def data_parallel_degree(strategy: str, devices: int) -> int:
    """How many ranks split the global batch: the plan's dp degree, or all devices for other strategies."""
    if strategy == SINGLE:
        return 1
    from strategies.plan import ParallelPlan
    from strategies.registry import looks_like_plan

    if looks_like_plan(strategy):
        return ParallelPlan.parse(strategy).resolve(devices).dp
    return devices


def run(config: RunConfig, params_out: str | None = None) -> dict[str, Any]:
    """Fit the demo GPT for ``config.steps`` optimizer steps; the monitor's summary plus the config.

    ``params_out``: rank 0 also saves the final parameters there (``torch.save`` of the state dict)."""
    import strategies  # noqa: F401  (registers the plan names)  # pyflakes: used for its side effect
    from demos.data import load_corpus
    from demos.gpt import make_demo
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import WandbLogger

    from strategies.sharded_checkpoint import ShardedCheckpointIO
    from strategies.estimate import predict_run
    from strategies.monitor import StrategyMonitor

    L.seed_everything(config.seed, workers=True, verbose=False)
    text = load_corpus(config.data, max_chars=config.max_chars) if config.data else None
    module, dataset = make_demo(text, n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd,
                                seq_len=config.seq_len, max_chars=config.max_chars, lr=config.lr,
                                optimizer=config.optimizer)
    replicas = data_parallel_degree(config.strategy, config.devices)
    if config.batch_size % replicas:
        raise ValueError(f"global batch {config.batch_size} does not split over {replicas} data-parallel ranks")
    if config.epoch_steps and config.steps % config.epoch_steps:
        raise ValueError(f"steps ({config.steps}) must be a whole number of epochs of epoch_steps ({config.epoch_steps})")
    if config.epoch_steps:
        # An epoch of exactly epoch_steps optimizer steps: a dataset of that many global batches (rather than
        # limit_train_batches, which a resumed run does not honour for the epoch it resumes in).
        dataset = Subset(dataset, range(config.epoch_steps * config.batch_size * config.accumulate))
    sampler = None
    if config.strategy == SINGLE:
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=config.seed)
    loader = DataLoader(dataset, batch_size=config.batch_size // replicas, sampler=sampler, drop_last=True)
    world = 1 if config.strategy == SINGLE else config.devices
    predicted = predict_run(config.strategy, world, asdict(module.config), config.batch_size, config.accumulate)
    monitor = StrategyMonitor(warmup_steps=config.warmup_steps, runs_dir=config.runs_dir,
                              comparison=config.comparison, label=config.strategy,
                              meta={"seed": config.seed, "run_config": asdict(config), "predicted": predicted})
    single = config.strategy == SINGLE
    callbacks: list = [monitor]
    if config.checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=config.checkpoint_dir, save_top_k=-1, every_n_epochs=1))
    val_loaders = None
    if config.checkpoint_dir:
        # A one-batch validation after each epoch (the checkpoint is saved after it), as in a real run.
        val_loaders = DataLoader(Subset(dataset, range(config.batch_size)), batch_size=config.batch_size // replicas)
    trainer = L.Trainer(
        accelerator=config.accelerator, devices=1 if single else config.devices, strategy="auto" if single else config.strategy,
        # With epochs of a known length, the run is counted in epochs: Lightning 2.6 resumes an epoch-end
        # checkpoint of a max_steps run as an unfinished epoch (one batch too many), not of a max_epochs run.
        max_steps=-1 if config.epoch_steps else config.steps,
        max_epochs=config.steps // config.epoch_steps if config.epoch_steps else None, accumulate_grad_batches=config.accumulate, precision=config.precision,
        gradient_clip_val=config.gradient_clip_val,
        logger=_wandb_logger(config) or False, enable_checkpointing=bool(config.checkpoint_dir), enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, limit_val_batches=1 if val_loaders else 0,
        # One process reads the pack's sharded checkpoints too (a plan's strategy reads them itself).
        plugins=[ShardedCheckpointIO()] if single else None,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(module, loader, val_loaders, ckpt_path=config.resume)
    if isinstance(trainer.logger, WandbLogger) and trainer.global_rank == 0:
        import wandb

        wandb.finish()  # flush the run to disk now: the CLI ends its processes with os._exit
    result = {"config": asdict(config), "label": config.strategy, "rank": trainer.global_rank, **monitor.summary}
    result["model"] = asdict(module.config)  # the shape the estimator needs (strategies.estimate)
    result["predicted"] = predicted  # what strategies.estimate expected of this run (also in its meta.json)
    # What this rank's loggers saw last (rank 0 writes the logs): e.g. train_loss of the last step.
    result["logged"] = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    # The single-device view of the weights (tensor-parallel slices gathered back): a collective, all ranks.
    state = trainer.strategy.lightning_module_state_dict()
    result["num_params"] = sum(v.numel() for v in state.values())
    result["final_param_norm"] = float(torch.cat([v.detach().float().flatten() for v in state.values()]).norm())
    if params_out and trainer.global_rank == 0:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, params_out)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # A script that is done with its ranks says so, all ranks together (rank 0 hosts the store).
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return result


def _wandb_logger(config: RunConfig):
    """A WandbLogger grouped by comparison: offline unless the user is logged in or asks for online; None
    when wandb is off or not installed (training never depends on it)."""
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
    from strategies.runstore import runs_dir

    save_dir = runs_dir(config.runs_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    return WandbLogger(project="stratpack", group=config.comparison, name=config.strategy, save_dir=str(save_dir),
                       offline=mode != "online", config=asdict(config))


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
