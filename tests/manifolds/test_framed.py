"""FrameDamping: ``P_δ = GᵀG + δ Q⁻¹``, the GL(h) metrics damped in ``H``'s frame.

Properties over random shapes, batch dimensions, seeds, metrics (mix, inv, interpolated) and
points with ``G = 0`` (a LoRA adapter at PEFT's start) or ``G`` of full rank:

- the closed forms (projection, Christoffel symbols, ``M⁻¹``) equal the generic base's
  derivations (normal equations; autodiff of the metric);
- the geometry is exactly GL(h)-invariant: the metric, the projection, the second-order map
  and the geodesic move with the group, by elements of condition number up to 6;
- as ``δ → 0`` at full-rank points it becomes the undamped inv or mix geometry;
- a ball of radius ``ρ`` moves ``H`` at most ``κ`` in its own frame (mix), and ``G H ᵀ`` at
  most ``ρ²/κ`` at ``G = 0`` (inv).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quotientgeo import FrameDamping, GLQuotient
from quotientgeo.geometry.perturbation import in_ball
from quotientgeo.manifolds.gl import FramedGLQuotient
from quotientgeo.manifolds.gl.damping import without_ball

DT = torch.float64


@st.composite
def cases(draw):
    h = draw(st.integers(1, 3))
    n, m = draw(st.integers(h, 6)), draw(st.integers(h, 6))
    return {
        "batch": draw(st.lists(st.integers(1, 2), max_size=2).map(tuple)),
        "n": n,
        "m": m,
        "h": h,
        "seed": draw(st.integers(0, 2**16)),
        "zero_g": draw(st.booleans()),
        "metric": draw(st.sampled_from(["mix", "inv", 0.3])),
        "radius": draw(st.floats(1e-2, 1.0)),
        "reach": draw(st.floats(0.25, 2.0)),
    }


#: The largest condition number of a drawn factor: the properties hold at full-rank points, and
#: a Gaussian square factor is nearly singular often enough (cond(HᵀH) ~ 1e8 on fresh draws)
#: for every comparison to measure only the rounding of its Gram solves.
FACTOR_COND = 10.0


def conditioned_factor(shape, gen) -> torch.Tensor:
    """A Gaussian factor with its singular values replaced by a geometric spread from 1 down to
    ``1/FACTOR_COND`` (random singular vectors)."""
    U, _, Vh = torch.linalg.svd(torch.randn(shape, generator=gen, dtype=DT), full_matrices=False)
    s = FACTOR_COND ** -torch.linspace(0, 1, shape[-1], dtype=DT)
    return U @ (s[:, None] * Vh)


def setup(c):
    gen = torch.Generator().manual_seed(c["seed"])
    shape = (*c["batch"], c["n"], c["h"])
    G = torch.zeros(shape, dtype=DT) if c["zero_g"] else conditioned_factor(shape, gen)
    H = conditioned_factor((*c["batch"], c["m"], c["h"]), gen)
    M = GLQuotient(c["n"], c["metric"], FrameDamping(c["radius"], c["reach"]))
    return M, torch.cat([G, H], -2), gen


def close(a, b, rtol):
    scale = b.abs().max().clamp_min(1e-300)
    assert float((a - b).abs().max() / scale) < rtol, float((a - b).abs().max() / scale)


@settings(max_examples=25, deadline=None)
@given(cases())
def test_closed_forms_equal_the_generic_derivations(c):
    M, x, gen = setup(c)
    assert isinstance(M, FramedGLQuotient)
    generic = M.generic()
    u, v = (torch.randn(x.shape, generator=gen, dtype=DT) for _ in "uv")
    pu = M.proju(x, u)
    close(pu, generic.proju(x, u), 1e-9)
    close(M.proju(x, pu), pu, 1e-9)  # idempotent: exact, not approximately so
    close(M.metric_inv(M.at(x), M.metric(M.at(x), u)), u, 1e-9)
    close(M.christoffel(x, u), generic.christoffel(x, u), 1e-9)
    close(M.christoffel(x, u, v), generic.christoffel(x, u, v), 1e-9)
    g = M.egrad2rgrad(x, u)
    close(M.proju(x, g), g, 1e-9)


def conditioned(M, y, k: float = 100.0) -> float:
    """``1e-9``, or ``k ε cond(P_δ) cond(Q)`` at the moved point where that is larger: the
    projection solves with both damped Gram matrices (the interpolated metrics through the
    generic base's normal equations), so its rounding grows with their conditioning; at
    ``G = 0``, ``P_δ = δ Q⁻¹`` and the bound is ``k ε cond(Q)²`` (a random 3 × 3 ``H`` moved by
    an element of condition 6 reached ``cond(Q) = 6e4``, and an error of 5e-8)."""
    P, Q = M.grams(M.at(y))
    cond = torch.linalg.cond(P).max() * torch.linalg.cond(Q).max()
    return max(1e-9, k * torch.finfo(DT).eps * float(cond))


@settings(max_examples=25, deadline=None)
@given(cases())
def test_the_geometry_moves_with_the_group(c):
    M, x, gen = setup(c)
    A = M.random_group(x, generator=gen, condition=6.0)
    y = M.act(x, A)
    u = M.proju(x, torch.randn(x.shape, generator=gen, dtype=DT))
    u = 0.3 * u / M.norm(x, u, keepdim=True)
    w = torch.randn(x.shape, generator=gen, dtype=DT)
    rtol = conditioned(M, y)
    torch.testing.assert_close(M.inner(y, M.push(x, u, A)), M.inner(x, u), rtol=1e-10, atol=0)
    close(M.proju(y, M.push(x, w, A)), M.push(x, M.proju(x, w), A), rtol)
    close(M.expmap2(y, M.push(x, u, A)), M.act(M.expmap2(x, u), A), rtol)
    close(M.expmap(y, M.push(x, u, A), steps=40), M.act(M.expmap(x, u, steps=40), A), rtol)


@settings(max_examples=15, deadline=None)
@given(cases())
def test_the_integrated_geodesic_is_the_full_space_one(c):
    """The geodesic integrated in the span of ``[F, ξ_F]`` is RK4 on the full space's
    ``ẍ = -Γ(ẋ, ẋ)`` (generic Christoffel symbols) with the same steps, and stays horizontal
    (to the integrator's accuracy)."""
    M, x, gen = setup(c)
    u = M.proju(x, torch.randn(x.shape, generator=gen, dtype=DT))
    # inside the ball the damping is made for (norm 0.3 ρ): a longer vector may move H by more
    # than its own size in its frame (up to 0.3 κ/ρ), and leave GL(h) before t = 1
    u = 0.3 * c["radius"] * u / M.norm(x, u, keepdim=True)
    y = M.expmap(x, u, steps=12)
    close(y, M.generic().expmap(x, u, steps=12), 1e-10)
    # the automatic step count resolves the end point to 1e-8 of the displacement in float64;
    # the end velocity is as accurate, so it is horizontal to about that
    y, dy = M.geodesic(x, u)
    close(M.proju(y, dy), dy, 1e-6)


@settings(max_examples=15, deadline=None)
@given(cases())
def test_a_vanishing_damping_is_the_undamped_metric(c):
    """With ``δ`` small against the point (``δ ‖(GᵀG)⁻¹‖ ‖(HᵀH)⁻¹‖ = 1e-12``, the damping's
    relative size in ``P_δ = GᵀG + δ(HᵀH)⁻¹``), the geometry is the undamped one to ``1e-7``,
    or to the rounding of solves with both Gram matrices where that is larger (a fixed ``δ``
    is not small at every random point: a nearly singular ``H`` makes ``δ(HᵀH)⁻¹`` large)."""
    c = {**c, "zero_g": False, "reach": 1.0}
    _, x, gen = setup({**c, "radius": 1.0})
    plain = GLQuotient(c["n"], c["metric"])
    P, Q = plain.grams(plain.at(x))
    smallest = torch.linalg.eigvalsh(P)[..., 0].min() * torch.linalg.eigvalsh(Q)[..., 0].min()
    radius = math.sqrt(1e-12 * float(smallest))  # δ = radius² (reach 1)
    M = GLQuotient(c["n"], c["metric"], FrameDamping(radius, 1.0))
    rtol = max(1e-7, conditioned(plain, x))
    u = torch.randn(x.shape, generator=gen, dtype=DT)
    close(M.proju(x, u), plain.proju(x, u), rtol)
    close(M.christoffel(x, u), plain.christoffel(x, u), rtol)


@settings(max_examples=25, deadline=None)
@given(cases())
def test_the_ball_bounds(c):
    """A vector of metric norm ``ρ``: ``δ tr(Q⁻¹ ξ_Hᵀξ_H) ≤ ρ²`` in the mix metric, so ``H``
    moves at most ``κ`` in its own frame (``‖ξ_H‖ ≤ κ ‖H‖₂``); in the inv metric at ``G = 0``,
    ``W_G = Q/δ``, so ``‖ξ_G Hᵀ‖ ≤ ρ √δ = ρ²/κ``."""
    M, x, gen = setup(c)
    rho, reach = c["radius"], c["reach"]
    u = M.proju(x, torch.randn(x.shape, generator=gen, dtype=DT))
    u = rho * u / M.norm(x, u, keepdim=True)
    _, H = M.split(x)
    uG, uH = M.split(u)
    Q_inv = torch.linalg.inv(H.mT @ H)
    frame = (Q_inv * (uH.mT @ uH)).sum((-2, -1)).sqrt()  # ‖H⁺ξ_H‖ (‖A⁺ξ_A‖ for LoRA)
    if c["metric"] == "mix":
        assert bool((frame <= reach * (1 + 1e-9)).all())
        top = torch.linalg.matrix_norm(H, 2)
        assert bool((uH.flatten(-2).norm(dim=-1) <= reach * top * (1 + 1e-9)).all())
    if c["metric"] == "inv" and c["zero_g"]:
        moved = (uG @ H.mT).flatten(-2).norm(dim=-1)
        assert bool((moved <= rho**2 / reach * (1 + 1e-9)).all())


def test_points_constructors_and_the_ball():
    """``G = 0`` is a point, a rank-deficient ``H`` is not; the damping waits for a ball's
    radius, which the sharpness ball fills in and an optimizer replaces by a number."""
    M = GLQuotient(4, "mix", FrameDamping(0.1))
    zero_g = torch.cat([torch.zeros(4, 2, dtype=DT), torch.randn(5, 2, dtype=DT)])
    assert M._check_point_on_manifold(zero_g)[0]
    flat_h = torch.cat([torch.randn(4, 2, dtype=DT), torch.ones(5, 2, dtype=DT)])
    ok, reason = M._check_point_on_manifold(flat_h)
    assert not ok and "H is rank deficient" in str(reason)
    inv = M.with_metric("inv")
    assert isinstance(inv, FramedGLQuotient) and inv.eps == M.eps and inv.s == 0.0
    waiting = GLQuotient(4, "mix", FrameDamping())
    with pytest.raises(ValueError, match=r"FrameDamping\(radius=rho\)"):
        waiting.egrad2rgrad(zero_g, torch.ones_like(zero_g))
    placed = in_ball(waiting, 0.25)
    assert isinstance(placed, FramedGLQuotient) and placed.eps == FrameDamping(0.25)
    assert math.isclose(placed.eps.delta, 0.25**2 / 0.5**2)
    trained = without_ball(waiting, 1e-2)
    assert not isinstance(trained, FramedGLQuotient) and trained.eps == 1e-2
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="reach"):
            FrameDamping(0.1, bad)
