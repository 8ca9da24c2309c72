"""`strategies.mixed_precision`: a weight's half copy made once per step, as torch's autocast cache makes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strategies.mixed_precision import shared_cast, step_casts, uncached


def test_a_weight_is_cast_once_per_step_and_each_microbatchs_gradient_still_reaches_it():
    # Two microbatches, each in its own autocast region (Lightning's, with its cache on), inside one step: one copy;
    # each backward returns its own gradient through the cast, summed in float32.
    w = torch.nn.Parameter(torch.randn(4, 4))
    xs = [torch.randn(2, 4) for _ in range(2)]
    with step_casts():
        outs = []
        for x in xs:
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
                outs.append(F.linear(x, w))
        copies = {o.grad_fn.next_functions[1][0].next_functions[0][0] for o in outs}  # (TBackward -> the cast)
        assert len(copies) == 1
        for o in outs:
            o.float().sum().backward()
    ones = torch.ones(2, 4, dtype=torch.bfloat16)
    expected = sum((ones.t() @ x.to(torch.bfloat16)).float() for x in xs)  # each microbatch's in bf16, summed in fp32
    assert torch.equal(w.grad, expected)


def test_the_shared_copy_is_never_one_made_without_a_graph():
    # The pipeline's trace runs under no_grad inside the first step: a copy kept from there would have no graph and
    # cut every weight's gradient (a rehearsal once lost its gradients so). Not kept under no_grad, nor uncached.
    w = torch.nn.Parameter(torch.randn(4, 4))
    with step_casts(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
        with torch.no_grad():
            assert shared_cast(w, torch.bfloat16).grad_fn is None
        with uncached():
            assert shared_cast(w, torch.bfloat16) is not shared_cast(w, torch.bfloat16)
        kept = shared_cast(w, torch.bfloat16)
        assert kept.grad_fn is not None and shared_cast(w, torch.bfloat16) is kept
        detached = shared_cast(w.detach(), torch.bfloat16, w)  # a zero-bubble linear's: the same storage
        assert detached.grad_fn is None and detached.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr()
    assert shared_cast(w, torch.bfloat16) is not kept  # the step's end let it go
