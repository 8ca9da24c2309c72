"""Checkpoint files: sharded, resharding, atomically written (`sharded`). Not activation checkpointing, which is
`strategies.activation_checkpoint`."""

from strategies.checkpoint.sharded import (
    CheckpointError,
    ShardedCheckpointIO,
    ShardedReader,
    convert,
    is_sharded,
    load_any,
    load_sharded,
    read_manifest,
    save_sharded,
)

__all__ = ["CheckpointError", "ShardedCheckpointIO", "ShardedReader", "convert", "is_sharded", "load_any",
           "load_sharded", "read_manifest", "save_sharded"]
