"""The step hands the heap's free pages back to the system (``quotientgeo.heap``): once per
gradient the maximiser takes, on the CPU, for parameters of at least ``heap.MIN_BYTES``, and
not at all where the C library has no ``malloc_trim``; the values do not change."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from quotientgeo import geodesic_sharpness, heap
from quotientgeo.sharpness import objective as objective_module

sys.path.insert(0, str(Path(__file__).parents[1] / "geometry"))  # the families' tiny models
from tiny_families import regression

CPU = torch.device("cpu")


def test_only_large_parameters_on_the_cpu_trim(monkeypatch):
    glibc = heap._malloc_trim() is not None
    assert heap.release_free_memory(CPU, heap.MIN_BYTES) is glibc
    assert heap.release_free_memory(CPU, heap.MIN_BYTES - 1) is False
    assert heap.release_free_memory(torch.device("meta"), heap.MIN_BYTES) is False
    if sys.platform.startswith("linux") and glibc:
        monkeypatch.setattr(heap, "_malloc_trim", lambda: None)  # another C library
        assert heap.release_free_memory(CPU, heap.MIN_BYTES) is False


@pytest.mark.parametrize("n_iter", [1, 5])
def test_once_per_step_with_the_parameters_bytes_and_values_unchanged(monkeypatch, n_iter):
    model, loss_fn = regression("gpt2", seed=3)
    kw = dict(rho=0.05, n_iter=n_iter, progress=False)
    calls = []

    def counted(device, parameter_bytes):
        calls.append((device, parameter_bytes))
        return heap.release_free_memory(device, heap.MIN_BYTES)  # trims, whatever the size

    monkeypatch.setattr(objective_module, "release_free_memory", counted)
    trimmed = geodesic_sharpness(model, loss_fn, [None], **kw)
    held = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    assert calls == [(CPU, held)] * n_iter  # one Gram pass per step
    monkeypatch.setattr(objective_module, "release_free_memory", lambda *args: False)
    untouched = geodesic_sharpness(model, loss_fn, [None], **kw)
    assert trimmed.value == untouched.value
    assert trimmed.trace == untouched.trace
