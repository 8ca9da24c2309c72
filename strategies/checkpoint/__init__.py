"""Checkpoint files, resharding, atomically written: torch's DCP by slice (`dcp_dir`, Lightning's checkpoints), the
pack's gathered format (`sharded`), their shared steps (`directory`). Not activation checkpointing, which is
`strategies.activation_checkpoint`."""

from strategies.checkpoint.directory import CheckpointError, is_sharded
from strategies.checkpoint.sharded import (
    ShardedCheckpointIO,
    ShardedReader,
    convert,
    load_any,
    load_sharded,
    read_manifest,
    save_sharded,
)

__all__ = ["CheckpointError", "ShardedCheckpointIO", "ShardedReader", "convert", "is_sharded", "load_any",
           "load_sharded", "read_manifest", "save_sharded"]
