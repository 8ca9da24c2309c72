"""The memory walk over a rank's actions (`measure.peak`): where a step peaks and what it holds there.

Hand-made pieces with distinct powers of two, so that each total says which terms it holds. The heap a real run used is
compared with the same walk in tests/e2e/test_heap.py.
"""

from __future__ import annotations

from strategies.measure.peak import Chunk, Pieces, Rules, Workspace, step_actions, walk
from strategies.pipeline.schedules import Action, Phase, fused_weights, gpipe, one_f_one_b, reducing
from strategies.pipeline.zero_bubble import zb1p

PIECES = Pieces(boundary=1, block=16, recompute=0, embedding=2, head=4, logits=8, backward=32)


def test_one_process_peaks_at_the_loss_gradient_or_the_last_blocks_backward():
    chunk = {0: Chunk(blocks=2, first=True, last=True)}
    saved = 2 * 16 + 2 + 4  # two blocks, the embedding's output, the head's
    peak = walk(PIECES, chunk, step_actions(None, 1, 1))
    # At the backward's start: everything saved, and either the loss's gradient (2 logits = 16) or the last block's
    # working set (32) with the head's activations freed (4); the second is larger.
    assert (peak.activations, peak.temporaries, peak.at) == (saved - 4, 32, "B0.0")
    assert walk(PIECES, chunk, step_actions(None, 1, 1), workspace=Workspace(64)).total == saved - 4 + 32 + 64


def test_gpipe_holds_every_microbatch_and_1f1b_at_most_pp():
    def first_stage(table) -> float:
        chunks = {0: Chunk(blocks=2, first=True, last=False)}
        return walk(PIECES, chunks, step_actions(table[0], 1, 4)).activations
    per_microbatch = 2 * 16 + 2 - 1  # two blocks, the embedding's output; not the output sent (the next stage's)
    assert first_stage(gpipe(2, 4)) == 4 * per_microbatch
    assert first_stage(one_f_one_b(2, 4)) == 2 * per_microbatch


def test_gradients_kept_across_backwards_count_from_the_first_to_the_last():
    # ZeRO-2/3 under pp keep param.grad whole after a chunk's first backward, until its last one reduces them.
    table = one_f_one_b(2, 4)[1]  # the last stage: F B F B ...
    kept = {1: Chunk(blocks=1, first=False, last=True, grads=1024)}
    none = {1: Chunk(blocks=1, first=False, last=True)}
    actions = step_actions(table, 1, 4)
    assert walk(PIECES, kept, actions).total == walk(PIECES, none, actions).total + 1024
    assert walk(PIECES, kept, actions).at != "B1.0"  # the first backward holds none yet


def test_released_gradients_and_flats():
    chunk = {0: Chunk(blocks=1, first=True, last=True)}
    actions = step_actions(None, 1, 1)
    base = walk(PIECES, chunk, actions)
    assert base.at == "B0.0"
    # Gradients the optimizer's zero_grad frees before backward (naive, ZeRO-2/3 without pp) are not at its peak...
    freed = walk(PIECES, chunk, actions, rules=Rules(release=4))
    assert freed.released == 4 and freed.total == base.total - 4
    # ... so a large one moves the peak to the forward's end, where they are still held.
    assert walk(PIECES, chunk, actions, rules=Rules(release=512)).at == "F0.0"
    # A flat made at the reducing backward's start adds to it.
    assert walk(PIECES, chunk, actions, rules=Rules(flats=256)).total == base.total + 256


def test_messages_received_ahead_of_use_are_held():
    table = [Action(Phase.FORWARD, 1, m) for m in range(3)] + [Action(Phase.BACKWARD, 1, m) for m in range(3)]
    chunks = {1: Chunk(blocks=0, first=False, last=False, reduce=100)}
    actions = step_actions(table, 1, 3)
    quiet = Pieces(boundary=1, block=0, recompute=0, embedding=0, head=0, logits=0, backward=0)
    # The peak is the last backward's reduction; with one message received ahead of it, one more.
    assert walk(quiet, chunks, actions).total == 100
    assert walk(quiet, chunks, actions, rules=Rules(early=(0, 0, 0, 0, 0, 1))).total == 101


