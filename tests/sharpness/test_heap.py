"""The step hands the heap's free pages back to the system (``quotientgeo.heap``): once per
gradient the maximiser takes, on the CPU only, and not at all where the C library has no
``malloc_trim``; the values do not change."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from quotientgeo import geodesic_sharpness, heap
from quotientgeo.sharpness import objective as objective_module

sys.path.insert(0, str(Path(__file__).parents[1] / "geometry"))  # the families' tiny models
from tiny_families import DT, make


def test_only_the_cpu_heap_is_trimmed(monkeypatch):
    glibc = heap._malloc_trim() is not None
    assert heap.release_free_memory(torch.device("cpu")) is glibc
    assert heap.release_free_memory(torch.device("meta")) is False
    if sys.platform.startswith("linux") and glibc:
        monkeypatch.setattr(heap, "_malloc_trim", lambda: None)  # another C library
        assert heap.release_free_memory(torch.device("cpu")) is False


@pytest.mark.parametrize("n_iter", [1, 5])
def test_once_per_step_and_values_unchanged(monkeypatch, n_iter):
    model, outputs = make("gpt2")
    target = torch.randn(outputs(model).shape, generator=torch.Generator().manual_seed(3), dtype=DT)

    def loss_fn(m, batch):
        return (outputs(m) - target).square().mean()

    kw = dict(rho=0.05, n_iter=n_iter, progress=False)
    calls = []

    def counted(device):
        calls.append(device)
        return heap.release_free_memory(device)

    monkeypatch.setattr(objective_module, "release_free_memory", counted)
    trimmed = geodesic_sharpness(model, loss_fn, [None], **kw)
    assert calls == [torch.device("cpu")] * n_iter  # one Gram pass per step
    monkeypatch.setattr(objective_module, "release_free_memory", lambda device: False)
    untouched = geodesic_sharpness(model, loss_fn, [None], **kw)
    assert trimmed.value == untouched.value
    assert trimmed.trace == untouched.trace
