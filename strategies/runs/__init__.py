"""The run store: what every run measured, on local disk, in a documented and versioned schema.

    runs/                                  ``$STRATPACK_RUNS``, else ``./runs`` (or ``--runs-dir``)
      20261122-213012-zero3_tp2-4f1c/      one folder per run
        meta.json       written once at the start, atomically: the run's identity and environment
        rank00003.jsonl one line per optimizer step from rank 3, appended and flushed every step
        summary.json    written atomically at the end by rank 0; its absence marks the run incomplete
        restarts.jsonl  a run resumed from its own checkpoint: one line per restart (`restarts`), by rank 0

Schema version 1 (`SCHEMA`), present in every file and record:

- ``meta.json``: ``schema``, ``run_id``, ``comparison`` (an id shared by the runs of one comparison, or
  null), ``label`` (the strategy as given), ``plan`` (canonical, resolved) or null for non-plan strategies,
  ``degrees`` {dp, tp, pp, microbatches, virtual}, ``world_size``, ``devices`` (names), ``versions``
  {torch, lightning, stratpack, python}, ``model`` (config), ``num_params``, ``seed``, ``git``, ``started``
  (unix time), ``predicted`` (the estimator's figures, or null), ``precision`` (Lightning's) and ``param_dtype``
  (the strategy's, e.g. "torch.bfloat16", or null: `write.precision_label` shows the two); from ``stratpack
  bench`` also ``bench`` (the pair, its ratios and both sides' per-rank peaks; ``role`` "ours" or "peer");
  from ``stratpack rehearse`` ``kind`` "rehearsal" (absent for a real run) and ``rehearsal`` {ranks, target,
  worst_rank}: one record per rehearsed rank, and a summary of the lowest rehearsed rank
  (``memory_bytes_per_rank`` null for the others).
- ``rank*.jsonl`` records: ``schema``, ``rank``, ``step``, ``time`` (unix), ``step_time_s``, ``loss``
  (this rank's), ``lr``, ``samples_per_s``, ``tokens_per_s``, ``memory`` (bytes by category:
  params, grads, optimizer, host, activations_peak, logits (the output layer's largest output, 1/tp of the
  vocabulary under vp; also inside activations_peak), peak_rss, and on CUDA max_allocated, max_reserved),
  ``comm`` ({"all_reduce/dp": {"calls", "bytes_sent", "bytes_recv", "wait_s"}} per step), ``bubble``
  (pipeline: this rank's idle fraction) or null, ``split`` (seconds per step: forward, backward, optimizer compute
  and the pipeline's bubble; `measure.split`), ``steps`` (the steps the record stands for: 1, more once a
  long run's records thin out, see `measure.monitor.keep_record`; its comm figures are their mean); ``checkpoint``
  {saves, stall_s}: the checkpoint saves whose stall this step's time holds, and how long training waited on them;
  after a restart ``attempt`` (2, 3, ...) and, on a step an earlier attempt had recorded, ``redone`` (true).
  A failed rank's last line: ``error``, ``last_calls``, ``time``, ``step``. A bench record's
  ``memory`` is ``max_allocated`` only (the profiled peak of torch's allocator, on CPU too).
- ``summary.json``: ``schema``, ``status`` ("complete"), ``finished`` (unix time), and the monitor's
  summary (losses, tokens_per_s, comm_per_step, memory_bytes_per_rank, pipeline timeline, estimate, ``checkpoint``
  {saves, async, stall_s, stall_s_max, write_s}); after a restart, its last attempt's (``attempt``).
- ``restarts.jsonl``: the fields of `restarts.restart_entry` (attempt, resumed_step, redone, last_steps, cause,
  ranks, time_lost_s, downtime_s, checkpoint); ``rank*-attempt*.sigterm``: a rank the launcher's SIGTERM reached.

Non-finite numbers are written as null. Each rank writes only its own file, so concurrent runs and ranks
never write to the same file; readers take complete lines only (a crash can leave half a line).

`read_run` reads only a run folder's own plain files (no links, pipes or devices, each up to a size), and checks
the fields readers use against META_SHAPE, RECORD_SHAPE and SUMMARY_SHAPE: a meta.json that differs makes the
folder no run; a record line or a summary that differs is left out, and the run's "problems" say so. The
shapes and the memory categories are in `schema`; `write` writes a run, `read` reads one.
"""

from strategies.runs.read import RunError, list_runs, read_run
from strategies.runs.schema import MEMORY_CATEGORIES, MODEL_STATE, RUNS_ENV, SCHEMA
from strategies.runs.write import RunWriter, new_comparison_id, new_run_id, precision_label, run_meta, runs_dir

__all__ = ["MEMORY_CATEGORIES", "MODEL_STATE", "RUNS_ENV", "SCHEMA", "RunError", "RunWriter", "list_runs",
           "new_comparison_id", "new_run_id", "precision_label", "read_run", "run_meta", "runs_dir"]