def test_accumulation_runs_micro_steps_one_after_the_other():
    actions = step_actions(None, 3, 1)
    assert [str(a) for a in actions] == ["F0.0", "B0.0", "F0.1", "B0.1", "F0.2", "B0.2"]
    chunk = {0: Chunk(blocks=1, first=True, last=True, grads=4096)}
    # Only one micro-step's activations at a time; the kept gradients from the second on.
    peak = walk(PIECES, chunk, actions)
    assert peak.at in ("B0.1", "B0.2") and peak.temporaries >= 4096


def test_a_split_backward_swaps_activations_for_the_stash_until_w():
    from strategies.measure.estimate import ModelShape, estimate

    # By hand: one chunk, F B W of one microbatch; B keeps a stash of 64 per block, W makes 128 of gradients at once.
    pieces = Pieces(boundary=1, block=16, recompute=0, embedding=2, head=4, logits=8, backward=32, stash=64)
    chunk = {0: Chunk(blocks=2, first=True, last=False, weights=128)}
    peak = walk(pieces, chunk, zb1p(1, 1)[0])
    assert (peak.activations, peak.temporaries, peak.at) == (2 * 64, 128, "W0.0")
    # The demo's block: ZB-H1 holds 1F1B's peak activations within 2% (rank r: p - r microbatches in flight, r
    # stashes of the same size; the head's weight gradient is made in B, so nothing logits-sized is kept; 1F1B's
    # sent outputs are freed at their send, and a stash keeps the last block's output gradient); with recompute, B
    # keeps far more than the block's input.
    shape = ModelShape.from_config(dict(vocab_size=65, seq_len=128, n_layer=8, n_embd=128, n_head=4), batch=32)

    def most(plan: str) -> float:
        return max(m["activations"] for m in estimate(shape, plan, 4, "32-true").memory)
    assert 0.98 * most("pp4_1f1b_mb8") <= most("pp4_zb1p_mb8") <= 1.02 * most("pp4_1f1b_mb8")
    assert most("pp4_zb1p_mb8_ac") > 5 * most("pp4_1f1b_mb8_ac")


def test_a_w_the_runner_merges_into_its_b_is_walked_as_one_full_backward_and_the_last_b_at_its_attention():
    # zb1p at pp2, mb2: stage 0 runs F F B W B W, each W inside its B (`schedules.fused_weights`: nothing waits for
    # stage 0's input gradient), so it holds what F F B B holds: no stash. Walked split, as before, its B's last block
    # held a stash the run never makes: under autocast on a CPU (large attention workspace) 6.5% above the rehearsal.
    pieces = Pieces(boundary=1, block=16, recompute=0, embedding=2, head=4, logits=8, backward=32, stash=64,
                    mlp_saved=8)
    chunk = {0: Chunk(blocks=2, first=True, last=False, weights=128)}
    table = zb1p(2, 2)[0]
    fused = fused_weights(table, reducing(table), {0: 0, 1: 1})
    assert fused == {(0, 0), (0, 1)}
    whole = [a for a in table if a.phase is not Phase.WEIGHT]
    for workspace in (Workspace(), Workspace(attention=512)):
        merged = walk(pieces, chunk, table, workspace, Rules(fused=fused))
        assert merged == walk(pieces, chunk, whole, workspace)
        assert merged.total < walk(pieces, chunk, table, workspace).total
    # Split (stage 1's B sends its gradient to stage 0): B1.1's last block's attention backward holds microbatch 1's
    # activations (2 blocks, its input, the head's), microbatch 0's stash (2 x 64) and the block before's swap
    # (64 - 16), beside the working set and the fused attention's workspace; at the first block's, as before, 60 less
    last = {1: Chunk(blocks=2, first=False, last=True, weights=128)}
    split = walk(pieces, last, zb1p(2, 2)[1], Workspace(attention=512))
    assert (split.activations, split.temporaries, split.at) == ((2 * 16 + 1 + 4) + 2 * 64 + 48, 32 + 512, "B1.1")


def test_autocasts_copy_of_the_weights_is_saved_with_each_microbatch_in_flight():
    # Lightning's autocast region (whose cache would share one copy) is one training_step call, under pp one
    # microbatch: each forward makes a half copy of the chunk's weights, which its matmuls keep until its backward.
    def first_stage(table, cast: float) -> float:
        chunks = {0: Chunk(blocks=2, first=True, last=False, cast=cast)}
        return walk(PIECES, chunks, step_actions(table[0], 1, 4)).activations
    assert first_stage(gpipe(2, 4), 1000) == first_stage(gpipe(2, 4), 0) + 4 * 1000
    assert first_stage(one_f_one_b(2, 4), 1000) == first_stage(one_f_one_b(2, 4), 0) + 2 * 1000


