"""BallDamping: the Gram relaxation ``ε = (ρ/σ̄)²`` per pair, and what it guarantees at ``G = 0``."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quotientgeo import BallDamping, GLQuotient
from quotientgeo.geometry.perturbation import in_ball

DT = torch.float64


def pair(batch: tuple[int, ...], n: int, m: int, h: int, seed: int, zero_g: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    G = torch.zeros(*batch, n, h, dtype=DT) if zero_g else torch.randn(*batch, n, h, generator=gen)
    H = torch.randn(*batch, m, h, generator=gen, dtype=DT) / math.sqrt(m)
    return torch.cat([G.to(DT), H], dim=-2)


shapes = st.tuples(
    st.lists(st.integers(1, 3), max_size=2).map(tuple),  # batch dims
    st.integers(2, 7),  # n
    st.integers(2, 7),  # m
    st.integers(1, 2),  # h
    st.integers(0, 2**16),  # seed
    st.booleans(),  # G = 0
    st.sampled_from(["mix", "inv"]),
    st.floats(1e-3, 1.0),  # radius
)


@settings(max_examples=30, deadline=None)
@given(shapes)
def test_epsilon_per_pair_and_the_ball_bound(case):
    """ε of each batch entry is ``ρ² · 2h / (‖G‖² + ‖H‖²)``, computed from that entry alone. A
    vector of metric norm ``ρ`` moves no factor ``F`` farther than ``σ̄`` (the pair's
    root-mean-square singular value) in the mix metric, which dominates ``ε`` times the
    Euclidean one, and than ``ρ √(‖F‖₂² + ε)`` in the inv metric."""
    batch, n, m, h, seed, zero_g, metric, radius = case
    x = pair(batch, n, m, h, seed, zero_g)
    M = GLQuotient(n, metric, BallDamping(radius))
    p = M.at(x)
    eps = M.total.relaxation(p)
    assert eps.shape == (*batch, 1, 1)
    for index in itertools.product(*map(range, batch)):
        G, H = x[index][:n], x[index][n:]
        expected = radius**2 * 2 * h / (G.pow(2).sum() + H.pow(2).sum())
        torch.testing.assert_close(eps[index].squeeze(), expected, rtol=1e-14, atol=0)
    gen = torch.Generator().manual_seed(seed + 1)
    u = M.proju(p, torch.randn(x.shape, generator=gen, dtype=DT))
    u = u * radius / M.inner(p, u, keepdim=True).sqrt()  # metric norm ρ per pair
    sigma = (x.pow(2).sum((-2, -1)) / (2 * h)).sqrt()
    for F, xi in zip(M.split(x), M.split(u), strict=True):
        move = xi.pow(2).sum((-2, -1)).sqrt()
        if metric == "mix":  # tr(W ξᵀξ) with W ⪰ εI
            bound = sigma
        else:  # tr((FᵀF + εI)⁻¹ ξᵀξ) ≥ ‖ξ‖² / (‖F‖₂² + ε)
            top = torch.linalg.matrix_norm(F, ord=2).square()
            bound = radius * (top + eps.squeeze((-2, -1))).sqrt()
        assert bool((move <= bound * (1 + 1e-12)).all())


def test_the_radius_is_taken_from_the_ball():
    """``BallDamping()`` is filled in with a ball's radius; other manifolds are left alone;
    used outside a ball it says what to do."""
    x = pair((3,), 4, 5, 2, 0, zero_g=True)
    follows = GLQuotient(4, "mix", BallDamping())
    with pytest.raises(ValueError, match=r"BallDamping\(radius=rho\)"):
        follows.egrad2rgrad(x, torch.ones_like(x))
    placed = in_ball(follows, 0.25)
    assert placed.eps == BallDamping(0.25)
    assert isinstance(placed, type(follows)) and placed.n == 4
    fixed = GLQuotient(4, "mix", BallDamping(0.5))
    plain = GLQuotient(4, "inv", 1e-3)
    assert in_ball(fixed, 0.25) is fixed and in_ball(plain, 0.25) is plain
    assert in_ball(follows, None) is follows


def test_invalid_damping():
    with pytest.raises(ValueError, match="radius"):
        BallDamping(0.0)
    with pytest.raises(ValueError, match="radius"):
        BallDamping(-1.0)
    M = GLQuotient(3, "mix", BallDamping(0.1))
    with pytest.raises(ValueError, match="nonzero factor"):
        M.total.relaxation(M.at(torch.zeros(1, 6, 2, dtype=DT)))


@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_second_order_map_at_a_zero_factor(metric):
    """At ``G = 0`` a small absolute relaxation makes the second-order map leave the ball
    (its Christoffel term grows like ``1/ε``); the ball-scaled one keeps each factor's move within
    ``σ̄``, and the exact geodesic of the mix metric changes ``W = G Hᵀ`` by at most ``√2 ρ``."""
    n, m, h, rho = 16, 12, 4, 0.05
    x = pair((), n, m, h, 0, zero_g=True)
    G, H = x[:n], x[n:]
    dW = torch.randn(n, m, generator=torch.Generator().manual_seed(1), dtype=DT)
    egrad = torch.cat([dW @ H, dW.T @ G])
    sigma = math.sqrt(x.pow(2).sum() / (2 * h))

    def moved(eps, move):
        M = GLQuotient(n, metric, eps)
        p = M.at(x)
        g = M.egrad2rgrad(p, egrad)
        y = getattr(M, move)(p, rho * g / M.inner(p, g).sqrt())
        return y[:n] - G, y[n:] - H, y[:n] @ y[n:].T

    dG, dH, W = moved(BallDamping(rho), "expmap2")
    assert max(dG.norm(), dH.norm()) <= sigma
    if metric == "mix":
        dG, dH, W = moved(1e-6, "expmap2")
        assert dH.norm() > rho / math.sqrt(1e-6)  # beyond the ball's own Euclidean bound
        for eps in (1e-4, BallDamping(rho)):
            *_, W = moved(eps, "expmap")
            assert W.norm() <= math.sqrt(2) * rho
