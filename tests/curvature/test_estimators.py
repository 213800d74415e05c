"""Estimators: Hutchinson's mean over n probes approaches the exact trace at the rate 1/√n,
its standard error estimates that rate, and Lanczos quadrature is exact where it must be."""

from __future__ import annotations

import math

import pytest
import torch
from curvature_models import TwoFactor, cubic_loss, data

import quotientgeo as qg
from quotientgeo.curvature import RiemannianHessian, lanczos_quadrature


def test_hutchinson_converges_at_the_rate_one_over_root_n():
    model, batches = TwoFactor(bias=True), data()
    geometry = model.geometry("inv")
    A = RiemannianHessian(model, cubic_loss, batches, symmetries=geometry).to_dense()
    exact = float(A.trace())
    # variance of zᵀAz for Rademacher z: 2 (‖A‖_F² - Σ A_ii²)
    sigma = math.sqrt(2 * (float((A**2).sum()) - float((A.diagonal() ** 2).sum())))
    replicas, sizes, rms = 12, (4, 16, 64), []
    for n in sizes:
        runs = [
            qg.hessian_trace(
                model,
                cubic_loss,
                batches,
                symmetries=geometry,
                n_probes=n,
                seed=r,
                progress=False,
            )
            for r in range(replicas)
        ]
        errors = torch.tensor([run.value - exact for run in runs])
        rms.append(float(errors.square().mean().sqrt()))
        # E[(estimate - tr A)²] = σ²/n; with 12 replicas the normalised RMS lies in
        # [√(χ²₁₂(0.001)/12), √(χ²₁₂(0.999)/12)] = [0.51, 1.66] for Gaussian estimates:
        # widened to [0.4, 1.8] for the few-probe (non-Gaussian) ones
        assert 0.4 < rms[-1] * math.sqrt(n) / sigma < 1.8, (n, rms[-1], sigma)
        # the reported standard error estimates σ/√n
        ratio = torch.tensor([run.std_error for run in runs]).mean() * math.sqrt(n) / sigma
        assert 0.5 < float(ratio) < 1.5
    slope = math.log(rms[-1] / rms[0]) / math.log(sizes[-1] / sizes[0])
    assert -0.75 < slope < -0.25


def test_lanczos_quadrature_is_exact_for_low_degree_moments():
    gen = torch.Generator().manual_seed(0)
    B = torch.randn(30, 30, generator=gen, dtype=torch.float64)
    A = (B + B.T) / 2
    steps, probes = 5, 3
    spectrum = lanczos_quadrature(A, probes, steps, seed=4)
    assert torch.allclose(spectrum.weights.sum(-1), torch.ones(probes, dtype=torch.float64))
    v = torch.randint(0, 2, (30, probes), generator=torch.Generator().manual_seed(4))
    v = (v.double() * 2 - 1) / math.sqrt(30)
    power = v
    for k in range(2 * steps):  # exact up to degree 2·steps - 1
        expected = (v * power).sum(0)
        got = (spectrum.weights * spectrum.nodes**k).sum(-1)
        assert torch.allclose(got, expected, rtol=1e-9, atol=1e-10), k
        power = A @ power
    full = lanczos_quadrature(A, 2, 30, seed=1)  # D steps: the nodes are the eigenvalues
    eigenvalues = torch.linalg.eigvalsh(A)
    assert torch.allclose(full.nodes, eigenvalues.expand(2, -1), atol=1e-10)


def test_density_of_the_operator_has_its_eigenvalues_as_nodes():
    model, batches = TwoFactor(bias=True), data()
    geometry = model.geometry("mix")
    A = RiemannianHessian(model, cubic_loss, batches, symmetries=geometry).to_dense()
    result = qg.hessian_density(
        model, cubic_loss, batches, symmetries=geometry, n_probes=2, n_steps=A.shape[0],
        per_block=True, progress=False,
    )  # fmt: skip
    nodes = result.spectrum.nodes
    assert torch.allclose(nodes, torch.linalg.eigvalsh(A).expand(2, -1), atol=1e-9)
    assert result.spectrum.moment(1) * A.shape[0] == pytest.approx(float(A.trace()), rel=0.5)
    grid, density = result.density()
    assert float((density * (grid[1] - grid[0])).sum()) == pytest.approx(1.0, abs=1e-3)
    assert result.per_block is not None
    assert sum(b.dim for b in result.per_block) == A.shape[0]
