"""The plan strategies by name, as Lightning names its own (``DDPStrategy``, ``DeepSpeedStrategy(stage=3)``): each is
`PlanStrategy` with its plan spelled out, and exactly equal to the plan string it names.

    Trainer(strategy=ZeroStrategy(stage=3))              # = Trainer(strategy="zero3")
    Trainer(strategy=PipelineStrategy(pp=2, microbatches=8, schedule="gpipe"))   # = "pp2_gpipe_mb8"

Every class takes `PlanOptions` as keyword arguments too; compositions (``zero3_tp2_pp2``) are ``PlanStrategy``.
"""

from __future__ import annotations

from typing import Any

from strategies.lightning.strategy import PlanStrategy
from strategies.plan import DataMode, ParallelPlan, PipelineSchedule


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


class NaiveDataParallelStrategy(PlanStrategy):
    """Parameter-server data parallel (the plan ``naive``): all gradients go through one server rank
    (``server_rank``, index 0 of the data-parallel axis by default)."""

    def __init__(self, **options: Any) -> None:
        super().__init__("naive", **options)


class DataParallelStrategy(PlanStrategy):
    """Our DDP (the plan ``dp``): bucketed all-reduce overlapped with backward (``bucket_cap_mb``,
    ``find_unused_parameters``, ``ring_all_reduce``)."""

    def __init__(self, **options: Any) -> None:
        super().__init__("dp", **options)


class ZeroStrategy(PlanStrategy):
    """ZeRO over the data-parallel ranks (the plans ``zero1``, ``zero2``, ``zero3``): stage 1 shards the optimizer
    states, 2 also the gradients, 3 also the parameters; ``offload`` keeps the master shards and optimizer states
    in host memory (``zero3_offload``)."""

    def __init__(self, stage: int, *, offload: bool = False, **options: Any) -> None:
        if stage not in (1, 2, 3) or isinstance(stage, bool):
            raise ValueError(f"stage must be 1, 2 or 3 (ZeRO's stages), got {stage!r}")
        super().__init__(ParallelPlan(data=DataMode(f"zero{stage}"), offload=_flag("offload", offload)), **options)


class TensorParallelStrategy(PlanStrategy):
    """Tensor parallel (Megatron) over ``tp`` ranks (the plan ``tp<N>``), with ``sequence_parallel`` ``tp<N>_sp``;
    the remaining ranks are data parallel. ``tp_plan`` says which layers split when the shipped plans do not fit."""

    def __init__(self, tp: int, *, sequence_parallel: bool = False, **options: Any) -> None:
        super().__init__(ParallelPlan(tp=tp, sp=_flag("sequence_parallel", sequence_parallel)), **options)


class PipelineStrategy(PlanStrategy):
    """Pipeline parallel over ``pp`` stages (the plan ``pp<N>``): ``schedule`` ``"auto"`` (the default: the one the
    estimator predicts fastest that fits), ``"1f1b"``, ``"gpipe"``, ``"interleaved"`` (with ``virtual_stages`` per
    rank, 2 by default, and ``microbatch_group`` microbatches per chunk in turn, pp by default), ``"zb1p"``, ``"zbv"``
    or ``"dualpipev"``; ``microbatches`` per batch (default pp)."""

    def __init__(self, pp: int, *, schedule: str | PipelineSchedule = PipelineSchedule.AUTO,
                 microbatches: int | None = None, virtual_stages: int | None = None,
                 microbatch_group: int | None = None, **options: Any) -> None:
        valid = [s.value for s in PipelineSchedule]
        if not isinstance(schedule, PipelineSchedule) and schedule not in valid:
            raise ValueError(f"schedule must be one of {', '.join(valid)}, got {schedule!r}")
        schedule = PipelineSchedule(schedule)
        if virtual_stages is None:  # as the plan string: 'interleaved' alone means two stages per rank
            virtual_stages = 2 if schedule is PipelineSchedule.INTERLEAVED else 1
        super().__init__(ParallelPlan(pp=pp, schedule=schedule, microbatches=microbatches, virtual=virtual_stages,
                                      group=microbatch_group),
                         **options)
