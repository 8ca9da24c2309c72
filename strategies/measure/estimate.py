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
- Activations (Korthikanti et al. 2022), per block and microbatch with 2-byte activations,
  s·b·h·(34 + 5·a·s/h); with tp s·b·h·(10 + 24/t + 5·a·s/(h·t)); with sequence parallel s·b·h/t·(34 +
  5·a·s/h); with recompute (``ac``) only each block's input, 2·s·b·h. Attention kernels that keep no
  score matrix (flash / SDPA) drop the 5·a·s/h term. Under pp, the peak number of microbatches in flight
  on the rank (from the schedule table) times its blocks.
- Communication, bytes sent per rank per optimizer step, keyed like `comm.CommStats.snapshot`
  (``"all_reduce/dp"``): DDP 2(N-1)/N·Ψ, ZeRO-1/2 (N-1)/N·Ψ reduce-scatter + all-gather, ZeRO-3 (N-1)/N·Ψ
  all-gathers twice + reduce-scatter (an upper bound: the last unit stays gathered into backward), the
  naive server (N-1)·Ψ; tp 4 all-reduces of b·s·h per block and microbatch (5 with recompute), or with
  sp all-gathers and reduce-scatters of 1/tp of it; ``vp`` one more b·s·h all-reduce for the embedding,
  and where the head is, one for its input's gradient and three values per token for the loss.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from strategies.equivalents import equivalent_plan
from strategies.pipeline import schedules
from strategies.pipeline.stages import partition
from strategies.plan import DataMode, ParallelPlan
from strategies.runs.schema import MODEL_STATE

# Lightning's precision -> bytes per parameter of weights, gradients, Adam's state, and per activation element.
PRECISIONS = {"32-true": (4, 4, 8, 4), "bf16-mixed": (4, 4, 8, 2), "16-mixed": (4, 4, 8, 2),
              "bf16-true": (2, 2, 4, 2), "16-true": (2, 2, 4, 2)}
