"""The exact ``inv`` geodesic's matrix exponentials in the maximiser read nothing on the host.

Their number of squarings is chosen per matrix on the device (:func:`quotientgeo.linalg.expm`
inside the objective's :class:`~quotientgeo.linalg.DeferredChecks`), so an iteration of the
exact ``inv`` measure makes the one host read of Auto-PGD; a matrix beyond the bound comes out
``NaN``, and the run raises the exponential's error (read with the losses' finiteness), with
the model restored. The values equal those of the exponential that reads its norm on the host.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import quotientgeo.linalg as linalg
from quotientgeo import geodesic_sharpness
from quotientgeo.bench.cost import CostCounter
from quotientgeo.manifolds.gl import inv
from quotientgeo.testing.assertions import assert_same, snapshot

sys.path.insert(0, str(Path(__file__).parents[1] / "geometry"))  # the families' tiny models
from tiny_families import regression


def _exact(model, loss_fn, n_iter: int, rho: float = 0.05):
    return geodesic_sharpness(
        model, loss_fn, [None], rho=rho, metric="inv", perturbation="exact", n_iter=n_iter,
        progress=False, return_perturbation=True,
    )  # fmt: skip


def _host_read_expm(A: torch.Tensor, squarings: int | None = None) -> torch.Tensor:
    """The exponential with one ``s`` for the batch, its largest 1-norm read on the host
    (whatever number of squarings the caller allows)."""
    norm = float(linalg.one_norms(A).max())  # rounded as expm's checks round it
    s = max(0, math.ceil(math.log2(norm / 0.5))) if norm > 0 else 0
    E = linalg.expm(A / 2.0**s, squarings=0)
    for _ in range(s):
        E = E @ E
    return E


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_exponentials_read_nothing_on_the_host(name, monkeypatch):
    """Every matrix exponential of a run (the moves and their vector-Jacobian products) makes no
    host read."""
    model, loss_fn = regression(name)
    reads = []

    def counted(A, squarings=None):
        with CostCounter() as counter:
            E = linalg.expm(A, squarings)
        reads.append(counter.host_reads)
        return E

    monkeypatch.setattr(inv, "expm", counted)
    _exact(model, loss_fn, 6)
    assert len(reads) > 10 and set(reads) == {0}


@pytest.mark.parametrize("rho", [0.05, 0.5, 2.0])
def test_the_radius_bounds_the_squarings(rho, monkeypatch):
    """With the Riemannian norm every move is within the ball, so every exponential of a run
    is given the squarings that the radius bounds (``inv.squarings_at_speed``), not the
    deferred maximum."""
    model, loss_fn = regression("gpt2")
    calls = []

    def recorded(A, squarings=None):
        calls.append((A.shape[-1], squarings))
        return linalg.expm(A, squarings)

    monkeypatch.setattr(inv, "expm", recorded)
    _exact(model, loss_fn, 4, rho)
    h = min(size for size, _ in calls)
    s_M, s_X = inv.squarings_at_speed(h, rho)
    assert len(calls) > 10 and set(calls) == {(2 * h, s_M), (h, s_X)}


@pytest.mark.parametrize("rho", [0.05, 2.0])
def test_values_equal_those_of_the_host_read_exponential(rho, monkeypatch):
    """The same sharpness, perturbation and trace as with the exponential that reads its norm
    on the host (one ``s`` per batch), to ``1e-10`` relative (float64)."""
    model, loss_fn = regression("gpt2")
    ours = _exact(model, loss_fn, 6, rho)
    monkeypatch.setattr(inv, "expm", _host_read_expm)
    theirs = _exact(model, loss_fn, 6, rho)
    assert ours.value == pytest.approx(theirs.value, rel=1e-10)
    assert ours.trace[0][0] == pytest.approx(theirs.trace[0][0], rel=1e-10)
    assert ours.perturbation_norms == pytest.approx(theirs.perturbation_norms, rel=1e-10)
    assert ours.perturbations is not None and theirs.perturbations is not None
    for name, xi in ours.perturbations[0].items():
        torch.testing.assert_close(xi, theirs.perturbations[0][name], rtol=1e-10, atol=1e-12)


def test_a_step_beyond_the_bound_raises_and_restores(monkeypatch):
    """With the bound at ``0`` squarings (1-norms up to 0.5) a long step fails: the exponential's
    error, naming the bound and the batch, and the model as it was."""
    model, loss_fn = regression("gpt2")
    before = snapshot(model)
    monkeypatch.setattr(linalg, "DEFERRED_SQUARINGS", 0)
    with pytest.raises(ValueError, match=r"^expm: a matrix has a 1-norm above 0.5") as info:
        _exact(model, loss_fn, 4, rho=20.0)
    assert "on batch 0" in "\n".join(getattr(info.value, "__notes__", []))
    assert_same(before, snapshot(model))
