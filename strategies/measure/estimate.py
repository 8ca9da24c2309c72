"""What a plan should cost, before running it: memory per rank by category, bytes per step per axis, bubble.

The model is a decoder-only transformer (`ModelShape`): embeddings, ``layers`` blocks of attention (fused
qkv + projection) and a 4x MLP, a final norm and an untied head, laid out like the demo GPT, so for the
demo the model-state figures are exact. For a model given only by its parameter count the blocks get what
the embeddings and head leave.

- Model states (ZeRO paper, Rajbhandari et al. 2020): bytes per parameter for the weights, gradients and
  optimizer (Adam: two moments) in the layout the pack holds under each Lightning precision (`PRECISIONS`):
  ``32-true``, ``bf16-mixed`` and ``16-mixed`` 4 + 4 + 8 (autocast keeps fp32 weights and gradients and casts
  per op; only activations are half), ``bf16-true`` / ``16-true`` 2 + 2 + 4 (weights, gradients and Adam's
  moments all half). DeepSpeed's "fp16 weights + fp32 master" 2 + 2 + 12 is not a layout the pack holds.
  ZeRO-1 divides the optimizer by dp, ZeRO-2 also the gradients, ZeRO-3 also the weights; ``offload``
  moves ZeRO's optimizer state, master shards and their gradients to the host.
- Tensor parallel splits each block's four matrices and the biases of the column-split ones over tp; the
  norms, the row-split biases, the embeddings and the head stay whole (the shipped plans), unless ``vp``
  splits the token embedding and the head (weight and bias) over the vocabulary.
- Pipeline parallel: stages cut as the pack cuts them (`pipeline.stages.partition` by parameter count).
- The peak inside a step (`peak.walk`): each rank's actions in order (the schedule's table under pp, one
  accumulation micro-step at a time), activations counted tensor by tensor for the demo's block (Korthikanti et
  al. 2022 count the same tensors, with dropout masks the demo does not have), and the temporaries beside them: the
  backward's working set, recompute, ZeRO-3's gathered blocks, gradients ZeRO-2/3 keep whole across a step's
  backwards, messages in flight, and, by ``backend`` and ``workspace``, gloo's copies and the matrix library's buffers.
- The set-up peak (`setup_peaks`), from before the model is built to the end of the first step: the first step's,
  or the build's where larger; built on meta (configure_model) the kept slice and one piece made whole, built in
  ``__init__`` the whole model on every rank. The optimizer's state is Adam's unless named (`OPTIMIZERS`).
- Communication, bytes sent per rank per optimizer step, keyed like `comm.CommStats.snapshot`
  (``"all_reduce/dp"``): DDP 2(N-1)/N·Ψ, ZeRO-1/2 (N-1)/N·Ψ reduce-scatter + all-gather, ZeRO-3 (N-1)/N·Ψ
  all-gathers twice + reduce-scatter (an upper bound: the last unit stays gathered into backward), the
  naive server (N-1)·Ψ; tp 4 all-reduces of b·s·h per block and microbatch (5 with recompute, which stops
  before the MLP's), or with sp 4 all-gathers and 4 reduce-scatters of 1/tp of it (6 and 5 with recompute);
  ``vp`` one more b·s·h all-reduce for the embedding, and where the head is, one for its input's gradient and
  three values per token for the loss.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from strategies.measure.peak import GLOO, Chunk, Peak, Pieces, Rules, step_actions, walk
from strategies.pipeline import messages, schedules
from strategies.pipeline.cuts import partition
from strategies.plan import DataMode, ParallelPlan, PipelineSchedule
from strategies.sizes import DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_BYTES, IN_FLIGHT

# Lightning's precision -> bytes per parameter of weights, gradients, Adam's state, and per activation element.
PRECISIONS = {"32-true": (4, 4, 8, 4), "bf16-mixed": (4, 4, 8, 2), "16-mixed": (4, 4, 8, 2),
              "bf16-true": (2, 2, 4, 2), "16-true": (2, 2, 4, 2)}
_ALIASES = {"fp32": "32-true", "32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}  # as Lightning reads them
DEFAULT_PRECISION = "bf16-mixed"  # what `stratpack plan` assumes: what a GPU run usually asks for
BUCKET = DEFAULT_BUCKET_CAP_MB * 2**20  # DDP's buckets, which ZeRO-1/2's flats follow
# The optimizer -> its state per parameter, in Adam's two moments (the third figure of `PRECISIONS`): SGD with
# momentum keeps one buffer, plain SGD none.
OPTIMIZERS = {"adamw": 1.0, "adam": 1.0, "sgd": 0.5, "sgd-plain": 0.0}


def layout(precision: str) -> tuple[int, int, int, int]:
    """Bytes per parameter (weights, gradients, optimizer) and per activation under Lightning's ``precision``."""
    name = _ALIASES.get(str(precision), str(precision))
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[name]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer: sizes, and the samples per microbatch... per data-parallel rank."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch: int = 1  # samples per data-parallel rank per optimizer step (all microbatches and accumulation steps)
    accumulate: int = 1  # accumulation steps the batch is run in, one after the other (activations: one at a time)
    params: int | None = None  # total parameters, when known (else counted from the sizes)
    flash_attention: bool = True  # no s x s score matrix kept for backward (SDPA / flash)

    def block(self) -> tuple[int, int]:
        """Parameters of one block: (split by tp, kept whole)."""
        h = self.hidden
        if self.params is not None:
            per_block = max(0, (self.params - self.embeddings() - self.head())) // self.layers
            return per_block - 6 * h, 6 * h
        return 12 * h * h + 7 * h, 6 * h  # qkv 3h²+3h, proj h², fc 4h²+4h, proj 4h² | 2 norms 4h, 2 row biases 2h

    def embeddings(self, vocab_split: int = 1) -> int:
        """Token and position embeddings; ``vocab_split``: the ranks the vocabulary is split over ('vp')."""
        return (self.vocab // vocab_split + self.seq) * self.hidden

    def head(self, vocab_split: int = 1) -> int:
        """The final norm and the output layer (weight and bias), its vocabulary split over ``vocab_split``."""
        return 2 * self.hidden + (self.vocab * self.hidden + self.vocab) // vocab_split

    def total(self) -> int:
        split, whole = self.block()
        if self.params is not None:
            return self.params
        return self.embeddings() + self.head() + self.layers * (split + whole)

    @classmethod
    def from_config(cls, config: dict, batch: int = 1) -> ModelShape:
        """From a model config: the demo's GPTConfig fields, or Hugging Face names."""
        def get(*names: str) -> int:
            for name in names:
                if name in config:
                    return int(config[name])
            raise KeyError(f"the config has none of {names}")

        return cls(layers=get("n_layer", "num_hidden_layers"), hidden=get("n_embd", "hidden_size"),
                   heads=get("n_head", "num_attention_heads"), seq=get("seq_len", "max_position_embeddings"),
                   vocab=get("vocab_size"), batch=batch)

    @classmethod
    def from_params(cls, params: float, *, seq: int = 4096, vocab: int = 32000, batch: int = 1) -> ModelShape:
        """A shape for a model known by its size: layers and width of the usual configurations."""
        known = [(1.3e9, 24, 2048, 16), (2.7e9, 32, 2560, 32), (7e9, 32, 4096, 32), (13e9, 40, 5120, 40),
                 (30e9, 60, 6656, 52), (70e9, 80, 8192, 64), (175e9, 96, 12288, 96)]
        _, layers, hidden, heads = min(known, key=lambda k: abs(math.log(k[0] / params)))
        shape = cls(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, batch=batch, params=int(params))
        if shape.block()[0] <= 12 * hidden * hidden // 4:  # the blocks would get (almost) nothing
            raise ValueError(f"{params:.3g} parameters is too few for {layers} layers of width {hidden} with a "
                             f"{vocab}-token vocabulary: give the shape (ModelShape(layers=..., hidden=...)), or "
                             f"a size of 1e9 or more")
        return shape


@dataclass
class Estimate:
    """Per-rank predictions for one plan: ``memory[stage][category]`` in bytes (ranks of a stage alike),
    ``comm`` bytes sent per optimizer step by ``"kind/axis"`` (rank 0's), the ideal bubble."""

    plan: str
    memory: list[dict[str, float]]
    comm: dict[str, float]
    bubble: float
    params_per_stage: list[int] = field(default_factory=list)
    peak_at: list[str] = field(default_factory=list)  # per pipeline rank: the action its peak is in (`peak.walk`)
    states: list[dict[str, float]] = field(default_factory=list)  # per pipeline rank: model states between steps
    # Per pipeline rank, the peak from before the model is built to the end of the first step (`setup_peaks`): built
    # on meta in configure_model, each rank making its slice; and built whole on every rank (in __init__)
    setup: list[float] = field(default_factory=list)
    setup_whole: list[float] = field(default_factory=list)

    def peak(self) -> float:
        """The largest per-rank device total (host excluded)."""
        return max(sum(v for k, v in m.items() if k != "host") for m in self.memory)

    def setup_peak(self, deferred: bool = True) -> float:
        """The largest per-rank set-up peak, the model built on meta (``deferred``) or whole; at least `peak`."""
        return max([self.peak(), *(self.setup if deferred else self.setup_whole)])


def _vocab_split(plan: ParallelPlan) -> int:
    """The ranks the vocabulary (token embedding and head) is split over: tp under 'vp', else none."""
    return plan.tp if plan.vp else 1


def stage_params(shape: ModelShape, plan: ParallelPlan) -> list[int]:
    """Parameters each rank holds, per pipeline rank (tp-split blocks, embeddings on the first stage, norm
    and head on the last), cut the way `pipeline.PipelineParallel` cuts by parameter count."""
    _, per_stage = _stages(shape, plan)
    where = _placement(plan)
    return [sum(n for s, n in enumerate(per_stage) if where[s] == rank) for rank in range(plan.pp)]


def _stages(shape: ModelShape, plan: ParallelPlan) -> tuple[list[range], list[int]]:
    """Each stage's blocks and its local parameters (all ``pp * v`` stages, in order)."""
    split, whole = shape.block()
    local_block = math.ceil(split / plan.tp) + whole
    stages, v = plan.pp * plan.chunks, _vocab_split(plan)
    ranges = list(_cut(local_block, shape.layers, stages, shape.embeddings(v), shape.head(v))) if stages > 1 \
        else [range(shape.layers)]
    per_stage = [len(r) * local_block for r in ranges]
    per_stage[0] += shape.embeddings(v)
    per_stage[-1] += shape.head(v)
    return ranges, per_stage


def optimizer_share(optimizer: str) -> float:
    """The state ``optimizer`` keeps per parameter, as a share of Adam's (`OPTIMIZERS`)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)} (its state per parameter), got "
                         f"{optimizer!r}")
    return OPTIMIZERS[optimizer]


@functools.cache  # `partition` is a dynamic program over the blocks: the planner asks it thousands of times
def _cut(block: int, layers: int, stages: int, first: int, last: int) -> tuple[range, ...]:
    return tuple(partition([block] * layers, stages, first, last))


def model_states(psi: int, plan: ParallelPlan, precision: str = "fp32", optimizer: str = "adamw") -> dict[str, float]:
    """Bytes of weights, gradients and ``optimizer`` state for ``psi`` local parameters under ``plan``'s data mode."""
    w, g, o, _ = layout(precision)
    o = o * optimizer_share(optimizer)
    n = plan.data_ranks if plan.data.is_zero else 1
    stage = plan.data.stage if plan.data.is_zero else 0
    shard = math.ceil(psi / n)  # ZeRO pads each flat to a multiple of N: at most N-1 elements more
    out = {"params": w * (shard if stage >= 3 else psi), "grads": g * (shard if stage >= 2 else psi),
           "optimizer": o * (shard if stage >= 1 else psi), "host": 0.0}
    if plan.offload:  # the optimizer state, the master shard (a host copy of the weights') and its gradient
        out["host"] = out["optimizer"] + w * shard + g * shard
        out["optimizer"] = 0.0
        if stage >= 2:  # the reduced gradient shard goes straight to its host copy: on the device only in flight
            out["grads"] = 0.0
    return out


def setup_peaks(shape: ModelShape, plan: ParallelPlan, memory: list[dict[str, float]], precision: str,
                deferred: bool) -> list[float]:
    """Each pipeline rank's peak from before the build to the end of the first step: the first step's (``memory``,
    the steady peak) or the build's, whichever is larger. Built on meta (``deferred``, `strategies.deferred`) a rank
    holds its kept weights and the largest piece it makes whole at a time (a block, or on the first and last stages
    the embeddings and the head: tp and vp cut them only once made), twice under ZeRO-3 (the piece and its flat
    copy, then sharded); built whole, the whole model's weights beside the kept ones while they are cut."""
    w = layout(precision)[0]
    ranges, _ = _stages(shape, plan)
    last, block, first_piece, last_piece = len(ranges) - 1, sum(shape.block()), shape.embeddings(), shape.head()
    mine: dict[int, list[int]] = {}
    for s, r in _placement(plan).items():
        mine.setdefault(r, []).append(s)
    out = []
    for rank, held in enumerate(memory):
        device = sum(v for k, v in held.items() if k != "host")
        if deferred:
            stages = mine.get(rank, [])
            pieces = [block if any(ranges[s] for s in stages) else 0, first_piece if 0 in stages else 0,
                      last_piece if last in stages else 0]
            build = held["params"] + (2 if plan.data.stage == 3 else 1) * w * max(pieces)
        else:
            build = held["params"] + w * shape.total()
        out.append(max(device, build))
    return out


def step_pieces(shape: ModelShape, plan: ParallelPlan, act_bytes: float, weight_bytes: float,
                backend: str = "nccl", wide_bytes: float | None = None) -> Pieces:
    """The bytes of one microbatch's step on a rank (`peak.Pieces`; the counts are in the module docstring there).
    ``wide_bytes``: of an element of the residual stream and of the loss's input (default ``act_bytes``). Under
    autocast (``*-mixed``) they stay in the weights' float32 while the matmuls' outputs are half: each norm keeps its
    float32 input and each matmul a half copy of the norm's output (found by rehearsing, `stratpack rehearse`)."""
    s, h, t = shape.seq / plan.cp, shape.hidden, plan.tp  # cp: this rank's part of each sequence
    b = shape.batch / shape.accumulate / (plan.microbatches or 1)  # alive at once: one microbatch of one micro-step
    u = b * s * h * act_bytes
    r = u * (wide_bytes or act_bytes) / act_bytes  # the residual stream's
    boundary = r / t if plan.sp else r
    scores = 0.0 if shape.flash_attention else shape.heads * s / h * u / t  # softmax's output, kept for backward
    # two residual adds' outputs (the stream, kept by the next norms) and the two norms' outputs (kept by the
    # column-parallel layers, half under autocast), the rest split; under sp the stream is split too and the
    # column-parallel inputs gathered whole
    whole = (2 * u + 2 * r / t + 12 / t * u if plan.sp else 2 * r + 2 * u + 12 / t * u) + scores
    logits = b * s * shape.vocab * (wide_bytes or act_bytes) / _vocab_split(plan)
    split, kept = shape.block()
    unit = (math.ceil(split / t) + kept) * weight_bytes if plan.data.stage == 3 else 0.0
    # Recompute makes a block's activations again but not its output (the residual add, which it drops).
    return Pieces(boundary=boundary, block=boundary if plan.ac else whole,
                  recompute=whole - boundary if plan.ac else 0.0,
                  embedding=boundary, head=u + logits, logits=logits,
                  # incoming gradient (gathered whole under sp), the MLP's input gradient; one weight's gradient
                  backward=boundary + (u if plan.sp else 0.0) + 4 * u / t, weight=4 * h * h / t * weight_bytes,
                  mlp_grad=4 * u / t,
                  unit=unit, gathers=unit if backend == GLOO else 0.0,
                  # Split backwards: B keeps each block linear's input (qkv's and fc's whole, proj's 1/t, fc2's 4/t) and
                  # output gradient (qkv's 3/t, proj's whole, fc's 4/t, fc2's whole) for W, with sp too (gathered).
                  # The head's weight gradient is made in B (`pipeline.weights`): nothing kept for it.
                  stash=(4 + 12 / t) * u if plan.schedule.splits_backward else 0.0)


def _chunk(plan: ParallelPlan, psi: int, blocks: int, stage: int, stages: int, grad_bytes: float, backend: str,
           held: bool) -> Chunk:
    """A chunk of ``psi`` local parameters: the gradients kept whole in ``param.grad`` across the step's backwards
    that are not its last (``held``: naive, ZeRO-2/3; `dp` and ZeRO-1 accumulate in their buffers), and what the last
    one's reduction holds beyond them: ZeRO's reduce-scatter output shard and, on gloo, a copy of its input flat
    plus 1/N of it (measured; an all-reduce holds 1/N); naive's flat message, and the server's incoming one."""
    grads, n = psi * grad_bytes, plan.data_ranks
    reduce = 0.0
    if n > 1 and plan.data.is_zero:
        flat = min(grads, BUCKET) if plan.data.stage < 3 else grads / max(blocks, 1)
        # ZeRO-3's flats are a block each: as backward ends, the IN_FLIGHT last launched are still reducing, each
        # holding its full gradient (and on gloo its copies), beside the shards already reduced
        behind = min(IN_FLIGHT, max(blocks - 1, 0)) if plan.data.stage == 3 else 0
        reduce = grads / n + behind * flat + (max(behind, 1) * (1 + 1 / n) * flat if backend == GLOO else 0.0)
    elif n > 1 and plan.data is DataMode.DP and backend == GLOO:
        reduce = min(grads, BUCKET) / n
    elif n > 1 and plan.data is DataMode.NAIVE:
        reduce = 2 * grads
    keeps = plan.data is DataMode.NAIVE or plan.data.stage >= 2
    return Chunk(blocks, stage == 0, stage == stages - 1, grads=grads if held and keeps else 0.0, reduce=reduce,
                 weights=grads if plan.schedule.splits_backward else 0.0)


def _rules(plan: ParallelPlan, rank: int, states: dict[str, float], chunk_grads: list[float], blocks: int,
           rounds: bool = False, early: bool = False) -> Rules:
    """How ``plan``'s step frees and keeps gradients and messages (`peak.Rules`) on pipeline ``rank``, with these
    model ``states`` and chunks (their gradients' bytes; ``blocks`` blocks in all); ``rounds``: every program grouped
    in rounds (a crowded host: `messages.crowded`); ``early``: every receive posted at the first
    (`messages.posts_early`)."""
    n = plan.data_ranks
    naive = plan.data is DataMode.NAIVE and n > 1
    # naive's flat and ZeRO-2/3's shards are the optimizer's .grad: Lightning's zero_grad frees them after the
    # (first) training_step, before backward; under pp the schedule runs inside training_step, which first drops
    # the module's .grad (naive's flat) but not the shards (the optimizer's own parameters).
    release = states["grads"] if naive or (plan.data.stage >= 2 and plan.pp == 1) else 0.0
    # ZeRO-2/3 make a flat's full gradient when its first parameter's gradient arrives in the reducing backward,
    # beside the .grad not yet moved into it: ZeRO-2's flats follow DDP's buckets over all of the rank's chunks (the
    # first one at most FIRST_BUCKET_BYTES), ZeRO-3's are one per block.
    flats = 0.0
    if n > 1 and plan.data.stage == 2:
        flats = min(sum(chunk_grads), FIRST_BUCKET_BYTES)
    elif n > 1 and plan.data.stage == 3:
        flats = sum(chunk_grads) / max(blocks, 1)
    held = _held_ahead(plan.schedule.value, plan.pp, plan.microbatches, plan.virtual, rounds, early) \
        if plan.pp > 1 else None
    return Rules(release=release, release_at_start=plan.pp > 1, flats=flats, flats_early=plan.data.stage < 3,
                 early=held[rank] if held else ())


def data_parallel_bytes(psi: int, plan: ParallelPlan, kept: int = 0) -> dict[str, float]:
    """Bytes rank 0 sends per optimizer step over the data group (dp, or dp x cp: `ParallelPlan.data_axis`) for
    ``psi`` local fp32 parameters. ``kept``: parameters of ZeRO-3's last unit in forward order, which stays gathered
    into backward. Under pp, ZeRO-3 gathers each unit again for every microbatch's forward and backward (why
    DeepSpeed does not allow the two together): counted as 2·m gathers, less the kept unit's m (within a few %
    measured)."""
    n, axis = plan.data_ranks, plan.data_axis
    if n == 1:
        return {}

    def padded(count: int) -> int:
        return math.ceil(count / n) * n * 4

    if plan.data is DataMode.DP:
        return {f"all_reduce/{axis}": 2 * (n - 1) / n * psi * 4}
    if plan.data is DataMode.NAIVE:
        return {f"send/{axis}": (n - 1) * psi * 4}  # rank 0 is the parameter server
    m = plan.microbatches if plan.pp > 1 else 1
    gathered = 2 * m * padded(psi) - m * padded(kept) if plan.data.stage == 3 else padded(psi)
    return {f"reduce_scatter/{axis}": (n - 1) / n * padded(psi), f"all_gather/{axis}": (n - 1) / n * gathered}


def communication(shape: ModelShape, plan: ParallelPlan, psi: int, blocks: float, kept: int = 0,
                  act_bytes: int = 4, wide_bytes: int = 4) -> dict[str, float]:
    """Bytes rank 0 sends per optimizer step, by ``kind/axis``: fp32 gradients; activations in ``act_bytes`` where
    they are a matmul's output (the ring's K/V, tp's row-parallel outputs and their gradients) and in ``wide_bytes``
    where autocast keeps them float32 (the norms' outputs tp gathers or whose gradients it reduces, pp's messages:
    `step_pieces`)."""
    out = data_parallel_bytes(psi, plan, kept)
    t = plan.tp
    elements = shape.batch * shape.seq / plan.cp * shape.hidden  # the step's b·s·h on a rank, all microbatches
    activation = elements * wide_bytes
    if plan.cp > 1:
        for key, nbytes in context_parallel_bytes(shape, plan, blocks, act_bytes).items():
            out[key] = out.get(key, 0.0) + nbytes
    if t > 1:
        # Per block forward: the column-parallel layers' inputs (norm outputs: wide) gathered under sp, the
        # row-parallel outputs (act) reduced; backward the conjugates, on the gradients of the same tensors. Recompute
        # runs a block's forward again up to its last saved tensor: both gathers, the first scatter (all-reduce).
        narrow = elements * act_bytes
        if plan.sp:  # + entering the region (backward) and leaving it (forward): stage 0 only enters under pp
            gathers = (4 if plan.ac else 2) * activation + 2 * narrow
            out["all_gather/tp"] = (t - 1) / t * (gathers * blocks + (2 if plan.pp == 1 else 1) * activation)
            out["reduce_scatter/tp"] = (t - 1) / t * ((3 if plan.ac else 2) * narrow + 2 * activation) * blocks
        else:
            out["all_reduce/tp"] = 2 * (t - 1) / t * ((3 if plan.ac else 2) * narrow + 2 * activation) * blocks
        if plan.vp:  # the embedding's partial sums forward; with the head, its input's gradient and the loss's
            # max and (sum of exp, target logit): one value per token each
            tokens = shape.batch * shape.seq / plan.cp * 4
            vocab = activation + (activation + 3 * tokens if plan.pp == 1 else 0)
            out["all_reduce/tp"] = out.get("all_reduce/tp", 0.0) + 2 * (t - 1) / t * vocab
    if plan.pp > 1:  # rank 0 sends activations on from each of its v chunks, gradients back from v-1 of them
        where = _placement(plan)  # rank 0 sends on each chunk's output and its input's gradient, to other ranks
        last = len(where) - 1
        sends = sum((s < last and where[s + 1] != 0) + (s > 0 and where[s - 1] != 0) for s in where if where[s] == 0)
        out["send/pp"] = sends * activation / (t if plan.sp else 1)
    return out


def context_parallel_bytes(shape: ModelShape, plan: ParallelPlan, blocks: float, act_bytes: int) -> dict[str, float]:
    """Bytes a cp rank sends per optimizer step: each of its ``blocks`` attentions passes its K and V round the ring
    for every sample, forward and (again under recompute) backward, where the dK/dV accumulators (fp32) go round too
    (`context_parallel.ring.ring_bytes`); and each training_step's loss, averaged over cp (one all-reduce)."""
    n = plan.cp
    local = shape.seq / n * shape.hidden / plan.tp  # one sample's q (or k, or v) elements on this rank
    forward = (n - 1) * 2 * local * act_bytes
    backward = forward + n * 2 * local * 4
    ring = blocks * shape.batch * ((2 if plan.ac else 1) * forward + backward)
    return {"send/cp": ring, "all_reduce/cp": shape.accumulate * 2 * (n - 1) / n * 4}


def _check_plan(shape: ModelShape, plan: ParallelPlan) -> None:
    """Refuse a plan the estimator cannot predict, saying why."""
    if plan.pp > 1 and plan.schedule is PipelineSchedule.AUTO:
        raise ValueError(f"plan '{plan}' has no pipeline schedule yet: choose one first (`planner.choose_schedule`)")
    if shape.heads % plan.tp:
        raise ValueError(f"{shape.heads} heads do not divide by tp = {plan.tp}")
    if shape.seq % (2 * plan.cp):
        raise ValueError(f"cp = {plan.cp} cuts each sequence into {2 * plan.cp} chunks, which {shape.seq} tokens do "
                         "not divide into")


def estimate(shape: ModelShape, plan: ParallelPlan | str, world_size: int, precision: str = "fp32",
             act_bytes: int | None = None, backend: str = "nccl", workspace: float = 0.0,
             crowded: bool = False, optimizer: str = "adamw") -> Estimate:
    """Predict ``plan`` at ``world_size`` for ``shape`` under Lightning's ``precision``. ``act_bytes``: bytes per
    activation element (default: the precision's); ``backend``: the collectives' (``gloo`` holds copies ``nccl`` does
    not); ``workspace``: one matmul's working memory (`peak`); ``crowded``: `messages.crowded` (the host's ranks);
    ``optimizer``: whose state is held (`OPTIMIZERS`)."""
    plan = (ParallelPlan.parse(plan) if isinstance(plan, str) else plan).resolve(world_size)
    _check_plan(shape, plan)
    weight_bytes, grad_bytes, _, default_act = layout(precision)
    act_bytes = act_bytes or default_act
    mixed = _ALIASES.get(str(precision), str(precision)).endswith("-mixed")
    pieces = step_pieces(shape, plan, act_bytes, weight_bytes, backend, weight_bytes if mixed else None)
    ranges, per_stage = _stages(shape, plan)
    memory, where, between = [], [], []
    per_rank = stage_params(shape, plan)
    for rank, psi in enumerate(per_rank):
        states = model_states(psi, plan, precision, optimizer)
        # Autocast's half copies of the weights: saved by the matmuls for backward, but not under recompute, whose
        # forward saves none (the rehearsals' count; what autocast's own cache holds is not counted)
        cast_bytes = act_bytes if mixed and not plan.ac else 0
        peak = _rank_peak(shape, plan, rank, states, pieces, (ranges, per_stage), (grad_bytes, cast_bytes), backend,
                          workspace, crowded)
        # What the rank holds at its peak: the gradients kept between steps less what the step had freed by then.
        memory.append({**states, "grads": states["grads"] - peak.released, "activations": peak.activations,
                       "temporaries": peak.temporaries})
        where.append(peak.at)
        between.append(states)
    bubble = schedules.ideal_bubble(plan.pp, plan.microbatches, plan.virtual, plan.schedule.value) if plan.pp > 1 \
        else 0.0
    comm = _rank0_comm(shape, plan, per_rank[0], ranges, act_bytes, weight_bytes if mixed else act_bytes)
    return Estimate(str(plan), memory, comm, bubble, per_rank,
                    peak_at=where, states=between, setup=setup_peaks(shape, plan, memory, precision, True),
                    setup_whole=setup_peaks(shape, plan, memory, precision, False))


def _rank_peak(shape: ModelShape, plan: ParallelPlan, rank: int, states: dict[str, float], pieces: Pieces,
               stages: tuple[list[range], list[int]], sizes: tuple[float, float], backend: str, workspace: float,
               crowded: bool) -> Peak:
    """`peak.walk` of pipeline ``rank``'s step: its chunks of ``stages`` (blocks and parameters of each), its actions
    and the rules its data mode and messages follow; ``sizes``: bytes of a gradient and of autocast's copy of a weight
    (0 without autocast); the rest `estimate`'s arguments."""
    (ranges, per_stage), (grad_bytes, cast_bytes) = stages, sizes
    matmuls = math.ceil(shape.block()[0] / plan.tp)  # a block's weights autocast copies (tp's slice)
    head = shape.vocab // _vocab_split(plan) * shape.hidden
    # Gradients stay whole until the step's last backward when it has several (microbatches, micro-steps).
    held = (plan.pp > 1 and (plan.microbatches or 1) > 1) or shape.accumulate > 1
    mine = [s for s, r in _placement(plan).items() if r == rank]
    chunks = {s: dataclasses.replace(_chunk(plan, per_stage[s], len(ranges[s]), s, len(ranges), grad_bytes, backend,
                                            held), cast=cast_bytes * (len(ranges[s]) * matmuls +
                                                                      (head if s == len(ranges) - 1 else 0)))
              for s in mine}
    table = schedules.shared(plan.schedule.value, plan.pp, plan.microbatches, plan.virtual)[rank] if plan.pp > 1 \
        else None
    actions = step_actions(table, shape.accumulate, plan.microbatches or 1)
    rounds, early = crowded and backend == GLOO, messages.posts_early(backend == GLOO)
    rules = _rules(plan, rank, states, [per_stage[s] * grad_bytes for s in mine], sum(len(ranges[s]) for s in mine),
                   rounds, early)
    # what names the actions and the messages held ahead (`_rules`)
    key = (plan.schedule.value, plan.pp, plan.microbatches, plan.virtual, shape.accumulate, rank, rounds, early)
    return walk(pieces, chunks, actions, workspace, rules, key)


def _rank0_comm(shape: ModelShape, plan: ParallelPlan, psi: int, ranges: list[range], act_bytes: int,
                wide_bytes: int) -> dict:
    """`communication` for rank 0, which holds ``psi`` parameters and the blocks of its stages in ``ranges``."""
    first_blocks = sum(len(ranges[s]) for s, r in _placement(plan).items() if r == 0)
    split, whole = shape.block()
    # ZeRO-3 keeps rank 0's last unit in forward order gathered: the head, or under pp its last block.
    kept = shape.head(_vocab_split(plan)) - 2 * shape.hidden if plan.pp == 1 \
        else math.ceil(split / plan.tp) + whole
    return communication(shape, plan, psi, first_blocks, kept, act_bytes, wide_bytes)


def _placement(plan: ParallelPlan) -> dict[int, int]:
    """Stage -> pipeline rank, as the plan's schedule places its stages (looped while none is chosen yet)."""
    if plan.pp == 1 or plan.schedule is PipelineSchedule.AUTO:
        return {s: s % plan.pp for s in range(plan.pp * plan.virtual)}
    return _owners(plan.schedule.value, plan.pp, plan.microbatches or 1, plan.virtual)


@functools.cache
def _owners(schedule: str, pp: int, microbatches: int, virtual: int) -> dict[int, int]:
    return schedules.owners(schedules.shared(schedule, pp, microbatches, virtual))


@functools.cache
def _held_ahead(schedule: str, pp: int, microbatches: int, virtual: int, rounds: bool = False,
                early: bool = False) -> tuple[tuple[int, ...], ...] | None:
    """Per rank and action the messages received ahead of use (`messages.held_receives`) by a step shaped as the last
    one, as the runner runs it (`messages.as_run`), for programs grouped in rounds (interleaved, the V schedules; every
    schedule where ``rounds``) or with every receive posted at the first (``early``: `messages.early_receives`); None
    for programs grouped per action, which post each receive just before its use."""
    held = messages.held_ahead(schedules.shared(schedule, pp, microbatches, virtual), pp, rounds, early)
    return tuple(tuple(counts) for counts in held) if held else None  # `peak.Rules.early`, made once
