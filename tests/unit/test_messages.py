"""The pipeline's messages under NCCL's rules (`pipeline.messages`): every shipped schedule's programs are proven
free of hangs and of swapped messages, and orders that NCCL would hang on or mismatch are caught."""

from __future__ import annotations

import pytest
import torch

from strategies.pipeline import messages, runner
from strategies.pipeline.messages import (
    Message,
    PipelineOrderError,
    Step,
    Transfer,
    check,
    evaluation,
    held_receives,
    programs,
)
from strategies.pipeline.schedules import build, owners


def _shipped():
    for pp in range(2, 9):
        for mb in range(1, 17):
            for name, virtuals in (("gpipe", [1]), ("1f1b", [1]), ("interleaved", [2, 3, 4]), ("zb1p", [1]),
                                   ("zbv", [1]), ("dualpipev", [1])):
                for v in virtuals:
                    try:
                        yield name, pp, mb, v, build(name, pp, mb, v)
                    except ValueError:
                        continue  # a combination the grammar refuses (e.g. 1f1b with mb < pp)


def test_every_shipped_schedule_is_proven_under_nccl_rules():
    checked = 0
    for name, pp, mb, v, table in _shipped():
        progs = programs(table, pp)
        assert check(progs) > 0, (name, pp, mb, v)
        sent = [t.message for prog in progs for step in prog for t in step.group if t.send]
        # every activation and gradient once between two ranks (the V's bottom passes in memory), one header per
        # such stage, nothing else (the loss travels with the gradients)
        where = owners(table)
        crossing = [s for s in range(len(where) - 1) if where[s] != where[s + 1]]
        payload = [m for m in sent if m.kind in ("a", "g")]
        assert len(payload) == len(set(payload)) == 2 * len(crossing) * mb, (name, pp, mb, v)
        assert sorted(str(m) for m in sent if m.kind == "h") == sorted(f"h{s}.0" for s in crossing)
        assert {m.kind for m in sent} <= {"a", "g", "h"}
        actions = [step.action for prog in progs for step in prog if step.action is not None]
        assert sorted(map(str, actions)) == sorted(str(a) for rank in table for a in rank)
        # Without headers (a step shaped as the last one): the same messages, the headers' groups gone, grouped the
        # same way (the runner's choice of waiting on sends follows it), still proven.
        kind = messages.grouped(table, pp)[1]
        plain, plain_kind = messages.grouped(table, pp, how=kind, headers=False)
        assert plain_kind == kind and check(plain) > 0, (name, pp, mb, v)
        assert [t.message for prog in plain for step in prog for t in step.group if t.send] == [
            m for m in sent if m.kind != "h"]
        checked += 1
    assert checked > 500
    for pp in range(2, 9):
        for v in range(1, 5):
            assert check(evaluation(pp, owners(build("interleaved" if v > 1 else "1f1b", pp, 2 * pp, v)))) > 0
        assert check(evaluation(pp, owners(build("zbv", pp, pp)))) > 0


def test_1f1b_groups_like_torch_and_interleaved_runs_in_rounds():
    # 1F1B: one group per action, the previous action's output with this action's input (torch's Schedule1F1B
    # fuses its forward send with its backward receive the same way).
    rank0 = [" ".join(map(str, s.group)) + f" | {s.action}" for s in programs(build("1f1b", 2, 4), 2)[0]]
    assert rank0[:5] == [" | F0.0", "send h0.0 to 1 | None", "send a0.0 to 1 | F0.1",
                         "send a0.1 to 1 recv g1.0 from 1 | B0.0", " | F0.2"]
    # Interleaved on pp2: grouped per action, a rank would send g2.0 while its peer sends g3.1 first; the
    # checker finds it, and the programs fall back to rounds (torch's multi-stage schedules do the same).
    table = build("interleaved", 2, 4, 2)
    headed = dict.fromkeys(range(4), 0)
    with pytest.raises(PipelineOrderError, match="would hang under NCCL's in-order rule"):
        check(messages._per_action(table, owners(table), headed))
    assert check(programs(table, 2)) > 0
    cases = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1p", 1), ("zbv", 1), ("dualpipev", 1))
    kinds = [messages.grouped(build(name, 2, 4, v), 2)[1] for name, v in cases]
    assert kinds == ["action", "action", "rounds", "action", "rounds", "rounds"]
    # In rounds each receive is posted the moment its send is issued: rank 0 posts its receive of a1.0 before it
    # computes F0.1, the time rank 1 computes F1.0 (torch's `_add_send_recv` places it the same way; the time-step
    # lock step this replaced posted it after F0.1, and gloo's sender then announced its payload and wrote it later).
    rank0 = [" ".join(map(str, s.group)) + f" | {s.action}" for s in programs(table, 2, headers=False)[0]]
    assert rank0[:6] == [" | F0.0", "send a0.0 to 1 | None", "recv a1.0 from 1 | None", " | F0.1",
                         "send a0.1 to 1 | None", "recv a1.1 from 1 | None"]