def test_zero3s_reduction_in_flight_at_a_chunks_second_block_where_gradients_were_kept():
    # ZeRO-3 under pp: the step's last backward of a 2-block chunk reduces block by block; at its second block the
    # first still reduces (its shard and gloo's copy: in_flight) beside the new flat, the kept .grad moved out, one
    # unit gathered where the first block had two and gloo's buffer. Where gradients were not kept, nothing is added.
    pieces = Pieces(boundary=1, block=1, recompute=0, embedding=2, head=4, logits=8, backward=32, unit=64, gathers=64,
                    mlp_grad=1024)
    table = one_f_one_b(2, 2)[0]  # the first stage: F F B B
    rules = Rules(flats=1024, flats_early=0)  # ZeRO-3's: its first block's point has no flat (the MLP's gradient
    #                                               is as large)

    def total(in_flight: float, grads: float = 4096) -> float:
        chunk = {0: Chunk(blocks=2, first=True, last=False, grads=grads, in_flight=in_flight)}
        return walk(pieces, chunk, step_actions(table, 1, 2), rules=rules).total

    # Without it the peak is the reducing backward's first block's attention backward: microbatch 1's activations,
    # the kept .grad, the flat made by then, the units and backward's working set (`_Walk._working`'s ``reduces``)
    assert total(0) == (2 + 2 - 1) + 4096 + 1024 + 192 + 32
    # With it, B0.1's second block: microbatch 1's activations (2 blocks + the embedding's, less the output sent), the
    # kept .grad, the
    # working set (the units, backward's 32), the reduction in flight and the new flat, one unit and gloo's buffer
    # less (the first block's own activations beyond its input: none here, block = boundary)
    assert total(2048) == (2 + 2 - 1) + 4096 + (192 + 32) + (2048 + 1024 - 64 - 64)
    assert total(16) == total(0)  # a small one stays below


def test_zero3s_reduction_in_flight_is_beside_the_second_blocks_attention_workspace():
    # The same point at that block's attention backward: its MLP's saved tensors freed, the fused attention's
    # workspace in place of the first matmul's. On a CPU the attention's is the larger (4.1 MiB at the heap tests'
    # size): zero3_tp2_pp2_1f1b_ac@8's first stage under the policy peaks there, 6.4% above the block's start
    pieces = Pieces(boundary=1, block=1, recompute=0, embedding=2, head=4, logits=8, backward=32, unit=64, gathers=64,
                    mlp_grad=1024, mlp_saved=1)
    chunk = {0: Chunk(blocks=2, first=True, last=False, grads=4096, in_flight=2048)}
    peak = walk(pieces, chunk, step_actions(one_f_one_b(2, 2)[0], 1, 2), Workspace(attention=512),
                Rules(flats=1024, flats_early=0))
    assert (peak.total, peak.at) == ((3 - 1) + 4096 + (192 + 32 + 512) + (2048 + 1024 - 64 - 64), "B0.1")


def test_a_backward_that_keeps_its_gradients_holds_its_mlps_at_the_attention_backward():
    # ZeRO-2/3 under pp keeps each microbatch's gradients in .grad until the step's last backward: at the first
    # block's attention backward its MLP's two weights' gradients are there already (float32 under the policy).
    # zb1p's first stage (Ws inside their Bs) under the policy peaks there: -5.1% -> -2.7% of the rehearsal
    pieces = Pieces(boundary=1, block=8, recompute=0, embedding=2, head=4, logits=8, backward=32, weight=100,
                    mlp_saved=4)
    table = one_f_one_b(2, 2)[0]  # F F B B: B0.0 keeps, B0.1 reduces
    chunk = {0: Chunk(blocks=2, first=True, last=False, grads=10)}
    peak = walk(pieces, chunk, step_actions(table, 1, 2), Workspace(attention=4096))
    # B0.0's first block: both microbatches' activations (2 x 17) less its MLP's, the working set, the workspace,
    # and the two weights' gradients; B0.1 holds B0.0's kept .grad (10) in their place
    assert (peak.total, peak.at) == ((2 * 17 - 4) + (32 + 4096) + 2 * 100, "B0.0")
