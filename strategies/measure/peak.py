"""What a rank holds at the peak of a training step: its actions walked in order, the memory each one holds.

Model states (`estimate.model_states`) are what a rank keeps between steps. Inside a step it holds more, action by
action: the schedule's table under pipeline parallel, else one forward and one backward per accumulation
micro-step (the accumulation window's micro-steps one after the other, the table once per micro-step under pp):

- **activations** saved for backward, per (chunk, microbatch), from its forward to its backward (`Pieces.saved`),
  counted tensor by tensor for the block the estimator models (`estimate.step_pieces`; the demo GPT's: pre-norm, fused
  qkv, SDPA, a 4h GELU MLP, no dropout masks), in units of one microbatch's hidden states u = b·s·h: per block
  4 + 12/t (two norms' and two residual adds' outputs whole, qkv 3/t, attention 1/t, fc 4/t, GELU 4/t), with sequence
  parallel 2 + 14/t (the two gathered inputs of the column-parallel layers whole, the rest split), with recompute
  (``ac``) only its input; the first chunk also the embedding's output, the last the final norm's output and the
  log-softmax (V/h), and each chunk its input (received from the previous stage: kept until its backward). A stage's
  output is its last block's residual add, counted with that block.
- **temporaries**, the rest beyond the states: the loss's (the logits beside their log-softmax, under autocast the
  half ones too; the gradient of the logits and of the output layer's weight) and a block backward's working set (the
  incoming gradient, the MLP's input gradient, one weight gradient before it is accumulated), the embedding's fresh
  gradient, the block rebuilt by recompute, ZeRO-3's gathered blocks (the current one and the one prefetched; at the
  loss the output layer's and a block's), gradients ZeRO-2/3 keep whole across the backwards of a step that are not
  its last (under pp, or accumulation: they are reduce-scattered only in the last) and, from such a step's second
  block on, the block before still reducing (`_behind`), the messages a
  program in rounds receives ahead of use (the runner lets go of a send once it has completed, before its next action:
  no send is counted as held), and two costs of the machine: the communication backend's working memory (gloo copies a
  reduce-scatter's input and gathers through a buffer the size of the output; NCCL does neither) and the matrix
  library's workspace inside one matmul or the fused attention (`workspace`, measured on CPU by
  `calibrate.linear_workspace` and `attention_workspace`).

Split backwards (the zero-bubble schedules): B frees the chunk's activations but keeps, per block, each linear's input
and output gradient (`Pieces.stash`, 4 + 12/t: as much as a block saves without recompute, so ZB-H1 holds what 1F1B
does; with recompute far more than the block's input) until its W, which makes the chunk's weight gradients at once
and then reduces them as a full backward would. Under ZeRO-2/3 a stage's last B reduces what B finishes (biases,
norms), which makes every flat, block by block: they wait, full, for its last W.

`walk` returns the largest total, its split into activations and temporaries, and the action it happens in.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields

import numpy as np

from strategies.pipeline.schedules import Action, Phase

GLOO = "gloo"


@dataclass(frozen=True)
class Pieces:
    """Bytes of what one microbatch's step is made of on a rank (see the module's docstring)."""

    boundary: float  # a stage's input or output: u, or u/t under sequence parallel
    block: float  # saved for backward per block
    recompute: float  # ac: the activations of one block made again in its backward (0 without ac)
    embedding: float  # saved by the first chunk besides its blocks
    head: float  # saved by the last chunk besides its blocks: the final norm's output, the log-softmax
    logits: float  # one microbatch's logits (this rank's vocabulary slice under vp)
    backward: float  # a block backward's working set at its start: the incoming gradient, the MLP's input gradient
    weight: float = 0.0  # ... and one weight's gradient, made beside them before it is accumulated
    mlp_grad: float = 0.0  # of ``backward``, the MLP's input gradient, freed once its first matmul is done
    mlp_saved: float = 0.0  # of ``block`` (or of ``recompute``), what the MLP saves: freed by its backward
    unit: float = 0.0  # ZeRO-3: one gathered block (0 without ZeRO-3)
    gathers: float = 0.0  # ZeRO-3: what the backend holds while the prefetch gathers (gloo: its output's size)
    stash: float = 0.0  # split backwards: what B keeps per block for W, each linear's input and output gradient
    #                     (the head's weight gradient is made in B: nothing kept for it)
    loss: float | None = None  # the loss's logits beside their log-softmax at the forward's end (default ``logits``;
    #                            under autocast, or in Hugging Face's loss, half logits cast up to float32: both)
    head_unit: float = 0.0  # ZeRO-3: the output layer gathered (its own unit: at the loss, beside the last block's)
    vocab_grad: float = 0.0  # the token embedding's or the output layer's fresh gradient (a vocabulary by the width),
    #                          made whole before it is accumulated: at the end of the first chunk's backward, and of
    #                          the head's beside the logits' gradient

    def saved(self, blocks: int, first: bool, last: bool) -> float:
        """Activations a chunk of ``blocks`` blocks saves for one microbatch: its blocks', its input's (the
        embedding's output, or the received one), and the last chunk's head's. A chunk that passes its output on holds
        it no longer than its send (`pipeline.runner._Output`), and that output is the next chunk's input: one
        boundary less."""
        ends = (self.embedding if first else self.boundary) + (self.head if last else -self.boundary)
        return blocks * self.block + ends

    def stashed(self, blocks: int) -> float:
        """What a split backward (B) of a chunk of ``blocks`` blocks keeps for its W."""
        return blocks * self.stash


@dataclass(frozen=True)
class Workspace:
    """What the kernels hold while they run beyond their outputs (`calibrate`, measured on a CPU; nothing on a GPU
    here): a backward's matmul's, at its block's first (``matmul``), the fused attention's, at the first block's
    attention backward, when that block's MLP has freed what it saved (``attention``), and a W's (``weights``)."""

    matmul: float = 0.0
    attention: float = 0.0
    weights: float = 0.0  # a split backward's W, whose products are the weights' gradients alone


@dataclass(frozen=True)
class Chunk:
    """One of the rank's pipeline chunks (its only one without pp)."""

    blocks: int
    first: bool
    last: bool
    grads: float = 0.0  # gradients its backwards leave in param.grad until the step's last one (ZeRO-2/3)
    reduce: float = 0.0  # what its last backward's reduction holds beyond the gradients (the backend's copies)
    weights: float = 0.0  # split backwards: the gradients W makes at once, before autograd accumulates them
    in_flight: float = 0.0  # ZeRO-3, a chunk of 2+ blocks: in its reducing backward, from the second block on, what
    #                         the block before still holds while it reduces (its shard, gloo's copy of its flat)
    cast: float = 0.0  # under autocast: the half copy of its matmuls' weights each forward makes and its matmuls save
    #                    for backward (not under recompute), until its backward: one per microbatch in flight ...
    shared_cast: float = 0.0  # ... or, made once per step and shared by its microbatches (`mixed_precision`: under
    #                           pp), held from the chunk's first forward to the step's end
    deep: float = 0.0  # ZeRO-3, gradients made in the reducing backward itself: what the blocks before still hold
    deep_blocks: int = 0  # while they reduce, at the attention backward of block ``deep_blocks`` (`estimate._chunk`)
    settled: float = 0.0  # ZeRO-2, and ZeRO-3 in a chunk of 2+ blocks: at its reducing backward's end, what the
    #                       walk's count there holds beyond the run's flats in flight (`estimate._chunk`; ZeRO-3's
    #                       units: `_values`)


@dataclass(frozen=True)
class Peak:
    activations: float
    temporaries: float
    at: str  # the action in which it happens ("B0.1"), or "" for a rank with no actions
    released: float = 0.0  # of the gradients kept between steps, what was already freed then (`walk`'s ``release``)

    @property
    def total(self) -> float:
        return self.activations + self.temporaries - self.released


def step_actions(table: Sequence[Action] | None, accumulate: int, microbatches: int) -> Sequence[Action]:
    """The rank's actions in one optimizer step: its table once per accumulation micro-step (microbatches
    numbered on), or without pp a forward and a backward per micro-step. Read only: the table itself where it is
    run once (the planner asks this for every rank of every plan)."""
    one = table if table is not None else (Action(Phase.FORWARD, 0, 0), Action(Phase.BACKWARD, 0, 0))
    if accumulate == 1:
        return one
    return [Action(a.phase, a.stage, a.microbatch + k * microbatches) for k in range(accumulate) for a in one]


@dataclass(frozen=True)
class Rules:
    """How a plan's step treats its gradients and messages (see `walk`)."""

    release: float = 0.0  # gradients kept between steps that the step frees (naive's flat, ZeRO-2/3's shards) ...
    release_at_start: bool = False  # ... before its first action (the strategy's early zero_grad), else before
    #                                     its first backward (Lightning's own zero_grad, after training_step)
    flats: float = 0.0  # ZeRO-2/3: the full-gradient flat made at the start of the rank's first reducing backward,
    #                     beside the gradients not yet moved into it (freed once the last one has reduced) ...
    flats_early: float = 0.0  # ... of which made before the block's first matmul (ZeRO-2's first bucket, which
    #                            starts at the chunk's last parameters) ...
    flats_next: float = 0.0  # ... and right after it, at its weight's gradient (ZeRO-2's next bucket; ZeRO-3's block
    #                          flat), where that gradient makes it (`estimate._flat_timing`); else ZeRO-3's at the top,
    #                          less the MLP's input gradient gone by then, ZeRO-2's past the MLP (the attention's)
    moves: bool = False  # ZeRO-2/3: a kept gradient moves out of .grad into its flat at its weight's gradient in the
    #                      reducing backward; not where autograd holds the weights' gradients back to its end
    #                      (copies shared by the microbatches: `estimate._flat_timing`) ...
    flats_end: bool = False  # ... and where it holds back every parameter's (the policy's), which makes ZeRO-2's
    #                          buckets only then, each beside the kept gradients it takes
    spans: bool = False  # ZeRO-2's ``flats``: one bucket over all of the rank's chunks (`estimate._bucket_spans`), made
    #                      once, by the first action that makes any (a split stage's last B, or a reducing backward)
    early: tuple[int, ...] = ()  # programs in rounds (`pipeline.messages`) receive ahead of use: per action, the
    #                              messages held for later ones
    fused: frozenset[tuple[int, int]] = frozenset()  # (stage, microbatch) whose W runs inside its B, as one full
    #                                                  backward (`schedules.fused_weights`)


# The walk is linear in a few byte counts (`_GLOBAL`, and `_PER_CHUNK` per chunk): it is run once per structure (a
# rank's actions and messages held ahead, named by `walk`'s ``key``, and its chunks' places) on packed integer
# coefficients (`_compile`), which record each point it compares as a row of coefficients; a plan's peak is then the
# largest row times its byte counts. The planner walks some 30,000 ranks of a few hundred actions each, with about
# 600 structures among them.
# Each quantity is named once, as a field of `_Terms`, and valued once, in `_values`: `_GLOBAL` is the fields that are
# not a chunk's (`_PER_CHUNK`), in their order.
_PER_CHUNK = ("saved", "shared", "stashed", "swap", "grads", "reduce", "weights", "behind_kept", "behind_fresh",
              "deep_held", "deep_freed", "mlp_grads", "moved", "settled", "split_flats")
_WIDTH = 32  # bits per coefficient in a packed row (`_unpack` reads them as 4 bytes): counts stay far below 2**31
_COMPILED: dict[tuple, tuple] = {}


def walk(pieces: Pieces, chunks: dict[int, Chunk], actions: list[Action], workspace: Workspace = Workspace(),
         rules: Rules = Rules(), key: Hashable | None = None) -> Peak:
    """The peak of ``actions`` run in order on a rank whose chunks (by stage) are ``chunks``. ``workspace``: what
    the kernels hold while they run (`Workspace`). ``key``: a name for ``actions``, ``rules.early`` and
    ``rules.fused`` (the same key, the same all three), under which the walk's structure is compiled once."""
    stages = tuple((s, chunks[s].first, chunks[s].last) for s in sorted(chunks))
    compiled = _COMPILED.get((key, stages)) if key is not None else None
    if compiled is None:
        compiled = _compile(stages, actions, rules)
        if key is not None:
            _COMPILED[(key, stages)] = compiled
    total, parts, at = compiled
    values = _values(pieces, chunks, workspace, rules)
    totals = total @ values
    best = int(totals.argmax()) if len(at) else 0
    if not len(at) or totals[best] <= 0.0:
        return Peak(0.0, 0.0, "")
    activations, temporaries, released = (parts[best] @ values).tolist()
    return Peak(activations, temporaries, at[best], released)


def _values(pieces: Pieces, chunks: dict[int, Chunk], workspace: Workspace, rules: Rules) -> np.ndarray:
    """The byte counts the compiled rows multiply, in `_GLOBAL` then `_PER_CHUNK` order (chunks by stage)."""
    p, r = pieces, rules
    named = {"boundary": p.boundary, "recompute": p.recompute, "head": p.head, "logits": p.logits,
             "loss": p.logits if p.loss is None else p.loss, "backward": p.backward, "weight": p.weight,
             "vocab_grad": p.vocab_grad, "workspace": workspace.matmul, "attention": workspace.attention,
             "w_workspace": workspace.weights,
             "mlp_saved": p.mlp_saved, "zero3": 2 * p.unit + p.gathers,
             "head_zero3": p.head_unit + p.unit + p.gathers, "release": r.release,
             "release_start": r.release if r.release_at_start else 0.0, "flats": r.flats,
             # at the top: ZeRO-2's first bucket; ZeRO-3's block flat where nothing makes it later (`Rules`)
             "flats_top": 0.0 if r.flats_end else r.flats_early if r.flats_early else 0.0 if r.flats_next else
             max(r.flats - p.mlp_grad, 0.0),
             "flats_next": r.flats_next - p.mlp_grad if r.flats_next else 0.0,
             "flats_mid": 0.0 if r.flats_end else r.flats, "flats_end": r.flats if r.flats_end else 0.0,
             "span_flats": r.flats if r.spans else 0.0}
    out = [named[name] for name in _GLOBAL]
    for s in sorted(chunks):
        c = chunks[s]
        mine = {"saved": p.saved(c.blocks, c.first, c.last) + c.cast, "shared": c.shared_cast,
                "stashed": p.stashed(c.blocks),
                "swap": (c.blocks - 1) * max(p.stash - p.block, 0.0), "grads": c.grads, "reduce": c.reduce,
                "weights": c.weights, "deep_held": c.deep, "deep_freed": c.deep_blocks * p.block,
                "mlp_grads": 2 * p.weight if c.grads else 0.0,
                "moved": p.weight if c.grads and r.moves else 0.0,
                # one unit gathered there: neither the one prefetched nor the backend's buffer for it
                "settled": c.settled - (p.unit + p.gathers if c.in_flight else 0.0),
                # ZeRO-2/3 under a split schedule: the flats its last B makes for what B finishes (biases, norms: in
                # every block, so every flat), held until its last W fills them
                "split_flats": c.grads if r.flats and not r.spans else 0.0,
                **_behind(p, c, r)}
        out += [mine[name] for name in _PER_CHUNK]
    return np.array(out, dtype=float)


def _behind(p: Pieces, c: Chunk, r: Rules) -> dict[str, float]:
    """A ZeRO-3 chunk's reducing backward at its second block where a backward before kept the gradients whole (pp's
    microbatches, accumulation), beyond the first block's working set (`_Walk.backward`): the block before still
    reducing (``in_flight``) and this block's new flat, less the kept gradients moved out of ``param.grad`` into the
    flat before; one block gathered, no prefetch. Found by tracking every storage through a step of
    `zero3_tp2_pp2_1f1b_ac`@8 (the first block's point was 4.6% under the heap's peak, this one is within 1%); where
    the gradients are made in the reducing backward itself (no pp, no accumulation) the first block's point is the
    peak within 1% (`zero3`@4, `zero3_tp2`@4), so nothing is added there (``behind_fresh``)."""
    if not c.in_flight:
        return {"behind_kept": 0.0, "behind_fresh": 0.0}
    # the first block's activations are freed by then, but for its input (the second's output) where the block counts
    # its outputs; under recompute (ac, sac) a block counts its input, which its backward frees, and the last chunk's
    # final norm has let go of the last block's output (`Pieces.saved`'s boundary)
    freed = (p.block + (p.boundary if c.last else 0.0)) if p.recompute else p.block - p.boundary
    return {"behind_kept": c.in_flight + r.flats - p.unit - p.gathers - freed, "behind_fresh": -r.flats - freed}


def _compile(stages: tuple, actions: list[Action], rules: Rules) -> tuple:
    """Walk ``actions`` on packed coefficients: each distinct point compared, first occurrence kept, as rows of
    total coefficients, of (activations, temporaries, released) coefficients, and the action each is in."""
    unit = {name: 1 << (_WIDTH * i) for i, name in enumerate(_GLOBAL)}
    chunks = {}
    for k, (stage, first, last) in enumerate(stages):
        base = len(_GLOBAL) + k * len(_PER_CHUNK)
        chunks[stage] = _Terms(first=first, last=last,
                               **{n: 1 << (_WIDTH * (base + i)) for i, n in enumerate(_PER_CHUNK)})
    walker = _Walk(_Terms(**unit), actions, rules.fused)
    for index, action in enumerate(actions):
        ahead = walker.q.boundary * rules.early[index % len(rules.early)] if rules.early else 0
        walker.run(action, chunks[action.stage], ahead)
    width = len(_GLOBAL) + len(stages) * len(_PER_CHUNK)
    a, t, r = (_unpack([row[i] for row in walker.rows], width) for i in range(3))
    return a + t - r, np.stack([a, t, r], axis=1), [str(action) for action in walker.rows.values()]


def _unpack(values: list[int], width: int) -> np.ndarray:
    """The ``width`` signed coefficients packed in each of ``values`` (sum of c_i * 2**(_WIDTH * i)), as rows: each
    coefficient is offset by half a field first, so that the fields are read as unsigned bytes with no borrow."""
    offset = sum(1 << (_WIDTH * i + _WIDTH - 1) for i in range(width))
    raw = b"".join((v + offset).to_bytes(width * _WIDTH // 8, "little") for v in values)
    fields = np.frombuffer(raw, dtype="<u4").reshape(len(values), width).astype(float)
    return fields - float(1 << (_WIDTH - 1))


@dataclass
class _Terms:
    """The walk's quantities, each a packed unit (`_compile`): a piece's, or one chunk's."""

    boundary: int = 0
    recompute: int = 0
    head: int = 0
    logits: int = 0
    loss: int = 0
    backward: int = 0
    weight: int = 0
    vocab_grad: int = 0
    workspace: int = 0
    attention: int = 0
    w_workspace: int = 0  # a W's matmuls' (`Workspace.weights`)
    mlp_saved: int = 0
    zero3: int = 0
    head_zero3: int = 0  # ZeRO-3's units at the loss: the output layer's and a block's
    release: int = 0
    release_start: int = 0  # what is released before the first action: ``release`` or nothing
    flats: int = 0
    flats_top: int = 0  # what the flats add to their backward's top (`Rules.flats_early`, ``flats_next``)
    flats_next: int = 0  # those made right after the top's matmul (`Rules.flats_next`), less that matmul's saved input
    #                      (the MLP's widest, an input gradient's size), freed by its weight's gradient
    flats_mid: int = 0  # the flats at the first block's attention backward, where kept gradients reduce ...
    flats_end: int = 0  # ... or at its end, where they are made there (`Rules.flats_end`)
    span_flats: int = 0  # the flats where one bucket spans the rank's chunks (`Rules.spans`)
    saved: int = 0  # a chunk's activations saved per microbatch (`Pieces.saved`, and `Chunk.cast`)
    shared: int = 0  # what it holds once from its first forward on (`Chunk.shared_cast`)
    stashed: int = 0  # what its B keeps for W (`Pieces.stashed`)
    swap: int = 0  # its blocks but the last swapped what they saved for their stash: (blocks - 1)(stash - block)+
    grads: int = 0
    reduce: int = 0
    weights: int = 0
    behind_kept: int = 0  # a ZeRO-3 chunk's reducing backward at its second block (`_behind`), its gradients kept ...
    behind_fresh: int = 0  # ... or made in this backward
    deep_held: int = 0  # a ZeRO-3 chunk's reducing backward, its gradients made there, at its block IN_FLIGHT (the
    deep_freed: int = 0  # third: `Chunk.deep`): what the blocks before hold while they reduce, and what they saved
    mlp_grads: int = 0  # a chunk whose gradients are kept (ZeRO-2/3 across microbatches): its block's MLP weights'
    #                    gradients, made in .grad by its attention backward
    moved: int = 0  # a kept gradient of its MLP's, moved out of .grad into its flat (`Rules.moves`)
    settled: int = 0  # a ZeRO-2/3 chunk's reducing backward's end (`Chunk.settled`)
    split_flats: int = 0  # the flats a split chunk's last B makes, full (`_Walk.input_backward`)
    first: bool = False
    last: bool = False


_GLOBAL = tuple(f.name for f in fields(_Terms) if f.name not in (*_PER_CHUNK, "first", "last"))


class _Walk:
    """`walk`'s state: the activations alive (``saved``), the temporaries that outlive an action (``held``: gradients
    kept, flats, sends in flight), the kept gradients already freed (``released``); each point compared is kept as a
    row (`_compile`)."""

    def __init__(self, q: _Terms, actions: list[Action], fused: frozenset[tuple[int, int]] = frozenset()) -> None:
        self.q, self.fused = q, fused
        # Zero-bubble tables split each backward: B frees the activations and keeps the stash, W makes the gradients;
        # a fused pair's B is a full backward, its W nothing.
        self.split = any(a.phase is Phase.WEIGHT for a in actions)
        self.last_backward = {a.stage: a for a in actions if a.phase is not Phase.FORWARD and self._makes_grads(a)}
        # each chunk's last, in order; the walk compares actions by identity
        last = {id(a) for a in self.last_backward.values()}
        self.reducing = [a for a in actions if id(a) in last]
        self.seen: set[int] = set()  # the stages a backward has run for
        self.forwarded: set[int] = set()  # the stages a forward has run for
        self.saved = self.held = self.stash = 0
        # Split: each stage's last B (not fused) syncs what B finishes, making the flats (`_Walk.input_backward`)
        self.last_input = {a.stage: a for a in actions if a.phase is Phase.BACKWARD and self.split
                           and (a.stage, a.microbatch) not in fused}
        # The first reducing backward makes `q.flats`, unless it is a W whose stage's last B made them
        self.adds_flats = bool(self.reducing) and (self.reducing[0].phase is not Phase.WEIGHT
                                                   or self.reducing[0].stage not in self.last_input)
        # One bucket spanning the chunks (`Rules.spans`) is made by a split stage's last B where one comes first
        self.order = {id(a): i for i, a in enumerate(actions)}
        makers = sorted(self.last_input.values(), key=lambda a: self.order[id(a)])
        self.span_at = makers[0] if makers and (not self.adds_flats or
                                                self.order[id(makers[0])] < self.order[id(self.reducing[0])]) else None
        self.released = q.release_start
        self.rows: dict[tuple[int, int, int], Action] = {}

    def _makes_grads(self, action: Action) -> bool:
        fused = (action.stage, action.microbatch) in self.fused
        return fused if action.phase is Phase.BACKWARD and self.split else not fused

    def run(self, action: Action, chunk: _Terms, ahead: int) -> None:
        fused = (action.stage, action.microbatch) in self.fused
        if action.phase is Phase.FORWARD:
            self.forward(action, chunk, ahead)
        elif action.phase is Phase.WEIGHT:
            if not fused:
                self.weight_backward(action, chunk, ahead)
        elif self.split and not fused:
            self.input_backward(action, chunk, ahead)
        else:
            self.backward(action, chunk, ahead)

    def consider(self, activations: int, temporaries: int, action: Action) -> None:
        self.rows.setdefault((activations, temporaries, self.released), action)

    def forward(self, action: Action, chunk: _Terms, ahead: int) -> None:
        self.saved += chunk.saved + (chunk.shared if action.stage not in self.forwarded else 0)
        self.forwarded.add(action.stage)
        # At the forward's end: the last chunk's logits beside their log-softmax.
        logits, zero3 = (self.q.loss, self.q.head_zero3) if chunk.last else (0, self.q.zero3)
        self.consider(self.saved + self.stash, self.held + ahead + zero3 + logits, action)

    def backward(self, action: Action, chunk: _Terms, ahead: int) -> None:
        q, reducing = self.q, action is self.reducing[0]
        # The block's first matmul: the library's workspace, a weight's gradient beside the working set; ZeRO-2's
        # first flat is made before it (at the first gradient of the chunk's last parameters). The next ones (ZeRO-2's
        # next bucket, ZeRO-3's block flat: `Rules.flats_next`) right after it, its workspace and input freed, and
        # held through the MLP's last matmul, where the first matmul's kept gradient has moved into them
        # (`zero2_pp2_1f1b_mb4`@4, last stage: +7.5% with them at the top).
        start = q.zero3 + q.recompute + ahead + q.backward + q.workspace + q.weight
        top = start + (q.flats_top if reducing else 0)
        after = (top - q.workspace + q.flats_next, top + q.flats_next - chunk.moved) if reducing else ()
        self._working(action, chunk, ahead, top, reducing and action.stage not in self.seen,
                      action is not self.last_backward[action.stage], reducing, after)
        if action is self.last_backward[action.stage]:
            kept = action.stage in self.seen
            behind = chunk.behind_kept if kept else chunk.behind_fresh
            saved = self.saved + self.stash - (q.head if chunk.last else 0)
            self.consider(saved, self.held + start + behind, action)
            if kept:  # ... and at that block's attention backward, its MLP's saved tensors freed, its MLP's kept
                # gradients moved out of .grad into its new flat
                self.consider(saved - q.mlp_saved, self.held + q.zero3 + q.recompute + ahead + q.backward +
                              q.attention + behind - chunk.mlp_grads, action)
        self.held += q.flats - (q.span_flats if self.span_at else 0) if reducing else 0
        self.saved -= chunk.saved
        if reducing:  # its end, where the flats wait for it: made beside every kept gradient
            self.consider(self.saved + self.stash, self.held - q.flats + q.flats_end + ahead + q.zero3, action)
        self._embedding(action, chunk, ahead)
        self._gradients(action, chunk, ahead)

    def input_backward(self, action: Action, chunk: _Terms, ahead: int) -> None:
        """B of a split backward: the working set without the weights' gradients; the chunk's activations are
        freed but what W needs is kept (`Pieces.stashed`)."""
        q = self.q
        top = q.zero3 + q.recompute + ahead + q.backward + q.workspace
        # A stage's last B makes the flats as it goes, block by block (`zero3_pp2_zb1p_mb4`@4: -7.6% without them)
        last = action is self.last_input.get(action.stage)
        self._working(action, chunk, ahead, top, reduces=last)
        # Its last block: the blocks done have swapped what they saved for their stash (more under ac); at its first
        # matmul, and at its attention backward, its MLP's saved tensors swapped for about as much stash (under
        # autocast on a CPU the fused attention's workspace is the larger: bf16's products hold little)
        self.consider(self.saved + self.stash + chunk.swap, self.held + top, action)
        made = (chunk.split_flats + (q.span_flats if action is self.span_at else 0)) if last else 0
        self.consider(self.saved + self.stash + chunk.swap, self.held + q.zero3 + q.recompute + ahead + q.backward +
                      q.attention + made, action)
        self.saved -= chunk.saved
        self.stash += chunk.stashed
        self.held += made  # (seen on `zero3_pp2_zb1p_mb4`@4: a W after it -13.5% without)
        self.consider(self.saved + self.stash, self.held + ahead + q.zero3 + q.backward, action)
        self._embedding(action, chunk, ahead)

    def weight_backward(self, action: Action, chunk: _Terms, ahead: int) -> None:
        """W: the weights' gradients from the stash, all made before autograd accumulates them, then the
        reductions."""
        q = self.q
        flat = q.flats - (q.span_flats if self.span_at else 0) if action is self.reducing[0] and self.adds_flats else 0
        self.consider(self.saved + self.stash, self.held + ahead + q.zero3 + q.w_workspace + chunk.weights + flat,
                      action)
        self.held += flat
        self._gradients(action, chunk, ahead)  # (its stash is let go of as it returns, after the reductions start)
        self.stash -= chunk.stashed

    def _working(self, action: Action, chunk: _Terms, ahead: int, top: int, fresh: bool = False,
                 keeps: bool = False, reduces: bool = False, after: tuple[int, ...] = ()) -> None:
        """A backward's start: ``top`` beside the activations; the last chunk's loss gradient first. Then its first
        block's attention backward and, where it reduces gradients made there (``fresh``; kept ones are moved into
        the flats: `_behind`), that of its block IN_FLIGHT (`Chunk.deep`), the flat filling beside those reducing.
        ``keeps``: a full backward whose gradients stay in .grad (not the chunk's last): its MLP's are made by then.
        ``reduces``: where it reduces gradients kept from the backwards before, the flat is made by then too, beside
        them (ZeRO-2's buckets, ZeRO-3's block: `zero2_pp2_1f1b_mb4`@4's last stage read -8.4% under bf16-mixed
        without it), less the MLP's kept gradients moved into it by then, and not again where one bucket spanning
        the chunks is held already (`Rules.spans`). ``after``: later points of the first block's MLP, the temporaries
        beside the same activations."""
        q = self.q
        self.released = q.release
        if chunk.last:  # the loss's gradient (two logits-sized tensors) beside ZeRO-3's units (the head's, the last
            # block's prefetched), then the last block's, its head freed
            self.consider(self.saved + self.stash, self.held + ahead + q.head_zero3 + 2 * q.logits, action)
            self.consider(self.saved + self.stash, self.held + ahead + q.head_zero3 + q.logits + q.vocab_grad, action)
            saved = self.saved + self.stash - q.head
        else:
            saved = self.saved + self.stash
        for temporaries in (top, *after):
            self.consider(saved, self.held + temporaries, action)
        # The first block's attention backward: its MLP's saved tensors freed, the fused kernel's workspace beside
        # (and the flat the block's gradients fill, made by then, where this backward reduces)
        saved = self.saved + self.stash - (q.head if chunk.last else 0) - q.mlp_saved
        attention = self.held + q.zero3 + q.recompute + ahead + q.backward + q.attention + (q.flats if fresh else 0)
        self.consider(saved, attention + (chunk.mlp_grads if keeps else 0), action)
        if reduces and not fresh:  # (a spanning bucket made by an action before is held already)
            spanned = self.span_at is not None and self.order[id(self.span_at)] < self.order[id(action)]
            self.consider(saved, attention + q.flats_mid - (q.span_flats if spanned else 0) - 2 * chunk.moved, action)
        if fresh:
            self.consider(saved - chunk.deep_freed, attention + chunk.deep_held, action)

    def _embedding(self, action: Action, chunk: _Terms, ahead: int) -> None:
        """The end of the first chunk's backward: the embedding's fresh gradient, its activations freed."""
        if chunk.first:
            self.consider(self.saved + self.stash, self.held + ahead + self.q.zero3 + self.q.vocab_grad, action)

    def _gradients(self, action: Action, chunk: _Terms, ahead: int) -> None:
        """The gradients a backward (or W) leaves: kept whole until the chunk's last, which reduces them."""
        kept = action.stage in self.seen
        if action is self.last_backward[action.stage]:
            # Reducing, while what it kept is freed: the gradients (moved into the flats, or made there now) and
            # what the reduction itself holds, beside ZeRO-3's units still gathered for the chunk's first block;
            # ZeRO-3's block flats as they are then (`Chunk.settled`: the gradients all in flats, two reducing),
            # where a full backward made them block by block (a W makes them all at once, kept until it ends).
            self.consider(self.saved + self.stash, self.held + ahead + chunk.reduce + self.q.zero3 +
                          (0 if kept else chunk.grads) + (chunk.settled if action.phase is Phase.BACKWARD else 0),
                          action)
            self.held -= (chunk.grads if kept else 0) + (chunk.split_flats if action.stage in self.last_input else 0)
            if action is self.reducing[-1]:  # the rank's flats made by the first that did
                self.held -= self.q.flats if self.adds_flats else self.q.span_flats if self.span_at else 0
        elif not kept:
            self.held += chunk.grads
        self.seen.add(action.stage)
