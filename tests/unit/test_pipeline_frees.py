"""A pipeline stage's output, once sent, is held only until its send completes: its data is the next stage's input,
held there (`pipeline.runner._Output`, Megatron's ``deallocate_output_tensor``). Rehearsed (one rank on meta tensors,
every storage counted: exact and deterministic), rank 0 of ``pp2_1f1b_mb4``: 1F1B's first stage has two microbatches
in flight at its peak, so keeping the outputs would hold two more of them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from strategies.cli.rehearse import rehearse_rank
from strategies.cli.train import RunConfig
from strategies.pipeline import runner

CONFIG = RunConfig(strategy="pp2_1f1b_mb4", steps=2, batch_size=8, seq_len=128, n_layer=4, n_embd=128, optimizer="sgd",
                   wandb="off", warmup_steps=0, check_first_batch=False)


def test_a_sent_output_is_freed_at_its_send(tmp_path, monkeypatch):
    config = replace(CONFIG, runs_dir=str(tmp_path))
    freed = rehearse_rank(config, 0, 2)["memory_bytes"]["heap_peak"]
    monkeypatch.setattr(runner._Output, "of", staticmethod(lambda out, free: runner._Output(out, out.shape,
                                                                                            out.requires_grad)))
    kept = rehearse_rank(config, 0, 2)["memory_bytes"]["heap_peak"]
    microbatch_output = 8 // 4 * 128 * 128 * 4  # (batch / microbatches) x sequence x width, float32
    # Two outputs, less a few small tensors by which the peak's point moves (1,440 bytes: deterministic, on meta)
    assert kept - freed == pytest.approx(2 * microbatch_output, rel=0.01)