_ALIASES = {"fp32": "32-true", "32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}  # as Lightning reads them
DEFAULT_PRECISION = "bf16-mixed"  # what `stratpack plan` assumes: what a GPU run usually asks for


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

    def peak(self) -> float:
        """The largest per-rank device total (host excluded)."""
        return max(sum(v for k, v in m.items() if k != "host") for m in self.memory)


def _vocab_split(plan: ParallelPlan) -> int:
    """The ranks the vocabulary (token embedding and head) is split over: tp under 'vp', else none."""
    return plan.tp if plan.vp else 1


def stage_params(shape: ModelShape, plan: ParallelPlan) -> list[int]:
    """Parameters each rank holds, per pipeline rank (tp-split blocks, embeddings on the first stage, norm
    and head on the last), cut the way `pipeline.PipelineParallel` cuts by parameter count."""
    split, whole = shape.block()
    local_block = math.ceil(split / plan.tp) + whole
    stages, v = plan.pp * plan.virtual, _vocab_split(plan)
    ranges = partition([local_block] * shape.layers, stages, shape.embeddings(v), shape.head(v)) if stages > 1 \
        else [range(shape.layers)]
    per_stage = [len(r) * local_block for r in ranges]
    per_stage[0] += shape.embeddings(v)
    per_stage[-1] += shape.head(v)
    return [sum(per_stage[c * plan.pp + rank] for c in range(plan.virtual)) for rank in range(plan.pp)]


def model_states(psi: int, plan: ParallelPlan, precision: str = "fp32") -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state for ``psi`` local parameters under ``plan``'s data mode."""
    w, g, o, _ = layout(precision)
    n = plan.dp if plan.data.is_zero else 1
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


def activations(shape: ModelShape, plan: ParallelPlan, blocks: float, in_flight: int, act_bytes: int = 2) -> float:
    """Bytes saved for backward on a rank holding ``blocks`` blocks with ``in_flight`` microbatches alive."""
    s, h, a, t = shape.seq, shape.hidden, shape.heads, plan.tp
    b = shape.batch / shape.accumulate / (plan.microbatches or 1)  # alive at once: one microbatch of one micro-step
    scores = 0 if shape.flash_attention else 5 * a * s / h
    if plan.ac:
        per_block = 2 * s * b * h
    elif plan.sp:
        per_block = s * b * h / t * (34 + scores)
    else:
        per_block = s * b * h * (10 + 24 / t + scores / t)
    return per_block * act_bytes / 2 * blocks * in_flight


def data_parallel_bytes(psi: int, plan: ParallelPlan, kept: int = 0) -> dict[str, float]:
    """Bytes rank 0 sends per optimizer step on the dp axis for ``psi`` local fp32 parameters. ``kept``:
    parameters of ZeRO-3's last unit in forward order, which stays gathered into backward. Under pp,
    ZeRO-3 gathers each unit again for every microbatch's forward and backward (why DeepSpeed does not
    allow the two together): counted as 2·m gathers, less the kept unit's m (within a few % measured)."""
    n = plan.dp
    if n == 1:
        return {}

    def padded(count: int) -> int:
        return math.ceil(count / n) * n * 4

    if plan.data is DataMode.DP:
        return {"all_reduce/dp": 2 * (n - 1) / n * psi * 4}
    if plan.data is DataMode.NAIVE:
        return {"send/dp": (n - 1) * psi * 4}  # rank 0 is the parameter server
    m = plan.microbatches if plan.pp > 1 else 1
    gathered = 2 * m * padded(psi) - m * padded(kept) if plan.data.stage == 3 else padded(psi)
    return {"reduce_scatter/dp": (n - 1) / n * padded(psi), "all_gather/dp": (n - 1) / n * gathered}


def communication(shape: ModelShape, plan: ParallelPlan, psi: int, blocks: float, kept: int = 0) -> dict[str, float]:
    """Bytes rank 0 sends per optimizer step, by ``kind/axis`` (fp32 gradients and activations)."""
    out = data_parallel_bytes(psi, plan, kept)
    t = plan.tp
    if t > 1:
        activation = shape.batch * shape.seq * shape.hidden * 4  # the step's b·s·h, over all microbatches
        if plan.sp:  # + entering the region (backward) and leaving it (forward): stage 0 only enters under pp
            out["all_gather/tp"] = (t - 1) / t * activation * (4 * blocks + (2 if plan.pp == 1 else 1))
            out["reduce_scatter/tp"] = (t - 1) / t * activation * 4 * blocks
        else:
            out["all_reduce/tp"] = 2 * (t - 1) / t * activation * (5 if plan.ac else 4) * blocks
        if plan.vp:  # the embedding's partial sums forward; with the head, its input's gradient and the loss's
            # max and (sum of exp, target logit): one value per token each
            tokens = shape.batch * shape.seq * 4
            vocab = activation + (activation + 3 * tokens if plan.pp == 1 else 0)
            out["all_reduce/tp"] = out.get("all_reduce/tp", 0.0) + 2 * (t - 1) / t * vocab
    if plan.pp > 1:  # rank 0 sends activations on from each of its v chunks, gradients back from v-1 of them
        out["send/pp"] = (2 * plan.virtual - 1) * shape.batch * shape.seq * shape.hidden * 4 / (t if plan.sp else 1)
    return out


def estimate(shape: ModelShape, plan: ParallelPlan | str, world_size: int, precision: str = "fp32",
             act_bytes: int | None = None) -> Estimate:
    """Predict ``plan`` at ``world_size`` for ``shape`` under Lightning's ``precision``. ``act_bytes``: bytes per
    activation element (default: the precision's, 4 or 2)."""
    plan = (ParallelPlan.parse(plan) if isinstance(plan, str) else plan).resolve(world_size)
    if shape.heads % plan.tp:
        raise ValueError(f"{shape.heads} heads do not divide by tp = {plan.tp}")
    act_bytes = act_bytes or layout(precision)[3]
    per_rank = stage_params(shape, plan)
    stages = plan.pp * plan.virtual
    ranges = partition([1] * shape.layers, stages) if stages > 1 else [range(shape.layers)]
    table = schedules.build(plan.schedule.value, plan.pp, plan.microbatches, plan.virtual) if plan.pp > 1 else None
    memory = []
    for rank, psi in enumerate(per_rank):
        blocks = sum(len(ranges[c * plan.pp + rank]) for c in range(plan.virtual))
        in_flight = schedules.peak_in_flight(table[rank]) / plan.virtual if table else 1
        states = model_states(psi, plan, precision)
        states["activations"] = activations(shape, plan, blocks, in_flight, act_bytes)
        memory.append(states)
    first_blocks = sum(len(ranges[c * plan.pp]) for c in range(plan.virtual))
    split, whole = shape.block()
    # ZeRO-3 keeps rank 0's last unit in forward order gathered: the head, or under pp its last block.
    kept = shape.head(_vocab_split(plan)) - 2 * shape.hidden if plan.pp == 1 \
        else math.ceil(split / plan.tp) + whole
    comm = communication(shape, plan, per_rank[0], first_blocks, kept)
    bubble = schedules.ideal_bubble(plan.pp, plan.microbatches, plan.virtual) if plan.pp > 1 else 0.0
    return Estimate(str(plan), memory, comm, bubble, per_rank)



# -- a run's prediction, as the run store keeps it ---------------------------------------------------------


def predict_run(label: str, world_size: int, model: dict, global_batch: int, accumulate: int = 1,
                precision: str = "32-true") -> dict | None:
    """What the estimator predicts for a run of ``label`` (a plan, or a strategy `equivalents` names that does the
    same as a plan): per-rank memory by category (in rank order), rank 0's bytes per step, the bubble. None when
    the label has no plan equivalent or the model config is not a transformer's."""
    text = equivalent_plan(label) or label
    try:
        plan = ParallelPlan.parse(text).resolve(world_size)
        shape = dataclasses.replace(ModelShape.from_config(model, batch=global_batch // plan.dp * accumulate),
                                    accumulate=accumulate)
        est = estimate(shape, plan, world_size, precision)
    except (KeyError, ValueError):
        return None
    per_rank = [est.memory[plan.coordinates(rank)["pp"]] for rank in range(world_size)]
    return {"plan": est.plan, "memory": per_rank, "comm": est.comm, "bubble": est.bubble,
            "model_states": [sum(m[k] for k in MODEL_STATE) for m in per_rank]}
