"""The two measures agree: at a critical point, worst-case geodesic sharpness is
``½ ρ² λ_max(Hess) + O(ρ³)``, so ``sharpness(ρ)/ρ²`` tends to ``λ_max/2`` with an error of
order 1 in ``ρ``."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from curvature_models import TwoFactor, squared_error

import quotientgeo as qg

RHOS = (0.1, 0.05, 0.025)


def least_squares_at_its_minimiser():
    """``‖X G Hᵀ - Y‖²/N`` with ``Y = X G₀ H₀ᵀ``: zero loss, zero gradient at ``(G₀, H₀)``."""
    model = TwoFactor(6, 4, 2, seed=0)
    gen = torch.Generator().manual_seed(7)
    X = torch.randn(40, 6, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        Y = X @ model.G @ model.H.T
    return model, [(X, Y)]


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_sharpness_over_rho_squared_tends_to_half_the_top_eigenvalue(metric):
    model, batches = least_squares_at_its_minimiser()
    geometry = model.geometry(metric)
    hessian = qg.RiemannianHessian(model, squared_error, batches, symmetries=geometry)
    assert hessian.gradient.norm() < 1e-12  # a critical point
    top = qg.hessian_eigenvalues(
        model, squared_error, batches, symmetries=geometry, method="exact", progress=False
    ).values[0]
    errors = []
    for rho in RHOS:
        # restart 0 starts at ξ = 0, where the gradient vanishes: the others start at random
        s = qg.geodesic_sharpness(
            model, squared_error, batches, rho=rho, symmetries=geometry, n_iter=100,
            restarts=3, progress=False,
        ).value  # fmt: skip
        errors.append(abs(s / rho**2 - top / 2))
    orders = [math.log2(a / b) for a, b in itertools.pairwise(errors)]
    assert all(0.8 < p < 1.25 for p in orders), (errors, orders)
    assert errors[-1] < 0.05 * top / 2
