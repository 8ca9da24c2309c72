"""Counting bytes from tensors: deduplicated by storage, and activations saved for backward."""

import pytest
import torch

from strategies.measure.memory import SavedTensorsMeter, count_bytes


def test_count_bytes_dedupes_views_and_earlier_categories():
    flat = torch.zeros(100)
    a, b = flat[:40], flat[40:]
    other = torch.zeros(10)
    got = count_bytes({"params": [a, b], "grads": [flat, other]})
    assert got == {"params": 400, "grads": 40}  # the flat was counted once, under the first category


def test_saved_tensors_meter_counts_activations_not_parameters():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    with SavedTensorsMeter(net) as meter:
        loss = net(x).sum()
    # Saved: the input (5x8) and the tanh output (5x16, reused as the second linear's input); the
    # first linear's pre-activation is not needed by tanh's backward. No weight is counted.
    assert meter.bytes == (5 * 8 + 5 * 16) * 4
    loss.backward()
    with SavedTensorsMeter(net) as bigger:
        net(torch.randn(50, 8)).sum()
    assert bigger.bytes == 10 * meter.bytes


def test_saved_tensors_meter_peak_falls_as_backward_frees():
    # Two forwards and backwards inside one meter (as a pipeline step runs them): the peak is one forward's.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    with SavedTensorsMeter(net) as one:
        net(torch.randn(5, 8)).sum().backward()
    assert one.live == 0
    with SavedTensorsMeter(net) as sequential:
        for _ in range(2):
            net(torch.randn(5, 8)).sum().backward()
    with SavedTensorsMeter(net) as overlapped:  # both forwards before either backward: twice the peak
        losses = [net(torch.randn(5, 8)).sum() for _ in range(2)]
        for loss in losses:
            loss.backward()
    assert sequential.bytes == one.bytes == (5 * 8 + 5 * 16) * 4
    assert overlapped.bytes == 2 * one.bytes


def test_heap_sampler_restart_starts_a_new_peak():
    from strategies.measure.memory import HeapSampler

    if not HeapSampler.available():
        pytest.skip("needs glibc's mallinfo2")
    with HeapSampler(interval_s=1.0) as heap:  # slow thread: the explicit samples decide
        big = torch.ones(2**23)  # 32 MiB (other objects freed meanwhile may take a few KiB off: margins of 8 MiB)
        heap.sample()
        del big
        before, now = heap.restart()
        assert before - heap.start >= 24 * 2**20 and now - heap.start < 8 * 2**20  # the old peak held it; now not
        assert heap.peak == now  # the new peak starts from what is in use


def test_saved_tensors_meter_knows_parameters_made_after_it_started():
    # A pipeline's first step makes the rank's blocks (a model built on meta) after the meter starts: a parameter
    # made then is still a parameter. (Read at the meter's start, the new weights counted as activations.)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    with SavedTensorsMeter(net) as meter:
        for layer in (net[0], net[2]):  # new storages, as the deferred set-up makes them
            layer.weight = torch.nn.Parameter(layer.weight.detach().clone())
        net(x).sum()
    assert meter.bytes == (5 * 8 + 5 * 16) * 4
