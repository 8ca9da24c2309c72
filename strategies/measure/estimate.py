"""What a plan should cost, before running it: memory per rank by category, bytes per step per axis, bubble.

The model is a decoder-only transformer (`ModelShape`): embeddings, ``layers`` blocks, a final norm and an untied
head. Two block families: the demo GPT's (fused qkv + projection, a 4x GELU MLP, LayerNorms, biases) and Hugging
Face's Llama family (Llama, Qwen2, Mistral: q, k, v and o with grouped keys, a gated SiLU MLP, RMSNorms computed in
float32, rotary positions), each counted as built, so the model-state figures are exact for both. For a model given
only by its parameter count the blocks get what the embeddings and head leave.

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
- The optimizer's step (`optimizer_step_bytes`), where every gradient is back beside the states: Adam's square roots,
  for all the parameters at once under torch's foreach kernels (CUDA's default), or one tensor at a time (CPU); the
  rank's peak when its activations are small beside its parameters (a first stage holding a large embedding).
- With one data-parallel rank (``dp1``) the gradients are autograd's own, freed by zero_grad and made again by the
  step's backwards; with more, they stay in their buckets or shards between steps.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from strategies.measure.peak import GLOO, Chunk, Peak, Pieces, Rules, Workspace, step_actions, walk
from strategies.pipeline import messages, schedules
from strategies.pipeline.cuts import partition
from strategies.pipeline.schedules import Action, Phase
from strategies.plan import DataMode, ParallelPlan, PipelineSchedule
from strategies.sizes import DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_BYTES, IN_FLIGHT, pieces

# Lightning's precision -> bytes per parameter of weights, gradients, Adam's state, and per activation element.
FAMILIES = ("gpt", "llama")  # `ModelShape.family`
LLAMA_TYPES = ("llama", "qwen2", "mistral")  # Hugging Face model types of the "llama" family
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")  # ... and their mixture-of-experts kin
PRECISIONS = {"32-true": (4, 4, 8, 4), "bf16-mixed": (4, 4, 8, 2), "16-mixed": (4, 4, 8, 2),
              "bf16-true": (2, 2, 4, 2), "16-true": (2, 2, 4, 2)}
_ALIASES = {"fp32": "32-true", "32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}  # as Lightning reads them
DEFAULT_PRECISION = "bf16-mixed"  # what `stratpack plan` assumes: what a GPU run usually asks for
BUCKET = DEFAULT_BUCKET_CAP_MB * 2**20  # DDP's buckets, which ZeRO-1/2's flats follow
# The optimizer -> its state per parameter, in Adam's two moments (the third figure of `PRECISIONS`): SGD with
# momentum keeps one buffer, plain SGD none.
OPTIMIZERS = {"adamw": 1.0, "adam": 1.0, "sgd": 0.5, "sgd-plain": 0.0}


PARAM_DTYPE = "+param_dtype"  # after a *-mixed precision: the strategy's param_dtype too (`mixed_precision.ParamDtype`)


def with_param_dtype(precision: str, on: bool = True) -> str:
    """``precision`` as the estimator reads it when the strategy computes with half copies of every weight (``on``):
    the same bytes per parameter, the residual stream in the half dtype."""
    name = _ALIASES.get(str(precision), str(precision))
    if on and not name.endswith("-mixed"):
        raise ValueError(f"param_dtype needs a *-mixed precision (bf16-mixed, 16-mixed), got {precision!r}")
    return name + PARAM_DTYPE if on else str(precision)


def _policy(precision: str) -> tuple[str, bool]:
    """(Lightning's precision, whether param_dtype is on) of an estimator's precision (`with_param_dtype`)."""
    name = str(precision)
    return (name[: -len(PARAM_DTYPE)], True) if name.endswith(PARAM_DTYPE) else (name, False)


def layout(precision: str) -> tuple[int, int, int, int]:
    """Bytes per parameter (weights, gradients, optimizer) and per activation under Lightning's ``precision``."""
    precision = _policy(precision)[0]
    name = _ALIASES.get(str(precision), str(precision))
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[name]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer: sizes, and the samples per microbatch... per data-parallel rank.

    ``family`` is the block: ``"gpt"`` the demo's (LayerNorm, fused qkv, a 4h GELU MLP, biases, learned positions),
    ``"llama"`` Hugging Face's Llama, Qwen2 and Mistral (RMSNorm, separate q, k and v with ``kv_heads`` grouped key
    heads, a gated SiLU MLP ``ffn`` wide, rotary positions, no biases but Qwen2's on q, k and v: ``qkv_bias``)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch: int = 1  # samples per data-parallel rank per optimizer step (all microbatches and accumulation steps)
    accumulate: int = 1  # accumulation steps the batch is run in, one after the other (activations: one at a time)
    params: int | None = None  # total parameters, when known (else counted from the sizes)
    flash_attention: bool = True  # no s x s score matrix kept for backward (SDPA / flash)
    family: str = "gpt"
    ffn: int = 0  # the MLP's width (0: 4 x hidden)
    kv_heads: int = 0  # key and value heads (0: as many as ``heads``)
    qkv_bias: bool = False  # the Llama family's q, k and v have biases (Qwen2)
    experts: int = 0  # routed experts in each block's mixture-of-experts MLP (0: a dense MLP)
    top_k: int = 0  # experts each token is sent to
    expert_ffn: int = 0  # each expert's MLP width (0: 4 x hidden)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")

    @property
    def llama(self) -> bool:
        return self.family == "llama"

    def mlp(self) -> int:
        """The MLP's width; a mixture of experts': the widths a token runs through (top_k experts')."""
        if self.experts:
            return self.top_k * (self.expert_ffn or 4 * self.hidden)
        return self.ffn or 4 * self.hidden

    def expert_params(self) -> int:
        """Parameters of one block's experts, all of them (0 for a dense MLP): each the family's MLP without biases
        (fused weights: the demo's fc and proj, the Llama family's gate, up and down)."""
        width = self.expert_ffn or 4 * self.hidden
        return self.experts * (3 if self.llama else 2) * self.hidden * width

    def groups(self) -> float:
        """Key (and value) heads per query head: 1, or less with grouped keys."""
        return (self.kv_heads or self.heads) / self.heads

    def norm(self) -> int:
        """Parameters of one norm: a LayerNorm's weight and bias, an RMSNorm's weight."""
        return self.hidden if self.llama else 2 * self.hidden

    def block(self) -> tuple[int, int]:
        """Parameters of one block: (split by tp, kept whole)."""
        h = self.hidden
        whole = 2 * self.norm() + (0 if self.llama else 2 * h)  # the norms, and the demo's row-parallel biases
        if self.params is not None:
            per_block = max(0, (self.params - self.embeddings() - self.head())) // self.layers
            return per_block - whole, whole
        if self.experts:  # the experts apart (`expert_params`, split by ep); the router whole on every tp rank; the
            return self._attention(), whole + h * self.experts - (0 if self.llama else h)  # experts have no bias
        if self.llama:  # + gate, up and down h·ffn each
            return self._attention() + 3 * h * self.mlp(), whole
        return self._attention() + 2 * h * self.mlp() + self.mlp(), whole  # + fc 4h²+4h, proj 4h²

    def _attention(self) -> int:
        """The attention's split parameters: q and o h², k and v g·h² each (Llama); the demo's qkv 3h²+3h, proj h²."""
        h = self.hidden
        if self.llama:
            kv = round(self.groups() * h)
            return 2 * h * h + 2 * kv * h + (h + 2 * kv if self.qkv_bias else 0)
        return 4 * h * h + 3 * h

    def embeddings(self, vocab_split: int = 1) -> int:
        """Token (and learned position) embeddings; ``vocab_split``: the ranks the vocabulary is split over ('vp')."""
        return (self.vocab // vocab_split + (0 if self.llama else self.seq)) * self.hidden

    def head(self, vocab_split: int = 1) -> int:
        """The final norm and the output layer (weight, and the demo's bias), its vocabulary split over
        ``vocab_split``."""
        return self.norm() + (self.vocab * self.hidden + (0 if self.llama else self.vocab)) // vocab_split

    def output_layer(self, vocab_split: int = 1, bias: bool = True) -> int:
        """The output layer: its weight, and with ``bias`` the demo's bias (ZeRO-3's unit at the loss), its vocabulary
        split over ``vocab_split``; without it the weight alone (its gradient, autocast's copy of it)."""
        return self.head(vocab_split) - self.norm() if bias else self.vocab // vocab_split * self.hidden

    def active(self) -> int:
        """The parameters a token runs through: all but the experts it was not sent to."""
        unused = self.expert_params() * (self.experts - self.top_k) // self.experts if self.experts else 0
        return self.total() - self.layers * unused

    def total(self) -> int:
        split, whole = self.block()
        if self.params is not None:
            return self.params
        return self.embeddings() + self.head() + self.layers * (split + whole + self.expert_params())

    @classmethod
    def from_config(cls, config: dict, batch: int = 1) -> ModelShape:
        """From a model config: the demo's GPTConfig fields, or Hugging Face names (the Llama family by its
        ``model_type``, `LLAMA_TYPES`; another, GPT-2's included, is taken as the demo's block)."""
        def get(*names: str) -> int:
            for name in names:
                if name in config:
                    return int(config[name])
            raise KeyError(f"the config has none of {names}")

        shape = cls(layers=get("n_layer", "num_hidden_layers"), hidden=get("n_embd", "hidden_size"),
                    heads=get("n_head", "num_attention_heads"), seq=get("seq_len", "max_position_embeddings"),
                    vocab=get("vocab_size"), batch=batch)
        experts = int(config.get("n_experts") or config.get("num_local_experts") or config.get("num_experts") or 0)
        if experts:
            top_k = int(config.get("top_k") or config.get("num_experts_per_tok") or 2)
            width = int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 0)
            shape = dataclasses.replace(shape, experts=experts, top_k=top_k, expert_ffn=width)
        if config.get("model_type") not in LLAMA_TYPES + MOE_TYPES:
            return shape
        return dataclasses.replace(shape, family="llama", ffn=get("intermediate_size"),
                                   kv_heads=int(config.get("num_key_value_heads") or shape.heads),
                                   qkv_bias=config["model_type"] in ("qwen2", "qwen2_moe")
                                   or bool(config.get("attention_bias")))

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
    return _per_rank(plan, _stages(shape, plan)[1])


def stage_blocks(shape: ModelShape, plan: ParallelPlan) -> list[int]:
    """Blocks each pipeline rank runs (over its chunks), as the cut and the schedule place them."""
    return _per_rank(plan, [len(r) for r in _stages(shape, plan)[0]])


def _per_rank(plan: ParallelPlan, per_stage: list[int]) -> list[int]:
    """A figure per stage summed over the stages each pipeline rank holds (`_placement`)."""
    where = _placement(plan)
    return [sum(n for s, n in enumerate(per_stage) if where[s] == rank) for rank in range(plan.pp)]


def _last_rank(plan: ParallelPlan) -> int:
    """The pipeline rank that holds the last stage (the head): the last, or the first where a V places it."""
    return _placement(plan)[plan.pp * plan.chunks - 1]


def stage_flops(shape: ModelShape, plan: ParallelPlan) -> list[float]:
    """Training FLOPs per token each pipeline rank runs: its blocks' share of 6 x active parameters and attention's
    scores (the embedding's lookup counted with the blocks), and the output layer's 6 x h x V where the last stage
    is (on the last rank, or on the first where a V places it)."""
    if plan.pp == 1:
        return [6 * shape.active() + 12 * shape.layers * shape.hidden * shape.seq]
    head = 6 * shape.vocab * shape.hidden
    block = (6 * shape.active() - head) / shape.layers + 12 * shape.hidden * shape.seq
    return [n * block + (head if rank == _last_rank(plan) else 0) for rank, n in enumerate(stage_blocks(shape, plan))]


def attention_share(shape: ModelShape) -> float:
    """Of a block's FLOPs (`stage_flops`' block), attention's scores and their product with the values."""
    scores = 12 * shape.hidden * shape.seq
    return scores / ((6 * shape.active() - 6 * shape.vocab * shape.hidden) / shape.layers + scores)


def stage_experts(shape: ModelShape, plan: ParallelPlan) -> list[int]:
    """Of `stage_params`, the experts' (1/ep of each of its blocks' experts), per pipeline rank."""
    return [blocks * expert_share(shape, plan) for blocks in stage_blocks(shape, plan)]


def expert_share(shape: ModelShape, plan: ParallelPlan) -> int:
    """The experts' parameters of one block on one rank: E/ep experts (whole on every tp rank)."""
    return shape.expert_params() // plan.ep


def _stages(shape: ModelShape, plan: ParallelPlan) -> tuple[list[range], list[int]]:
    """Each stage's blocks and its local parameters (all ``pp * v`` stages, in order)."""
    split, whole = shape.block()
    local_block = math.ceil(split / plan.tp) + whole + expert_share(shape, plan)
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


def model_states(psi: int, plan: ParallelPlan, precision: str = "fp32", optimizer: str = "adamw",
                 experts: int = 0) -> dict[str, float]:
    """Bytes of weights, gradients and ``optimizer`` state for ``psi`` local parameters under ``plan``'s data mode;
    ``experts`` of them expert parallel's, which ZeRO shards over the ranks holding the same experts (dp x cp / ep)."""
    w, g, o, _ = layout(precision)
    o = o * optimizer_share(optimizer)
    n = plan.data_ranks if plan.data.is_zero else 1
    stage = plan.data.stage if plan.data.is_zero else 0
    # ZeRO pads each flat to a multiple of N: at most N-1 elements more
    shard = math.ceil((psi - experts) / n) + math.ceil(experts / max(1, n // plan.ep))
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
                backend: str = "nccl", wide_bytes: float | None = None, policy: bool = False) -> Pieces:
    """The bytes of one microbatch's step on a rank (`peak.Pieces`; the counts are in the module docstring there).
    ``wide_bytes``: of an element of the residual stream and of the loss's input (default ``act_bytes``). Under
    autocast (``*-mixed``) they stay in the weights' float32 while the matmuls' outputs are half: each norm keeps its
    float32 input and each matmul a half copy of the norm's output (found by rehearsing, `stratpack rehearse`).
    ``policy``: the strategy's param_dtype: the stream in ``wide_bytes`` (autocast's dtype), a norm's output too, so
    the matmuls share it; the loss still float32."""
    s, h, t = shape.seq / plan.cp, shape.hidden, plan.tp  # cp: this rank's part of each sequence
    b = microbatch_samples(shape, plan)  # alive at once: one microbatch of one micro-step
    u = b * s * h * act_bytes
    wide = wide_bytes or act_bytes
    boundary = u * wide / act_bytes / (t if plan.sp else 1)  # the residual stream's
    saved = _block_saved(shape, plan, b * s * h, act_bytes, wide, wide_bytes is not None and not policy,
                         policy and backend != GLOO)
    whole, f = saved.whole, shape.mlp() / h
    # the log-softmax's output, in float32 for Hugging Face's loss (which casts the logits up) and autocast's, else
    # the stream's dtype
    logits = b * s * shape.vocab * (4 if shape.llama or policy else wide) / _vocab_split(plan)
    split, kept = shape.block()
    gathered = act_bytes if policy else weight_bytes  # ZeRO-3's block gathered: half under param_dtype (`stage3`)
    unit = (math.ceil(split / t) + kept) * gathered if plan.data.stage == 3 else 0.0
    # Recompute makes a block's activations again but not its output (the residual add, which it drops).
    # Half logits cast up to float32 (by autocast for the cross-entropy, by Hugging Face's loss): at the loss's forward
    # both beside the log-softmax
    half = wide_bytes is not None or (shape.llama and act_bytes < 4)
    loss = logits + b * s * shape.vocab * act_bytes / _vocab_split(plan) if half else logits
    # sac keeps every second matmul's and attention's outputs too (a row-parallel one among them, which no block keeps
    # otherwise) and makes the rest again (ac<N>: counted here as ac, each rank's blocks then by `_one_in`)
    block = boundary + saved.matmuls if plan.sac else boundary if plan.ac else whole
    return Pieces(boundary=boundary, block=block,
                  recompute=whole + saved.unkept - block if plan.sac else whole - boundary if plan.ac else 0.0,
                  embedding=boundary, head=saved.norm_extra + u + logits, logits=logits, loss=loss,
                  # incoming gradient (gathered whole under sp), the MLP's input gradient; one weight's gradient
                  backward=boundary + (u if plan.sp else 0.0) + f * u / t + _async_piece_bytes(plan, s, u, f),
                  weight=h * shape.mlp() / t * weight_bytes, mlp_grad=f * u / t, mlp_saved=saved.mlp,
                  unit=unit, gathers=unit if backend == GLOO else 0.0,
                  head_unit=shape.output_layer(_vocab_split(plan)) * gathered if unit else 0.0,
                  vocab_grad=shape.output_layer(_vocab_split(plan), bias=False) * weight_bytes,  # (the weights' dtype)
                  stash=saved.stash if plan.schedule.splits_backward else 0.0)


def async_pieces(seq: float, plan: ParallelPlan) -> int:
    """The pieces async TP cuts a rank's part of each sequence into (``seq``: a cp rank's), as the layers do."""
    return pieces(max(int(seq // plan.tp), 1), plan.tp)


def _async_piece_bytes(plan: ParallelPlan, seq: float, u: float, f: float) -> float:
    """What async TP's row layer holds beside sp's in its backward (`tensor_parallel.overlap`): two pieces of the
    output's gradient in flight (the one used, the next) and one piece's input gradient before it is put in place."""
    return (2 * u + f * u / plan.tp) / async_pieces(seq, plan) if plan.async_tp else 0.0


@dataclass(frozen=True)
class _Saved:
    whole: float  # what one block saves for backward
    matmuls: float  # what ``sac`` keeps beside the block's input: every second matmul's and fused attention's outputs
    unkept: float  # of those, what ``whole`` does not hold (a row-parallel linear's output)
    norm_extra: float  # what a norm saves beyond its input (the final norm's, with the head)
    stash: float  # what a split backward's B keeps for W
    mlp: float = 0.0  # of ``whole``, what the MLP saves: its norm's input, its input's copy, its inner outputs


def _block_saved(shape: ModelShape, plan: ParallelPlan, bsh: float, act: float, wide: float, mixed: bool,
                 cast_norm: bool = False) -> _Saved:
    """What one block saves with one microbatch's ``bsh`` hidden elements (``act``, ``wide``: bytes of a matmul's
    output and of the residual stream's element), counted tensor by tensor (`stratpack rehearse` finds the same)."""
    t, u, g, f = plan.tp, bsh * act, shape.groups(), shape.mlp() / shape.hidden
    # Each norm keeps its input (the stream); Hugging Face's RMSNorm computes in float32: it keeps the input in float32
    # (a copy on half weights) and its normalised output in the weights' dtype. Whole, or 1/t of the sequence under sp.
    # Under param_dtype a LayerNorm's half input is cast up by CUDA's autocast (which computes it in float32): that copy
    # kept (``cast_norm``); a CPU's autocast (gloo's ranks here) computes it in half and keeps its half input.
    norm = (4 + wide) * bsh if shape.llama else (4 if cast_norm else wide) * bsh
    # The column-parallel linears' input (the norm's output, gathered whole under sp): under autocast each linear
    # keeps its own half copy (q, k, v; gate, up: Llama's five; the demo's fused qkv and fc: two), else one is shared.
    casts = (5 if shape.llama else 2) if mixed else 2
    # Split over tp. The demo: qkv 3, attention 1, fc and GELU 4 each. Llama: q (rotated, cast) 1, k and v g each,
    # attention 1, and gate, up, SiLU and their product ffn/h each. Flash attention's row statistic, float32 per head.
    inner = ((2 + 2 * g + 4 * f) if shape.llama else (4 + 2 * f)) * u + 4 * bsh * shape.heads / shape.hidden
    scores = 0.0 if shape.flash_attention else shape.heads * bsh / shape.hidden * shape.seq / plan.cp * act
    whole = 2 * norm / (t if plan.sp else 1) + casts * u + (inner + scores) / t
    # B keeps each block linear's input (the casts whole, attention's output 1/t, the down projection's f/t) and output
    # gradient (the two row-parallel ones whole, the column-parallel ones 1/t: the demo's qkv 3 and fc f, Llama's q 1,
    # k and v g each, gate and up f each), with sp too (gathered). The head's weight gradient is made in B.
    outputs = (1 + 2 * g + 2 * f) if shape.llama else (3 + f)
    # sac: every second matmul's output, the first, third...: Llama's q, v and gate (column-parallel, split) and down
    # (row-parallel, whole: a partial sum), the demo's qkv and fc (split); fused attention's output and row statistic
    # split. Of those, ``whole`` does not hold the row-parallel one's.
    kept, rows = ((1 + g + f), 1) if shape.llama else ((3 + f), 0)
    # Under cp attention is the ring's (`context_parallel.ring`): its own kernel, of batched matmuls sac does not
    # keep, so its output is made again with the ring's messages (a rehearsal of Llama 3 70B's zero1_cp2_pp32_dualpipev
    # sac on rank 0: 8% under the estimate when counted kept)
    attention = (u + 4 * bsh * shape.heads / shape.hidden) / t if shape.flash_attention and plan.cp == 1 else 0.0
    # The MLP's share: its norm's input, its column-parallel inputs' copy (the demo's fc; Llama's gate and up under
    # autocast), and its inner outputs (the demo's fc and GELU; Llama's gate, up, SiLU and their product)
    mlp = norm / (t if plan.sp else 1) + ((2 if shape.llama else 1) if mixed else 1) * u + \
        (4 if shape.llama else 2) * f * u / t
    return _Saved(whole, kept * u / t + attention + rows * u, rows * u, norm - wide * bsh,
                  (casts + 2) * u + (1 + f + outputs) * u / t, mlp)


def _chunk(plan: ParallelPlan, psi: int, blocks: int, stage: int, stages: int, grad_bytes: float, backend: str,
           held: bool, flat: float | None = None) -> Chunk:
    """A chunk of ``psi`` local parameters: the gradients kept whole in ``param.grad`` across the step's backwards
    that are not its last (``held``: naive, ZeRO-2/3; `dp` and ZeRO-1 accumulate in their buffers), and what the last
    one's reduction holds beyond them: ZeRO's reduce-scatter output shard and, on gloo, a copy of its input flat
    plus 1/N of it (measured; an all-reduce holds 1/N); naive's flat message, and the server's incoming one.
    ``flat``: the bytes ZeRO-1/2's last backward reduces, where not the chunk's own (`_bucket_spans`)."""
    grads, n = psi * grad_bytes, plan.data_ranks
    zero = {"reduce": 0.0}
    if n > 1 and plan.data.is_zero:
        zero = _zero_reduction(plan, grads, blocks, backend, held, flat)
    elif n > 1 and plan.data is DataMode.DP and backend == GLOO:
        zero["reduce"] = min(grads, BUCKET) / n
    elif n > 1 and plan.data is DataMode.NAIVE:
        zero["reduce"] = 2 * grads
    # autograd's own .grad (`_plain_grads`) is made by the step's first backward, kept or not
    plain = _plain_grads(plan)
    keeps = plan.data is DataMode.NAIVE or plan.data.stage >= 2 or plain
    return Chunk(blocks, stage == 0, stage == stages - 1, grads=grads if (held or plain) and keeps else 0.0,
                 weights=grads if plan.schedule.splits_backward else 0.0, **zero)


def _zero_reduction(plan: ParallelPlan, grads: float, blocks: int, backend: str, held: bool,
                    reduced: float | None = None) -> dict[str, float]:
    """`Chunk`'s terms for ZeRO's reduction of a chunk's ``grads`` bytes (`_chunk`); ``reduced``: its flat's."""
    n = plan.data_ranks
    reduced = grads if reduced is None else reduced
    flat = min(reduced, BUCKET) if plan.data.stage < 3 else grads / max(blocks, 1)
    # ZeRO-3's flats are a block each: as backward ends, the IN_FLIGHT last launched are still reducing, each
    # holding its full gradient (and on gloo its copies), beside the shards already reduced
    behind = min(IN_FLIGHT, max(blocks - 1, 0)) if plan.data.stage == 3 else 0
    copy = (1 + 1 / n) * flat if backend == GLOO else 0.0
    # ... and from its second block on, the block before still reducing: its shard, and on gloo one copy of its
    # flat (seen by tracking every storage through a step: `_behind`)
    in_flight = flat / n + (flat if backend == GLOO else 0.0) if behind else 0.0
    # As its last flat is launched, every gradient is in a flat: the last min(IN_FLIGHT, blocks) still reducing,
    # each with gloo's copy, the rest let go of but for their shards (``reduce``'s grads / n); beside them one unit
    # gathered. `peak._Walk._gradients` counts there the flat filled and ``reduce``, the gradients kept (or made)
    # and ZeRO-3's units with a prefetch: this is the difference, less those units (`peak._values`). ZeRO-2's
    # buckets hold the kept gradients by then (the flats the walk counts).
    kept = grads if (held or _plain_grads(plan)) else 0.0
    settled = min(IN_FLIGHT, blocks) * (flat + copy) - (1 + behind) * flat - behind * copy - kept if behind else \
        -kept if plan.data.stage == 2 else 0.0
    # Where the gradients are made in this backward (not ``held``), at the attention backward of its block
    # ``behind``, the blocks before it still reduce: their full gradients, gloo's copies, their shards made.
    # With reductions larger than a block's activations that is the peak (bf16 activations, fp32 gradients).
    return {"reduce": reduced / n + behind * flat + max(behind, 1) * copy, "in_flight": in_flight,
            "deep": 0.0 if held else behind * (flat + copy + flat / n), "deep_blocks": 0 if held else behind,
            "settled": settled}


def _bucket_spans(plan: ParallelPlan, grads: dict[int, float], actions: Sequence[Action]) -> dict[int, float]:
    """ZeRO-1/2 on a rank of several chunks (``grads``: bytes by stage) whose gradients fit in DDP's first bucket
    and one more: the one flat that spans its chunks is reduced at the end of the last one's last backward, which
    holds it whole (and its copies); the others reduce nothing (`zero1_pp2_interleaved_v2_mb4`@4: -5.8% per chunk).
    Empty where each chunk reduces its own (any real size)."""
    backwards = [a.stage for a in actions if a.phase is not Phase.FORWARD]
    if plan.data.stage not in (1, 2) or plan.data_ranks == 1 or len(grads) < 2 or not backwards or \
            sum(grads.values()) > FIRST_BUCKET_BYTES + BUCKET:
        return {}
    return {s: sum(grads.values()) if s == backwards[-1] else 0.0 for s in grads}


class FlatTiming(NamedTuple):
    """When a reducing backward makes ZeRO-2/3's flats (`_flat_timing`, `peak.Rules`)."""

    after_first: bool = False  # right after the first block's first matmul, at its weight's gradient
    late: bool = False  # the weights' gradients held back to the backward's end ...
    end: bool = False  # ... and every parameter's


def _flat_timing(shape: ModelShape, plan: ParallelPlan, grad_bytes: float, cast: bool, policy: bool) -> FlatTiming:
    """When a reducing backward makes ZeRO-2/3's flats (`FlatTiming`). ZeRO-2's next bucket is made at the first
    gradient the first bucket cannot take: the first matmul's weight's where it does not fit (any real width; the
    bucket also has a bias or two norms' weights), else past the MLP. ZeRO-3's block flat there too, but where a
    row-parallel bias is added outside the matmul (tp on a model with biases): its gradient makes the flat before.
    Copies shared by the microbatches (autocast under pp: `mixed_precision`) hold back their weights' gradients:
    autograd runs their backward, the oldest nodes, last; under the policy every parameter's."""
    late = plan.pp > 1 and cast
    if plan.data.stage == 2:
        first = (shape.hidden * shape.mlp() / plan.tp + 2 * shape.hidden) * grad_bytes >= FIRST_BUCKET_BYTES
    else:
        first = plan.data.stage == 3 and not (plan.tp > 1 and not shape.llama)
    return FlatTiming(first and not late, late, late and policy)


def _rules(plan: ParallelPlan, rank: int, states: dict[str, float], chunk_grads: list[float], blocks: int,
           rounds: bool = False, early: bool = False, timing: FlatTiming = FlatTiming(), spans: bool = False) -> Rules:
    """How ``plan``'s step frees and keeps gradients and messages (`peak.Rules`) on pipeline ``rank``, with these
    model ``states`` and chunks (their gradients' bytes; ``blocks`` blocks in all); ``rounds``: every program grouped
    in rounds (a crowded host: `messages.crowded`); ``early``: every receive posted at the first
    (`messages.posts_early`); ``timing``: when the flats are made (`_flat_timing`); ``spans``: one bucket after
    the first spans the rank's chunks (`_bucket_spans`)."""
    n = plan.data_ranks
    naive = plan.data is DataMode.NAIVE and n > 1
    # naive's flat, one data rank's plain .grad and ZeRO-2/3's shards are the optimizer's .grad: the strategy frees
    # them as a step begins, before its forward (`steps.frees_grads_early`, where Lightning's zero_grad is not
    # customised; Lightning's own would come after training_step), under pp too.
    release = states["grads"] if naive or _plain_grads(plan) or plan.data.stage >= 2 else 0.0
    # ZeRO-2/3 make a flat's full gradient when its first parameter's gradient arrives in the reducing backward,
    # beside the .grad not yet moved into it: ZeRO-2's flats follow DDP's buckets over all of the rank's chunks (the
    # first one at most FIRST_BUCKET_BYTES), ZeRO-3's are one per block. Each is made whole at its first gradient:
    # in ZeRO-2's first block the first bucket, and the next if that block's gradients overflow it (its full size).
    flats = 0.0
    if n > 1 and plan.data.stage == 2:
        overflow = sum(chunk_grads) / max(blocks, 1) > FIRST_BUCKET_BYTES or spans
        flats = min(sum(chunk_grads), FIRST_BUCKET_BYTES + (BUCKET if overflow else 0))
    elif n > 1 and plan.data.stage == 3:
        flats = sum(chunk_grads) / max(blocks, 1)
    held = _held_ahead(plan.schedule.value, plan.pp, plan.microbatches, plan.virtual, rounds, early, plan.group) \
        if plan.pp > 1 else None
    first_bucket = min(flats, FIRST_BUCKET_BYTES) if plan.data.stage < 3 else 0.0
    zero2 = plan.data.stage == 2
    return Rules(release=release, release_at_start=True, flats=flats, flats_early=first_bucket,
                 flats_next=flats - first_bucket if timing.after_first else 0.0,
                 moves=(zero2 and not timing.late) or (plan.data.stage == 3 and timing.after_first),
                 flats_end=zero2 and timing.end, spans=zero2 and spans, early=held[rank] if held else ())


def _plain_grads(plan: ParallelPlan) -> bool:
    """With one data-parallel rank there are no buckets or shards (`gradient_sync`): .grad is autograd's own, which
    zero_grad frees (under pp before the first action, as naive's flat) and the step's first backward makes again."""
    return plan.data_ranks == 1 and not plan.offload and plan.data is not DataMode.NAIVE


def data_parallel_bytes(psi: int, plan: ParallelPlan, kept: int = 0, experts: int = 0,
                        gather_bytes: int = 4) -> dict[str, float]:
    """`dense_parallel_bytes` for the ``psi - experts`` parameters reduced over the data ranks, and the same for the
    ``experts`` over the ranks that hold the same experts (the ``edp`` axis: dp x cp / ep ranks)."""
    out = dense_parallel_bytes(psi - experts, plan, kept, gather_bytes)
    if experts and plan.expert_data_ranks > 1:
        ranks = plan.expert_data_ranks
        alone = dataclasses.replace(plan, dp=ranks, cp=1, ep=1)
        out.update({f"{key.split('/')[0]}/edp": value
                    for key, value in dense_parallel_bytes(experts, alone, gather_bytes=gather_bytes).items()})
    return out


def dense_parallel_bytes(psi: int, plan: ParallelPlan, kept: int = 0, gather_bytes: int = 4) -> dict[str, float]:
    """Bytes rank 0 sends per optimizer step over the data group (dp, or dp x cp: `ParallelPlan.data_axis`) for
    ``psi`` local fp32 parameters. ``kept``: parameters of ZeRO-3's last unit in forward order, which stays gathered
    into backward. Under pp, ZeRO-3 gathers each unit again for every microbatch's forward and backward (why
    DeepSpeed does not allow the two together): counted as 2·m gathers, less the kept unit's m (within a few %
    measured). ``gather_bytes``: of an element ZeRO-3 gathers (2 under a half param_dtype: `stage3.Unit`)."""
    n, axis = plan.data_ranks, plan.data_axis
    if n == 1:
        return {}

    def padded(count: int, element: int = 4) -> int:
        return math.ceil(count / n) * n * element

    if plan.data is DataMode.DP:
        return {f"all_reduce/{axis}": 2 * (n - 1) / n * psi * 4}
    if plan.data is DataMode.NAIVE:
        return {f"send/{axis}": (n - 1) * psi * 4}  # rank 0 is the parameter server
    m = plan.microbatches if plan.pp > 1 else 1
    g = gather_bytes
    gathered = 2 * m * padded(psi, g) - m * padded(kept, g) if plan.data.stage == 3 else padded(psi)
    return {f"reduce_scatter/{axis}": (n - 1) / n * padded(psi), f"all_gather/{axis}": (n - 1) / n * gathered}


def communication(shape: ModelShape, plan: ParallelPlan, psi: int, blocks: float, kept: int = 0, act_bytes: int = 4,
                  wide_bytes: int = 4, experts: int = 0, recomputed: float | None = None,
                  gather_bytes: int = 4) -> dict[str, float]:
    """Bytes rank 0 sends per optimizer step, by ``kind/axis``: fp32 gradients; activations in ``act_bytes`` where
    they are a matmul's output (the ring's K/V, tp's row-parallel outputs and their gradients) and in ``wide_bytes``
    where autocast keeps them float32 (the norms' outputs tp gathers or whose gradients it reduces, pp's messages:
    `step_pieces`). ``recomputed``: the share of the ``blocks`` whose forward runs again (default the plan's);
    ``gather_bytes``: ZeRO-3's (`dense_parallel_bytes`)."""
    r, out = _share(plan, recomputed), data_parallel_bytes(psi, plan, kept, experts, gather_bytes)
    if plan.ep > 1:
        out["all_to_all/ep"] = blocks * expert_parallel_bytes(shape, plan, wide_bytes, r)
    t = plan.tp
    elements = shape.batch * shape.seq / plan.cp * shape.hidden  # the step's b·s·h on a rank, all microbatches
    activation = elements * wide_bytes
    if plan.cp > 1:
        for key, nbytes in context_parallel_bytes(shape, plan, blocks, act_bytes, r).items():
            out[key] = out.get(key, 0.0) + nbytes
    if t > 1:
        # Per block forward: the column-parallel layers' inputs (norm outputs: wide) gathered under sp, the
        # row-parallel outputs (act) reduced; backward the conjugates, on the gradients of the same tensors. Recompute
        # runs a block's forward again up to its last saved tensor: both gathers, the first scatter (all-reduce).
        narrow = elements * act_bytes
        if plan.sp:  # + entering the region (backward) and leaving it (forward): stage 0 only enters under pp
            gathers = (2 + 2 * r) * activation + 2 * narrow
            out["all_gather/tp"] = (t - 1) / t * (gathers * blocks + (2 if plan.pp == 1 else 1) * activation)
            out["reduce_scatter/tp"] = (t - 1) / t * ((2 + r) * narrow + 2 * activation) * blocks
        else:  # each column-parallel linear all-reduces its input's gradient: Llama's q, k, v, gate and up
            inputs = 5 if shape.llama else 2
            out["all_reduce/tp"] = 2 * (t - 1) / t * ((2 + r) * narrow + inputs * activation) * blocks
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


def expert_parallel_bytes(shape: ModelShape, plan: ParallelPlan, wide_bytes: int,
                          recomputed: float | None = None) -> float:
    """Bytes an ep rank sends per MoE block and optimizer step, for a balanced router (each token's top_k choices
    spread evenly over the experts; `expert_parallel.cost` for a measured spread). Each forward (again under
    recompute) sends the counts, E/ep int64 to each other rank, and R = tokens x top_k x (ep-1)/ep rows out (the
    norm's output) and R back (the experts' output, added into zeros of the hidden states' dtype): both wide under
    autocast; backward the same rows' gradients the other way."""
    n, calls = plan.ep, (plan.microbatches if plan.pp > 1 else 1) * shape.accumulate
    forwards = 1 + _share(plan, recomputed)
    rows = shape.batch * shape.seq / plan.cp * shape.top_k * (n - 1) / n
    counts = calls * forwards * 8 * (shape.experts // n) * (n - 1)
    return counts + (forwards + 1) * rows * shape.hidden * 2 * wide_bytes


def context_parallel_bytes(shape: ModelShape, plan: ParallelPlan, blocks: float, act_bytes: int,
                           recomputed: float | None = None) -> dict[str, float]:
    """Bytes a cp rank sends per optimizer step: each of its ``blocks`` attentions passes its K and V round the ring
    for every sample, forward and (again under recompute) backward, where the dK/dV accumulators (fp32) go round too
    (`context_parallel.ring.ring_bytes`); and each training_step's loss, averaged over cp (one all-reduce)."""
    n = plan.cp
    local = shape.seq / n * shape.hidden * shape.groups() / plan.tp  # one sample's k (or v) elements on this rank
    forward = (n - 1) * 2 * local * act_bytes
    backward = forward + n * 2 * local * 4
    ring = blocks * shape.batch * ((1 + _share(plan, recomputed)) * forward + backward)
    return {"send/cp": ring, "all_reduce/cp": shape.accumulate * 2 * (n - 1) / n * 4}


def _check_plan(shape: ModelShape, plan: ParallelPlan) -> None:
    """Refuse a plan the estimator cannot predict, saying why."""
    if plan.pp > 1 and plan.schedule is PipelineSchedule.AUTO:
        raise ValueError(f"plan '{plan}' has no pipeline schedule yet: choose one first (`planner.choose_schedule`)")
    if plan.ep > 1 and (not shape.experts or shape.experts % plan.ep):
        raise ValueError(f"ep = {plan.ep} splits the experts, and this model has {shape.experts or 'no'} experts "
                         f"per block{' (a dense model)' if not shape.experts else ', which ep does not divide'}")
    if shape.heads % plan.tp:
        raise ValueError(f"{shape.heads} heads do not divide by tp = {plan.tp}")
    if shape.seq % (2 * plan.cp):
        raise ValueError(f"cp = {plan.cp} cuts each sequence into {2 * plan.cp} chunks, which {shape.seq} tokens do "
                         "not divide into")


def estimate(shape: ModelShape, plan: ParallelPlan | str, world_size: int, precision: str = "fp32",
             act_bytes: int | None = None, backend: str = "nccl", workspace: Workspace = Workspace(),
             crowded: bool = False, optimizer: str = "adamw") -> Estimate:
    """Predict ``plan`` at ``world_size`` for ``shape`` under Lightning's ``precision``. ``act_bytes``: bytes per
    activation element (default: the precision's); ``backend``: the collectives' (``gloo`` holds copies ``nccl`` does
    not); ``workspace``: the kernels' working memory (`peak.Workspace`); ``crowded``: `messages.crowded` (the host's
    ranks); ``optimizer``: whose state is held (`OPTIMIZERS`)."""
    plan = (ParallelPlan.parse(plan) if isinstance(plan, str) else plan).resolve(world_size)
    _check_plan(shape, plan)
    weight_bytes, grad_bytes, _, default_act = layout(precision)
    act_bytes = act_bytes or default_act
    mixed, stream, pieces = _mixed_pieces(shape, plan, precision, act_bytes, weight_bytes, backend)
    ranges, per_stage = _stages(shape, plan)
    memory, where, between = [], [], []
    per_rank, experts = stage_params(shape, plan), stage_experts(shape, plan)
    for rank, psi in enumerate(per_rank):
        states = model_states(psi, plan, precision, optimizer, experts[rank])
        # Autocast's half copies of the weights, saved by the matmuls for backward (under pp held by the cache for
        # the step: `mixed_precision`); none where ZeRO-3 gathers them in half (the matmuls save views of the unit)
        cast_bytes = act_bytes if mixed and not (_policy(precision)[1] and plan.data.stage == 3) else 0
        peak = _rank_peak(shape, plan, rank, states, pieces, (ranges, per_stage), (grad_bytes, cast_bytes), backend,
                          _kernels(shape, plan, workspace), crowded, _policy(precision)[1])
        # What the rank holds at its peak: the gradients kept between steps less what the step had freed by then; or
        # the optimizer's step, where every gradient is back, if that is more.
        step = optimizer_step_bytes(shape, plan, rank, states, weight_bytes, optimizer, backend)
        if step > peak.total:  # (both beside the states)
            memory.append({**states, "activations": 0.0, "temporaries": step})
            where.append("step")
        else:
            memory.append({**states, "grads": states["grads"] - peak.released, "activations": peak.activations,
                           "temporaries": peak.temporaries})
            where.append(peak.at)
        between.append(states)
    bubble = schedules.ideal_bubble(plan.pp, plan.microbatches, plan.virtual, plan.schedule.value, plan.group) \
        if plan.pp > 1 else 0.0
    comm = _rank0_comm(shape, plan, per_rank[0], ranges, act_bytes, stream,
                       act_bytes if _policy(precision)[1] else 4)
    return Estimate(str(plan), memory, comm, bubble, per_rank,
                    peak_at=where, states=between, setup=setup_peaks(shape, plan, memory, precision, True),
                    setup_whole=setup_peaks(shape, plan, memory, precision, False))


def ring_workspace(shape: ModelShape, plan: ParallelPlan) -> float:
    """What ring attention's backward holds beyond its inputs and accumulators (`context_parallel.ring`): its kernel
    makes a (chunk x chunk) float32 matrix per query head for one pair of chunks at a time, the probabilities, the
    gradient through them and their product with the probabilities alive together."""
    chunk = shape.seq / plan.cp / 2
    return 3 * microbatch_samples(shape, plan) * shape.heads / plan.tp * chunk * chunk * 4


def microbatch_samples(shape: ModelShape, plan: ParallelPlan) -> float:
    """Samples in one microbatch of one accumulation micro-step (``shape.batch``: the step's, per data rank)."""
    return shape.batch / shape.accumulate / (plan.microbatches or 1)


def _kernels(shape: ModelShape, plan: ParallelPlan, workspace: Workspace) -> Workspace:
    """``workspace`` with, under cp, the ring's kernel in place of the fused attention's (`ring_workspace`)."""
    return dataclasses.replace(workspace, attention=ring_workspace(shape, plan)) if plan.cp > 1 else workspace


def _mixed_pieces(shape: ModelShape, plan: ParallelPlan, precision: str, act_bytes: int, weight_bytes: int,
                  backend: str) -> tuple[bool, int, Pieces]:
    """Whether ``precision`` autocasts, the residual stream's bytes (float32 under autocast alone, autocast's dtype
    under param_dtype, `with_param_dtype`) and one microbatch's `step_pieces`."""
    lightning, policy = _policy(precision)
    mixed = _ALIASES.get(lightning, lightning).endswith("-mixed")
    stream = weight_bytes if mixed and not policy else act_bytes
    return mixed, stream, step_pieces(shape, plan, act_bytes, weight_bytes, backend, stream if mixed else None, policy)


def optimizer_step_bytes(shape: ModelShape, plan: ParallelPlan, rank: int, states: dict[str, float],
                         weight_bytes: float, optimizer: str, backend: str) -> float:
    """What Adam's step holds beyond the model states on pipeline ``rank`` (AdamW's square roots of the second
    moments): with NCCL (CUDA), torch's default foreach kernels, one temporary as large as all the parameters it
    steps; with gloo (CPU), one tensor at a time, two temporaries as large as the largest. None for SGD (in place),
    nor on the device under offload (the step runs on the host)."""
    if optimizer_share(optimizer) < 1.0 or plan.offload:
        return 0.0
    if backend != GLOO:
        return states["optimizer"] / 2
    t, v, n = plan.tp, _vocab_split(plan), plan.data_ranks if plan.data.is_zero else 1
    mine = [s for s, r in _placement(plan).items() if r == rank]
    last = plan.pp * plan.chunks - 1
    largest = max([shape.hidden * shape.mlp() / t] + [shape.embeddings(v) for s in mine if s == 0] +
                  [shape.head(v) for s in mine if s == last])
    return 2 * math.ceil(largest / n) * weight_bytes


def _rank_peak(shape: ModelShape, plan: ParallelPlan, rank: int, states: dict[str, float], pieces: Pieces,
               stages: tuple[list[range], list[int]], sizes: tuple[float, float], backend: str, workspace: Workspace,
               crowded: bool, policy: bool = False) -> Peak:
    """`peak.walk` of pipeline ``rank``'s step: its chunks of ``stages`` (blocks and parameters of each), its actions
    and the rules its data mode and messages follow; ``sizes``: bytes of a gradient and of autocast's copy of a weight
    (0 without autocast); the rest `estimate`'s arguments."""
    (ranges, per_stage), (grad_bytes, cast_bytes) = stages, sizes
    # a block's weights autocast copies (tp's slice); none under recompute, whose forward saves nothing. The head is
    # not recomputed.
    mine = [s for s, r in _placement(plan).items() if r == rank]
    matmuls = (1 - recomputed_share(plan, [ranges[s] for s in mine])) * math.ceil(shape.block()[0] / plan.tp)
    head = shape.output_layer(_vocab_split(plan), bias=False)
    # Gradients stay whole until the step's last backward when it has several (microbatches, micro-steps).
    held = (plan.pp > 1 and (plan.microbatches or 1) > 1) or shape.accumulate > 1
    # Under pp the copy is made once per step and shared by the microbatches (`mixed_precision`); without, each
    # forward's is freed by its backward.
    copies = {s: cast_bytes * (len(ranges[s]) * matmuls + (head if s == len(ranges) - 1 else 0)) for s in mine}
    table = schedules.shared(plan.schedule.value, plan.pp, plan.microbatches, plan.virtual,
                             plan.group)[rank] if plan.pp > 1 else None
    actions = step_actions(table, shape.accumulate, plan.microbatches or 1)
    grads = {s: per_stage[s] * grad_bytes for s in mine}
    flat = _bucket_spans(plan, grads, actions)
    chunks = {s: dataclasses.replace(_chunk(plan, per_stage[s], len(ranges[s]), s, len(ranges), grad_bytes, backend,
                                            held, flat.get(s)), **{"shared_cast" if plan.pp > 1 else "cast": copies[s]})
              for s in mine}
    rounds, early = crowded and backend == GLOO, messages.posts_early(backend == GLOO)
    rules = _rules(plan, rank, states, list(grads.values()), sum(len(ranges[s]) for s in mine),
                   rounds, early, _flat_timing(shape, plan, grad_bytes, cast_bytes > 0, policy), bool(flat))
    if table is not None and schedules.is_split([table]):  # W's the runner merges into their B (each micro-step)
        fused = schedules.fused_weights(table, schedules.reducing(table), _placement(plan), rounds)
        step = plan.microbatches or 1
        rules = dataclasses.replace(rules, fused=frozenset((s, m + k * step) for s, m in fused
                                                           for k in range(shape.accumulate)))
    # what names the actions and the messages held ahead (`_rules`)
    key = (plan.schedule.value, plan.pp, plan.microbatches, plan.virtual, plan.group, shape.accumulate, rank, rounds,
           early)
    return walk(_one_in(_recast(pieces, shape, plan, cast_bytes), plan, [ranges[s] for s in mine]), chunks, actions,
                workspace, rules, key)


def _recast(pieces: Pieces, shape: ModelShape, plan: ParallelPlan, cast_bytes: float) -> Pieces:
    """``pieces`` with, under recompute and autocast's copies (``cast_bytes`` a weight element's), the block rebuilt
    holding its weights cast again, through its backward (`mixed_precision.uncached` keeps no cast for a recomputed
    block; rehearsed at Llama 3 70B's width, a 1F1B first stage read 5.9% low without them)."""
    if not (plan.recomputed and cast_bytes):
        return pieces
    return dataclasses.replace(pieces, recompute=pieces.recompute + cast_bytes * math.ceil(shape.block()[0] / plan.tp))


def _one_in(pieces: Pieces, plan: ParallelPlan, ranges: list[range]) -> Pieces:
    """``ac<N>`` on a rank whose chunks hold the blocks ``ranges`` (the model's indices): the recomputed ones (one in
    N from the first) keep their input, the others all they save (a mean block); a backward starts with a recompute
    only where a chunk's last block is recomputed (a later one comes after a whole block is freed, a lower point)."""
    if not plan.ac or plan.ac_every == 1 or not any(ranges):
        return pieces
    whole, kept = pieces.block + pieces.recompute, recomputed_share(plan, ranges)
    block = kept * pieces.block + (1 - kept) * whole
    last = any(r and r[-1] % plan.ac_every == 0 for r in ranges)
    return dataclasses.replace(pieces, block=block, recompute=pieces.recompute if last else 0.0)


def _share(plan: ParallelPlan, recomputed: float | None) -> float:
    """``recomputed`` where a caller knows the rank's blocks (`recomputed_share`), else the plan's share."""
    return plan.recomputed if recomputed is None else recomputed


def recomputed_share(plan: ParallelPlan, ranges: list[range]) -> float:
    """Of the blocks in ``ranges`` (the model's indices), the share whose forward runs again in backward: all under
    ``ac`` and ``sac``, under ``ac<N>`` those of index 0, N, 2N, ... (`activation_checkpoint`), none without."""
    blocks = [i for r in ranges for i in r]
    if not plan.ac or plan.ac_every == 1 or not blocks:
        return plan.recomputed
    return sum(1 for i in blocks if i % plan.ac_every == 0) / len(blocks)


def _rank0_comm(shape: ModelShape, plan: ParallelPlan, psi: int, ranges: list[range], act_bytes: int,
                wide_bytes: int, gather_bytes: int = 4) -> dict:
    """`communication` for rank 0, which holds ``psi`` parameters and the blocks of its stages in ``ranges``."""
    first_blocks = _per_rank(plan, [len(r) for r in ranges])[0]
    split, whole = shape.block()
    # ZeRO-3 gathers once per microbatch rank 0's units kept from forward into backward (`Zero3GradSync._keeps`: the
    # final norm and the head where rank 0 holds the last stage, else its last block) and its embeddings (a lookup's
    # backward needs no weights; tp's vocab-parallel token embedding is gathered again)
    lookups = shape.embeddings() - (shape.vocab * shape.hidden if plan.vp else 0)
    kept = (shape.head(_vocab_split(plan)) if _last_rank(plan) == 0 else math.ceil(split / plan.tp) + whole) + lookups
    experts = first_blocks * expert_share(shape, plan)
    share = recomputed_share(plan, [ranges[s] for s, r in _placement(plan).items() if r == 0])
    return communication(shape, plan, psi, first_blocks, kept, act_bytes, wide_bytes, experts, share, gather_bytes)


def _placement(plan: ParallelPlan) -> dict[int, int]:
    """Stage -> pipeline rank, as the plan's schedule places its stages (looped while none is chosen yet)."""
    if plan.pp == 1 or plan.schedule is PipelineSchedule.AUTO:
        return {s: s % plan.pp for s in range(plan.pp * plan.virtual)}
    return _owners(plan.schedule.value, plan.pp, plan.microbatches or 1, plan.virtual, plan.group)


@functools.cache
def _owners(schedule: str, pp: int, microbatches: int, virtual: int, group: int | None) -> dict[int, int]:
    return schedules.owners(schedules.shared(schedule, pp, microbatches, virtual, group))


@functools.cache
def _held_ahead(schedule: str, pp: int, microbatches: int, virtual: int, rounds: bool = False,
                early: bool = False, group: int | None = None) -> tuple[tuple[int, ...], ...] | None:
    """Per rank and action the messages received ahead of use (`messages.held_receives`) by a step shaped as the last
    one, as the runner runs it (`messages.as_run`), for programs grouped in rounds (interleaved, the V schedules; every
    schedule where ``rounds``) or with every receive posted at the first (``early``: `messages.early_receives`); None
    for programs grouped per action, which post each receive just before its use."""
    held = messages.held_ahead(schedules.shared(schedule, pp, microbatches, virtual, group), pp, rounds, early)
    return tuple(tuple(counts) for counts in held) if held else None  # `peak.Rules.early`, made once