def test_held_receives_counts_the_buffers_posted_ahead_of_use():
    # Per action: messages received before it and used after it. Grouped per action (1F1B) nothing is held; in
    # rounds (interleaved v2 at pp2 mb4) rank 1 holds up to two: its first chunk's activations arrive while it works
    # on its second. An activation and a gradient for one (stage, microbatch) are told apart (F2.0 uses a1.0, B2.0
    # uses g3.0): counted by (stage, microbatch) alone, rank 0's a1.0 was lost when g3.0 was posted.
    one = programs(build("1f1b", 2, 4), 2)
    assert [held_receives(p) for p in one] == [[0] * 8, [0] * 8]
    counts = [held_receives(p) for p in programs(build("interleaved", 2, 4, 2), 2)]
    assert counts[0] == [0, 1, 1, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    assert counts[1] == [0, 0, 0, 1, 1, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0]


def _prog(*groups):
    """A program from groups written as ("send a0.1 1", "recv g1.0 1") strings."""
    steps = []
    for group in groups:
        transfers = []
        for item in group:
            verb, label, peer = item.split()
            kind, rest = label[0], label[1:]
            stage, microbatch = (int(x) for x in rest.split("."))
            transfers.append(Transfer(verb == "send", int(peer), Message(kind, stage, microbatch)))
        steps.append(Step(tuple(transfers), None))
    return steps


def test_the_old_prefetching_order_is_caught():
    # The runner before: rank 0 sent a0 then posted g0's receive before sending a1; rank 1 posted a1's receive
    # (prefetch) before sending g0. Under NCCL each waits for the other.
    progs = [_prog(["send a0.0 1"], ["recv g1.0 1"], ["send a0.1 1"]),
             _prog(["recv a0.0 0"], ["recv a0.1 0"], ["send g1.0 0"])]
    with pytest.raises(PipelineOrderError, match=r"rank 0 waits in \[recv g1.0 from 1\]; rank 1 waits in \[recv a0.1"):
        check(progs)


def test_a_send_and_a_receive_in_one_group_pass_but_not_one_after_the_other():
    # NVIDIA/nccl#479: both ranks send first, then receive: both sends wait forever. Grouped, they progress.
    with pytest.raises(PipelineOrderError, match="would hang"):
        check([_prog(["send a0.0 1"], ["recv g1.0 1"]), _prog(["send g1.0 0"], ["recv a0.0 0"])])
    assert check([_prog(["send a0.0 1", "recv g1.0 1"]), _prog(["send g1.0 0", "recv a0.0 0"])]) == 1


def test_swapped_messages_between_one_pair_are_caught():
    # Same shapes both ways under interleaving: tags would have told them apart; NCCL has none.
    progs = [_prog(["send a0.2 1"], ["send g2.0 1"]), _prog(["recv g2.0 0"], ["recv a0.2 0"])]
    with pytest.raises(PipelineOrderError, match=r"receive number 1 from rank 0 is for g2.0, but rank 0's send "
                                                 r"number 1 to rank 1 is a0.2"):
        check(progs)


def test_a_message_without_its_other_end_is_caught():
    with pytest.raises(PipelineOrderError, match="rank 0 sends a0.0 .* with no matching receive"):
        check([_prog(["send a0.0 1"]), _prog()])


def test_an_activation_shaped_otherwise_than_its_header_announced_is_refused():
    # The receiver sizes its buffer from the stage's header (this step's, or the last step's when the batch is shaped
    # the same): a different shape would hang NCCL or fail deep in gloo, so the sender stops first, saying why.
    import torch

    from strategies.comm import Axis
    from strategies.pipeline.runner import PipelineRunner, _start

    runner = PipelineRunner(Axis.solo("pp"), 2, where={0: 0, 1: 1})
    step = _start([], {}, {0: ((2, 3), torch.float32)})
    runner._outgoing(torch.zeros(2, 3), 0, 1, step)
    assert Message("a", 0, 1) in step.outbox
    with pytest.raises(ValueError, match=r"stage 0's output for microbatch 2 is torch.float32 \(2, 4\), but the "
                                         r"stage's header announced torch.float32 \(2, 3\)"):
        runner._outgoing(torch.zeros(2, 4), 0, 2, step)
    with pytest.raises(ValueError, match=r"announced nothing \(no header was sent yet\)"):
        runner._outgoing(torch.zeros(2, 3), 0, 0, _start([], {}, {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("numel", [5, 6])  # an odd count puts the loss's elements at an odd offset
def test_a_gradient_carries_its_microbatchs_loss_bit_for_bit(dtype: torch.dtype, numel: int):
    # The loss rides at the end of each gradient a stage sends back (no message of its own): the gradient comes back
    # as it went, the loss as the float32 (float64 for 8-byte gradients) it was, whatever the gradient's dtype.
    out = torch.randn(numel, dtype=dtype).view(1, numel)
    grad = torch.randn(1, numel, dtype=dtype)
    loss = torch.tensor(2.0 / 3.0)
    flat = runner._pack(grad, loss)
    assert flat.dtype == dtype and flat.dim() == 1
    got_grad, carried = runner._unpack(flat, out.shape)
    assert torch.equal(got_grad, grad) and got_grad.shape == out.shape
    got_loss = runner._loss(carried)
    assert got_loss.dtype == torch.float32 and got_loss.item() == loss.item()
    # a middle stage passes the tail on undecoded; a stage whose gradient has another dtype re-encodes it
    for other in (dtype, torch.float32, torch.bfloat16, torch.float64):
        again = runner._pack(torch.zeros(3, dtype=other), carried)
        assert runner._loss(runner._unpack(again, torch.Size([3]))[1]).item() == loss.item()




@pytest.mark.parametrize("ranks, cores, crowded", [(2, 2, False), (4, 2, True), (2, 4, False)])
def test_a_host_is_crowded_where_its_ranks_outnumber_a_process_s_cores(monkeypatch, ranks, cores, crowded):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert messages.crowded(ranks) is crowded


def _sends_and_actions(program) -> list[str]:
    return [str(x) for step in program for x in (*(t for t in step.group if t.send), step.action) if x is not None]


def test_gloo_posts_a_steps_receives_together_in_the_order_nccl_s_program_matches_them(monkeypatch):
    for name, pp, mb, v, table in _shipped():
        if pp > 4 or mb > 8:
            continue
        plain = messages.grouped(table, pp, headers=False)[0]
        early = [messages.early_receives(p) for p in plain]
        # gloo matches a pair's messages in the order they are posted, as NCCL does: each pair's k-th send still meets
        # the k-th receive it was proven against (raises otherwise)
        messages._match([[s.group for s in p if s.group] for p in early])
        for before, after in zip(plain, early, strict=True):
            received = [t for s in before for t in s.group if not t.send]
            start = next(i for i, s in enumerate(after) if any(not t.send for t in s.group))
            # every receive at the first one, each a group of its own (waited for alone), in the program's order
            assert [s.group for s in after[start : start + len(received)]] == [(t,) for t in received], (name, pp)
            assert not any(not t.send for s in after[start + len(received):] for t in s.group)
            # the sends and the actions as they were, the sends before each action they came before
            assert [s.action for s in after if s.action] == [s.action for s in before if s.action]
            assert _sends_and_actions(after) == _sends_and_actions(before)
    # Under NCCL's in-order rule it would hang (a receive posted ahead holds back the rank's own later sends)
    with pytest.raises(PipelineOrderError, match="would hang"):
        check([messages.early_receives(p) for p in programs(build("1f1b", 2, 4), 2, headers=False)])
    with pytest.raises(ValueError, match="without headers"):
        messages.early_receives(programs(build("1f1b", 2, 4), 2)[0])
    # Only on gloo, and not in strict mode (which makes gloo follow NCCL's rules)
    monkeypatch.setenv("STRATPACK_STRICT_P2P", "0")
    assert messages.posts_early(True) and not messages.posts_early(False)
    monkeypatch.setenv("STRATPACK_STRICT_P2P", "60")
    assert not messages.posts_early(True)


def test_receives_posted_together_are_counted_as_held_ahead():
    # 1F1B pp2 mb4: rank 1 posts a0.0-a0.3 before F1.0 and holds the three it has not used yet; rank 0 posts g1.0-g1.3
    # after its warm-up forwards. Per action, as the estimator walks them (`measure.estimate._held_ahead`).
    early = [messages.early_receives(p) for p in programs(build("1f1b", 2, 4), 2, headers=False)]
    assert [held_receives(p) for p in early] == [[0, 0, 3, 3, 2, 2, 1, 0], [3, 3, 2, 2, 1, 1, 0, 0]]


def test_a_step_without_headers_is_grouped_as_the_step_with_them_and_the_estimator_counts_what_it_holds():
    # ZB-V with mb <= pp: with headers only rounds are safe; without them per action would be, but the runner keeps
    # the rounds (one grouping for both, `as_run`), and so does the estimator's count of the buffers held ahead.
    from strategies.measure.estimate import _held_ahead

    table = build("zbv", 4, 4)
    progs, known, how = messages.as_run(table, 4)
    assert how == "rounds" and messages.grouped(table, 4, headers=False)[1] == "action"
    assert check(known) > 0 and [max(held_receives(p)) for p in known] == [0, 1, 1, 1]
    assert _held_ahead("zbv", 4, 4, 1) == tuple(tuple(held_receives(p)) for p in known)
    early = messages.as_run(table, 4, early=True)[1]
    assert _held_ahead("zbv", 4, 4, 1, early=True) == tuple(tuple(held_receives(p)) for p in early)


@pytest.mark.parametrize("crowded,early", [(False, False), (True, False), (False, True)])
def test_the_estimators_count_of_messages_held_ahead_is_what_the_runners_programs_hold(crowded, early):
    # `held_ahead` skips what `as_run` proves (a table of one stage per rank is taken as grouped per action; the
    # rounds are counted without building them): over the shipped schedules at small sizes, the same counts.
    for name, pp, _, v, table in (case for case in _shipped() if case[1] <= 4 and case[2] <= 8):
        _, known, how = messages.as_run(table, pp, crowded, early)
        runs = [held_receives(p) for p in known] if how == "rounds" or early else None
        assert messages.held_ahead(table, pp, crowded, early) == runs, (name, pp, v, how)
