"""Strategy strings: parse, validate, print and resolve a parallel plan.

A plan is a set of ``_``-separated tokens, in any order, each at most once::

    <data mode>[<degree>]   naive | dp | zero1 | zero2 | zero3   (dp4: our DDP over 4 ranks)
    dp<N>                   data-parallel degree beside another mode (zero3_dp4)
    tp<N>  pp<N>            tensor- and pipeline-parallel degrees
    cp<N>                   context parallel: each sequence split over N ranks, attention round a ring
    ep<N>                   expert parallel: each MoE layer's experts split over N of the dp x cp ranks
    gpipe | 1f1b | interleaved, v<N>, mb<N>   pipeline schedule, virtual stages, microbatches
    mbg<N>                  interleaved: microbatches each chunk takes in turn (Megatron's group size; default pp)
    sp                      sequence parallel (with tp): norms see 1/tp of the sequence
    async                   async TP (with sp): tp's gathers and reduce-scatters in pieces, each beside a matmul
    vp                      vocab parallel (with tp): the output layer and the loss split over the vocabulary
    ac                      activation checkpointing
    offload                 CPU offload of ZeRO's master weights and optimizer states

``str(plan)`` is canonical (fixed token order, defaults left out) and ``parse(str(p)) == p``.
The canonical string is the run label, the pytest id and the dashboard label.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass

from strategies.equivalents import LIGHTNING as _LIGHTNING_EQUIVALENT


class DataMode(enum.Enum):
    """How the data-parallel axis shares the model state."""

    NAIVE = "naive"  # parameter server: every worker sends its full gradients to rank 0
    DP = "dp"  # our DDP: bucketed all-reduce overlapped with backward
    ZERO1 = "zero1"  # + optimizer states partitioned
    ZERO2 = "zero2"  # + gradients partitioned
    ZERO3 = "zero3"  # + parameters partitioned

    @property
    def is_zero(self) -> bool:
        return self._name_.startswith("ZERO")  # _name_: a plain attribute (.value is a descriptor, slower)

    @property
    def stage(self) -> int:
        """The ZeRO stage (0 for the modes that replicate the whole model state)."""
        return int(self._name_[-1]) if self._name_.startswith("ZERO") else 0


class PipelineSchedule(enum.Enum):
    """Pipeline schedule: the order in which each stage runs its microbatches (`pipeline.schedules`). AUTO, what
    ``pp<N>`` without a schedule token means: the one the estimator predicts fastest among those whose memory fits
    (`measure.planner.choose_schedule`), picked when the pipeline is built."""

    AUTO = "auto"
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB1P = "zb1p"  # zero bubble ZB-H1: 1F1B with each backward split into B (input) and W (weights)
    ZBV = "zbv"  # zero bubble ZB-V: two stages per rank placed as a V
    DUALPIPEV = "dualpipev"  # DualPipeV: two stages per rank placed as a V, forward beside backward

    @property
    def splits_backward(self) -> bool:
        """Whether each backward runs as B (the input's gradient) and a later W (the weights')."""
        return self in (PipelineSchedule.ZB1P, PipelineSchedule.ZBV, PipelineSchedule.DUALPIPEV)

    @property
    def v_shaped(self) -> bool:
        """Whether each rank holds two stages placed as a V (stage r and 2pp-1-r)."""
        return self in (PipelineSchedule.ZBV, PipelineSchedule.DUALPIPEV)


_DEGREE = re.compile(r"^(dp|tp|pp|cp|ep|v|mbg|mb|ac)([0-9]+)$")  # ASCII digits only: \d would also take '٣' and '३'
_MODE_WITH_DEGREE = re.compile(r"^(naive|zero1|zero2|zero3)([0-9]+)$")
MAX_DEGREE = 2**31 - 1  # ranks, stages and microbatches are 32-bit counts in torch.distributed
VALID_TOKENS = (
    "naive, dp, zero1, zero2, zero3, dp<N>, tp<N>, pp<N>, cp<N>, ep<N>, gpipe, 1f1b, interleaved, zb1p, zbv, "
    "dualpipev, v<N>, mb<N>, mbg<N>, sp, async, vp, ac, ac<N>, sac, offload"
)


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """A parallel training plan over ``dp * cp * tp * pp`` ranks (tp innermost, then cp, dp, pp outermost)."""

    data: DataMode = DataMode.DP
    """How model state is shared across the data-parallel axis."""
    dp: int | None = None
    """Data-parallel degree; None fills the ranks left after tp and pp (see `resolve`)."""
    tp: int = 1
    """Tensor-parallel degree: each weight matrix is split over this many ranks (Megatron column/row)."""
    pp: int = 1
    """Pipeline-parallel degree: the layers are cut into this many stages."""
    cp: int = 1
    """Context-parallel degree: each sample's sequence is split over this many ranks (load-balanced chunks), which
    run attention round a ring; their gradients are averaged with dp's (ZeRO shards over dp x cp)."""
    ep: int = 1
    """Expert-parallel degree: the experts of each mixture-of-experts layer split over this many of the data ranks
    (dp x cp), tokens sent to their experts' ranks and back by all-to-all. Carved out of the data ranks, not a factor
    of the world size (as torchtitan's ep): it must divide dp x cp. The experts' gradients are averaged, and sharded
    by ZeRO, over the data ranks that hold the same experts (`expert_data_ranks`)."""
    schedule: PipelineSchedule = PipelineSchedule.AUTO
    """Pipeline schedule; only meaningful with pp > 1 (AUTO: chosen for the model when the pipeline is built)."""
    virtual: int = 1
    """Virtual stages per rank (model chunks) for the interleaved schedule (zbv and dualpipev hold two: `chunks`)."""
    microbatches: int | None = None
    """Microbatches per batch in the pipeline; None means pp (see `resolve`)."""
    group: int | None = None
    """The interleaved schedule's microbatches per chunk in turn (Megatron's microbatch_group_size_per_vp_stage,
    Meta's N); None means pp. Smaller holds fewer microbatches in warm-up, larger hides more messages; with it the
    microbatches need not be a multiple of pp (`pipeline.schedules.interleaved`)."""
    sp: bool = False
    """Sequence parallel (needs tp): norms and dropout see 1/tp of the sequence; each tensor-parallel
    all-reduce becomes an all-gather before and a reduce-scatter after the split layers."""
    async_tp: bool = False
    """Async tensor parallel (the token ``async``, needs sp; torchtitan's async TP, Megatron's tp_comm_overlap): each
    sequence-parallel all-gather and reduce-scatter cut along the sequence into pieces, each in flight while the matmul
    of the piece before computes (`tensor_parallel.overlap`). The same bytes in more calls; the same products, their
    sums to float rounding."""
    vp: bool = False
    """Vocab parallel (needs tp): the output layer (and its embedding) split over the vocabulary, the loss computed
    from the pieces, so that no rank holds the (batch, sequence, vocab) logits."""
    ac: bool = False
    """Activation checkpointing: recompute each block's activations in backward instead of storing them."""
    ac_every: int = 1
    """With ``ac``: recompute one block in N only (``ac2``: the first, third, ...; torchtitan's layer-level selective
    option), the others keep their activations."""
    sac: bool = False
    """Selective activation checkpointing (torchtitan's op-level policy): each block keeps its matmuls' and fused
    attention's outputs and recomputes the rest (norms, activations, casts, and the collectives between them)."""
    offload: bool = False
    """CPU offload: ZeRO's fp32 master shards and optimizer states live in host memory."""

    def __post_init__(self) -> None:
        self._check_degrees()
        if not isinstance(self.data, DataMode) or not isinstance(self.schedule, PipelineSchedule):
            raise TypeError("data must be a DataMode and schedule a PipelineSchedule (use ParallelPlan.parse for "
                            "strings)")
        if self.pp == 1 and (self.schedule is not PipelineSchedule.AUTO or self.microbatches is not None):
            given = " and ".join(f"'{t}'" for t in (
                self.schedule.value if self.schedule is not PipelineSchedule.AUTO else "",
                f"mb{self.microbatches}" if self.microbatches is not None else "") if t)
            raise ValueError(
                f"{given}: a pipeline schedule and mb<N> need pipeline parallelism (pp<N> with N > 1); "
                "for gradient accumulation use Trainer(accumulate_grad_batches=N)"
            )
        if (self.schedule is PipelineSchedule.INTERLEAVED) != (self.virtual > 1):
            raise ValueError(f"'{self.schedule.value}' with 'v{self.virtual}': the interleaved schedule needs v<N> "
                             "with N >= 2 virtual stages, and v<N> needs interleaved")
        interleaved = self.schedule is PipelineSchedule.INTERLEAVED
        if self.group is not None and not interleaved:
            raise ValueError(f"mbg{self.group}: the group of microbatches per chunk is the interleaved schedule's "
                             f"(e.g. 'pp4_interleaved_v2_mb10_mbg5')")
        if interleaved and self.group is None and self.microbatches is not None and self.microbatches % self.pp:
            raise ValueError(
                f"interleaved needs the microbatches to be a multiple of pp: mb{self.microbatches} % pp{self.pp} != 0 "
                f"(or set the microbatches each chunk takes in turn, mbg<N> with N >= pp: mbg{self.pp})"
            )
        for token, what in (("sp", "sequence parallel) splits the sequence"),
                            ("vp", "vocab parallel) splits the output layer")):
            if getattr(self, token) and self.tp == 1:
                raise ValueError(f"{token} ({what} over the tensor-parallel ranks, so it needs tp<N> with N > 1 "
                                 f"(e.g. 'tp2_{token}')")
        least = {PipelineSchedule.ONE_F_ONE_B: ("1F1B", 1), PipelineSchedule.ZB1P: ("zb1p", 1),
                 PipelineSchedule.DUALPIPEV: ("dualpipev", 2)}.get(self.schedule)
        if self.pp > 1 and least and self.microbatches is not None and self.microbatches < least[1] * self.pp:
            name, times = least
            raise ValueError(
                f"{name} needs at least {'twice ' if times == 2 else ''}as many microbatches as stages: "
                f"mb{self.microbatches} < {'2 * ' if times == 2 else ''}pp{self.pp}; use mb{times * self.pp} or "
                "more, or the gpipe schedule"
            )
        self._check_data_mode()

    def _check_async(self) -> None:
        if not self.sp:
            raise ValueError("async overlaps sequence parallel's all-gathers and reduce-scatters with the matmuls they "
                             f"feed: it needs sp (e.g. 'tp{self.tp}_sp_async')")
        if self.schedule.splits_backward:
            raise ValueError(f"async with {self.schedule.value}: async computes a tensor-parallel layer's weight "
                             "gradients in its own backward, where the zero-bubble schedules defer them to W; use "
                             "1f1b, interleaved or gpipe with async, or drop async")
        if self.cp > 1:
            raise ValueError(f"async with cp{self.cp}: not built or tested with context parallel's ring attention; "
                             "drop async (the all-gathers then run whole) or cp")

    def _check_data_mode(self) -> None:
        if self.async_tp:
            self._check_async()
        if self.ac_every > 1 and not self.ac:
            raise ValueError(f"ac_every={self.ac_every} needs ac=True (the token 'ac{self.ac_every}' sets both)")
        if self.ac and self.sac:
            raise ValueError("'ac' with 'sac': a block is recomputed one way; 'ac' recomputes all of it, 'sac' all "
                             "but its matmuls and attention: keep one")
        if self.ep > 1 and self.sp:
            raise ValueError(f"sp with ep{self.ep}: under sequence parallel each tp rank would route a different part "
                             "of the sequence to experts that every tp rank holds whole, whose gradients would then "
                             "need a sum over tp that the pack does not make yet; use tp without sp with ep")
        if self.ep > 1 and self.data is DataMode.NAIVE:
            raise ValueError(f"ep{self.ep} with naive: the parameter server sums every gradient on one rank, which "
                             "cannot hold the experts other ranks own; use dp or zero1-3 with ep")
        if self.offload and not self.data.is_zero:
            raise ValueError(
                f"offload moves ZeRO's sharded optimizer state to the CPU, so it needs zero1, zero2 or zero3, "
                f"not {self.data.value} (e.g. 'zero3_offload')"
            )

    def _check_degrees(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep", "virtual", "microbatches", "group", "ac_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if value is not None and value > MAX_DEGREE:
                raise ValueError(f"{name} must be at most {MAX_DEGREE}")

    # -- text --------------------------------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> ParallelPlan:
        """Parse a strategy string such as ``zero3_tp2_pp2``; raise ValueError naming the bad token."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"a plan is a non-empty string of tokens ({VALID_TOKENS}), got {text!r}")
        tokens = text.strip().lower().split("_")
        fields: dict[str, object] = {}
        seen: set[str] = set()

        def put(key: str, value: object, token: str) -> None:
            if key in seen:
                why = ""
                if key == "data":  # e.g. naive_zero1: two ways of running data parallel at once
                    why = (f" ({fields[key].value} and {token} are both data-parallel modes, and the dp ranks run "
                           "one: naive, dp, zero1, zero2 or zero3)")
                raise ValueError(f"{text!r}: {token!r} repeats the {key} already given; each part appears once{why}")
            seen.add(key)
            fields[key] = value

        for token in tokens:
            _parse_token(text, token, put)
        if "virtual" in fields and "schedule" not in fields:
            raise ValueError(f"{text!r}: v{fields['virtual']} (virtual stages) needs the interleaved schedule")
        if fields.get("schedule") is PipelineSchedule.INTERLEAVED and "virtual" not in fields:
            fields["virtual"] = 2
        try:
            return cls(**fields)  # type: ignore[arg-type]
        except ValueError as err:
            raise ValueError(f"{text!r}: {err}") from None

    def __str__(self) -> str:
        parts: list[str] = []
        if self.data is not DataMode.DP:
            parts.append(self.data.value)
        if self.dp is not None:
            parts.append(f"dp{self.dp}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.sp:
            parts.append("sp")
        if self.async_tp:
            parts.append("async")
        if self.vp:
            parts.append("vp")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        if self.schedule is not PipelineSchedule.AUTO:
            parts.append(self.schedule.value)
        if self.virtual > 1:
            parts.append(f"v{self.virtual}")
        if self.microbatches is not None:
            parts.append(f"mb{self.microbatches}")
        if self.group is not None:
            parts.append(f"mbg{self.group}")
        if self.ac:
            parts.append("ac" if self.ac_every == 1 else f"ac{self.ac_every}")
        if self.sac:
            parts.append("sac")
        if self.offload:
            parts.append("offload")
        return "_".join(parts) or "dp"

    # -- arithmetic --------------------------------------------------------------------------------------

    @property
    def recomputes(self) -> bool:
        """Whether backward runs blocks' forwards again (``ac``, ``ac<N>`` or ``sac``), and with them collectives."""
        return self.ac or self.sac

    @property
    def recomputed(self) -> float:
        """The share of blocks whose forward runs again in backward: 1 under ``ac`` and ``sac``, 1/N under
        ``ac<N>``, 0 without."""
        return 1.0 if self.sac else 1.0 / self.ac_every if self.ac else 0.0

    @property
    def model_parallel_size(self) -> int:
        """The ranks that share one data-parallel replica's batch: tp * cp * pp."""
        return self.tp * self.cp * self.pp

    def resolve(self, world_size: int) -> ParallelPlan:
        """Fill dp (and microbatches) for ``world_size`` ranks; raise ValueError showing the arithmetic."""
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be >= 1 (an integer number of ranks), got {world_size!r}")
        if world_size > MAX_DEGREE:
            raise ValueError(f"world_size {world_size} is more ranks than torch.distributed counts ({MAX_DEGREE})")
        if self.dp is not None:
            total = self.dp * self.model_parallel_size
            if total != world_size:
                raise ValueError(f"plan '{self}': dp({self.dp}) * {self._model_parallel_terms()} = {total} != "
                                 f"world_size {world_size}")
            dp = self.dp
        else:
            if world_size % self.model_parallel_size:
                raise ValueError(
                    f"plan '{self}': {self._model_parallel_terms()} = {self.model_parallel_size} does not divide "
                    f"world_size {world_size}, so no data-parallel degree fits"
                )
            dp = world_size // self.model_parallel_size
        if (dp * self.cp) % self.ep:
            raise ValueError(f"plan '{self}': ep({self.ep}) must divide the data ranks dp({dp}) * cp({self.cp}) = "
                             f"{dp * self.cp}: expert parallel is carved out of them (use an ep that divides "
                             f"{dp * self.cp}, or more ranks)")
        default = 2 * self.pp if self.schedule is PipelineSchedule.DUALPIPEV else self.pp  # its least
        microbatches = self.microbatches if self.microbatches is not None or self.pp == 1 else default
        return dataclasses.replace(self, dp=dp, microbatches=microbatches)

    def _model_parallel_terms(self) -> str:
        return f"tp({self.tp}) * pp({self.pp})" + (f" * cp({self.cp})" if self.cp > 1 else "")

    @property
    def data_ranks(self) -> int:
        """The ranks whose gradients are averaged (and ZeRO shards over): dp x cp, which hold different tokens."""
        return (self.dp or 1) * self.cp

    @property
    def data_axis(self) -> str:
        """The name the data group's collectives are counted under: dp, or cp with one dp rank, else dp_cp."""
        return "dp" if self.cp == 1 else "cp" if self.dp == 1 else "dp_cp"

    @property
    def expert_data_ranks(self) -> int:
        """The data ranks that hold the same experts (their gradients averaged and ZeRO-sharded over): dp x cp / ep."""
        return self.data_ranks // self.ep

    @property
    def chunks(self) -> int:
        """Stages each pipeline rank holds: v for interleaved, two for the V-shaped schedules, else one."""
        return 2 if self.schedule.v_shaped else self.virtual

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index on each axis of a resolved plan: rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i."""
        if self.dp is None:
            raise ValueError("coordinates need a resolved plan: call plan.resolve(world_size) first")
        world_size = self.dp * self.model_parallel_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside plan '{self}' of {world_size} ranks")
        return {"pp": rank // (self.dp * self.cp * self.tp), "dp": (rank // (self.cp * self.tp)) % self.dp,
                "cp": (rank // self.tp) % self.cp, "tp": rank % self.tp}


def _parse_token(text: str, token: str, put) -> None:
    """Read one token into the plan's fields through ``put(field, value, token)``."""
    if token in ("naive", "dp", "zero1", "zero2", "zero3"):
        put("data", DataMode(token), token)
    elif token in {s.value for s in PipelineSchedule}:
        put("schedule", PipelineSchedule(token), token)
    elif token in ("sp", "vp", "ac", "sac", "offload"):
        put(token, True, token)
    elif token == "async":
        put("async_tp", True, token)
    elif match := _DEGREE.match(token):
        name = match.group(1)
        field = {"v": "virtual", "mb": "microbatches", "mbg": "group", "ac": "ac_every"}.get(name, name)
        value = _degree(text, token, field, match.group(2))
        if name == "v" and value < 2:
            raise ValueError(f"{text!r}: {token!r}: v<N> is the number of virtual stages per rank, N >= 2")
        put(field, value, token)
        if name == "ac":
            put("ac", True, token)
    elif (match := _MODE_WITH_DEGREE.match(token)) and match.group(2).lstrip("0"):
        mode, degree = match.group(1), _degree(text, token, "dp", match.group(2))
        raise ValueError(f"{text!r}: write the degree as its own token: '{mode}_dp{degree}', not {token!r}")
    elif not token:
        raise ValueError(f"{text!r}: empty token: tokens are joined by single '_', with none at either end "
                         f"(e.g. 'zero3_tp2'); valid tokens: {VALID_TOKENS}")
    else:
        raise ValueError(_bad_token_message(text, token))


def _degree(text: str, token: str, field: str, digits: str) -> int:
    """The N of a token such as ``tp4``: a positive integer up to MAX_DEGREE (checked before int() reads it)."""
    significant = digits.lstrip("0")
    if not significant:
        raise ValueError(f"{text!r}: {token!r}: {field} must be a positive integer, got 0")
    if len(significant) > len(str(MAX_DEGREE)) or int(significant) > MAX_DEGREE:
        raise ValueError(f"{text!r}: {token!r}: {field} must be at most {MAX_DEGREE}")
    return int(significant)


def _bad_token_message(text: str, token: str) -> str:
    """Name the bad token; for a Lightning name used inside a plan, suggest our equivalent if it is valid."""
    lowered = text.strip().lower()
    for name in sorted(_LIGHTNING_EQUIVALENT, key=len, reverse=True):
        if name.split("_")[0] != token:  # only a Lightning name that starts at the bad token explains it
            continue
        match = re.search(rf"(^|_){name}(_|$)", lowered)
        if match is None:
            continue
        head, tail = lowered[: match.start()], lowered[match.end() :]
        suggestion = "_".join(filter(None, [head, _LIGHTNING_EQUIVALENT[name], tail]))
        try:
            ParallelPlan.parse(suggestion)
            hint = f" Did you mean '{suggestion}'?"
        except ValueError:
            hint = f" Our equivalent of {name!r} is '{_LIGHTNING_EQUIVALENT[name]}'."
        return (
            f"{text!r}: {name!r} is Lightning's own strategy name and keeps its meaning; it does not combine "
            f"with plan tokens.{hint} Valid tokens: {VALID_TOKENS}"
        )
    return f"{text!r}: unknown token {token!r}; valid tokens: {VALID_TOKENS}"
