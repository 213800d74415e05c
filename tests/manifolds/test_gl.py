"""Properties of the GL(h) two-factor quotient, at tolerances in units of the dtype's epsilon.

Tolerances: ``tol(dtype, k)`` is ``k`` machine epsilons. Where a group element ``A`` with
condition number ``κ`` acts, the acted factors ``G A⁻¹``, ``H Aᵀ`` have condition up to
``K = κ · cond(G or H)``, their Gram matrices ``K²``, and the comparison is made in the acted
metric; the error bounds are ``10 ε K²`` (inner products) and ``50 ε K³`` (maps that solve with
the Gram matrices). Measured worst cases over 300 examples: ``0.4 ε K²`` and ``14 ε K³``. In
float32, ``κ`` is capped at 10: with ``κ = 10³`` the acted Gram matrices have condition
``≳ 10⁶`` and float32 Cholesky can fail outright, so there is nothing meaningful to assert.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from quotientgeo import GLQuotient
from quotientgeo.linalg import gram, mT
from quotientgeo.manifolds import InterpolatedGLQuotient
from quotientgeo.manifolds.ode import LeftManifold, rtol_for
from quotientgeo.testing.numerics import conditioned, eps_of, gen, rel_err, tol
from quotientgeo.testing.oracles import (
    autodiff_christoffel,
    geomstats_christoffel,
    gl_metric_matrix,
)
from quotientgeo.testing.strategies import METRICS, gl_cases

KAPPA_MAX = {torch.float32: 1e1, torch.float64: 1e3}

log_kappas = st.floats(0.0, 3.0)


def kappa_for(case, log_kappa: float) -> float:
    return min(10.0**log_kappa, KAPPA_MAX[case.dtype])


def acted_cond(m, xa) -> float:
    """``K``: the worst condition number of the (acted) factors, computed in float64."""
    return max(torch.linalg.cond(F.double()).max().item() for F in m.split(xa))


def conditioned_tol(m, x, k: float = 100.0) -> float:
    """``k`` eps times ``max(cond(P)·cond(Q), 10)``: rounding in the projection grows with the
    conditioning of the Gram matrices (the inv Sylvester solve most), so a fixed multiple of
    eps is only right for well-conditioned factors."""
    G, H = m.split(x.double())
    cond = torch.linalg.cond(mT(G) @ G).max() * torch.linalg.cond(mT(H) @ H).max()
    return tol(x.dtype, k) * max(cond.item(), 10.0)


def metric_rel(m, x, a, b):
    """``||a - b||_x / ||b||_x`` (max over the batch), in float64."""
    x, a, b = x.double(), a.double(), b.double()
    den = m.norm(x, b).clamp_min(torch.finfo(torch.float64).tiny)
    return (m.norm(x, a - b) / den).max().item()


def scaled(m, x, u, size):
    """``u`` rescaled to metric norm ``size`` at ``x`` (per batch entry)."""
    return size * u / m.norm(x, u, keepdim=True)


# --------------------------------------------------------------------------- layout
@given(gl_cases())
def test_split_join_roundtrip_and_shapes(case):
    m, x = case.manifold, case.x
    G, H = m.split(x)
    assert G.shape == (*case.batch, case.n, case.h)
    assert H.shape == (*case.batch, case.m, case.h)
    assert torch.equal(m.join(G, H), x)
    assert m.split(m.at(x))[0].shape == G.shape


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_random_and_origin(metric, dtype):
    m = GLQuotient(5, metric)
    x = m.random(2, 3, 9, 3, dtype=dtype)
    assert x.shape == (2, 3, 9, 3) and x.dtype == dtype
    assert m.check_point_on_manifold(x)
    o = m.origin((9, 3), dtype=dtype)
    G, H = m.split(o)
    assert torch.equal(G, torch.eye(5, 3, dtype=dtype))
    assert torch.equal(H, torch.eye(4, 3, dtype=dtype))


# --------------------------------------------------------------------------- metric
@given(gl_cases(), log_kappas)
def test_metric_invariance(case, log_kappa):
    """``<push u, push v>_{A·x} = <u, v>_x`` for ``κ(A)`` up to 1e3."""
    m, x, u, v = case.manifold, case.x, case.u, case.v
    kappa = kappa_for(case, log_kappa)
    A = case.group(kappa)
    lhs = m.inner(m.act(x, A), m.push(x, u, A), m.push(x, v, A))
    rhs = m.inner(x, u, v)
    scale = m.norm(x, u) * m.norm(x, v)
    err = ((lhs.double() - rhs.double()).abs() / scale.double()).max().item()
    assert err <= tol(case.dtype, 10) * acted_cond(m, m.act(x, A)) ** 2


@given(gl_cases())
def test_inner_symmetric_positive_and_keepdim(case):
    m, x, u, v = case.manifold, case.x, case.u, case.v
    uv, vu = m.inner(x, u, v), m.inner(x, v, u)
    assert uv.shape == case.batch
    assert rel_err(uv, vu, 0) <= tol(case.dtype, 20) or torch.allclose(uv, vu)
    assert bool((m.inner(x, u) > 0).all())
    assert torch.allclose(m.norm(x, u) ** 2, m.inner(x, u), rtol=tol(case.dtype, 100))
    keep = m.inner(x, u, v, keepdim=True)
    assert keep.shape == (*case.batch, 1, 1)
    assert torch.equal(m.component_inner(x, u, v), keep)
    assert m.norm(x, u, keepdim=True).shape == (*case.batch, 1, 1)


@given(gl_cases())
def test_inner_matches_trace_formula(case):
    """inv ``tr(P⁻¹ u_Gᵀ v_G) + tr(Q⁻¹ u_Hᵀ v_H)``; mix ``tr(Q u_Gᵀ v_G) + tr(P u_Hᵀ v_H)``."""
    m = case.manifold
    x, u, v = case.x.double(), case.u.double(), case.v.double()
    G, H = m.split(x)
    (uG, uH), (vG, vH) = m.split(u), m.split(v)
    P, Q = mT(G) @ G, mT(H) @ H
    WG, WH = (torch.linalg.inv(P), torch.linalg.inv(Q)) if m.metric_name == "inv" else (Q, P)
    tr = lambda a: torch.diagonal(a, dim1=-2, dim2=-1).sum(-1)  # noqa: E731
    expected = tr(WG @ mT(uG) @ vG) + tr(WH @ mT(uH) @ vH)
    got = m.inner(case.x, case.u, case.v).double()
    scale = m.norm(x, u) * m.norm(x, v)
    assert ((got - expected).abs() / scale).max().item() <= tol(case.dtype, 200)


# --------------------------------------------------------------------------- projection
@given(gl_cases())
def test_proju_orthogonal_to_vertical_and_idempotent(case):
    """``proju(u) ⊥ vertical(x, ω)`` for random ω, and ``proju ∘ proju = proju``."""
    m, x, u = case.manifold, case.x, case.u
    g = gen(case.seed + 1)
    omega = torch.randn(*case.batch, case.h, case.h, generator=g, dtype=torch.float64)
    vert = m.vertical(m.at(x), omega.to(case.dtype))
    pu = m.proju(x, u)
    cos = m.inner(x, pu, vert).double().abs() / (m.norm(x, pu) * m.norm(x, vert)).double()
    k = conditioned_tol(m, x)
    assert cos.max().item() <= k
    assert metric_rel(m, x, m.proju(x, pu), pu) <= k
    # vertical vectors project to zero, horizontal part plus vertical part is the input
    residual = m.norm(x, m.proju(x, vert)).double() / m.norm(x, vert).double()
    assert residual.max().item() <= k


@given(gl_cases())
def test_proju_satisfies_horizontal_equations(case):
    """inv: ``ξ_Gᵀ G Q = P Hᵀ ξ_H``; mix: ``Gᵀ ξ_G Q = P ξ_Hᵀ H``."""
    m = case.manifold
    pu = m.proju(case.x, case.u).double()
    G, H = m.split(case.x.double())
    xG, xH = m.split(pu)
    P, Q = mT(G) @ G, mT(H) @ H
    if m.metric_name == "inv":
        lhs, rhs = mT(xG) @ G @ Q, P @ mT(H) @ xH
    else:
        lhs, rhs = mT(G) @ xG @ Q, P @ mT(xH) @ H
    scale = torch.linalg.matrix_norm(lhs) + torch.linalg.matrix_norm(rhs)
    assert (torch.linalg.matrix_norm(lhs - rhs) / scale).max().item() <= tol(case.dtype, 1e4)


@given(gl_cases(metric="inv"))
def test_inv_sylvester_agrees_with_scipy(case):
    """``Λ = Xᵀ``, ``A X + X A = B``, ``A = PQ``, ``B = P Hᵀ ξ_H − ξ_Gᵀ G Q``, per head.

    Compared through the projections ``(ξ_G + G Λ, ξ_H − H Λᵀ)``: recovering ``Λ`` from
    ``proju``'s output would subtract nearly equal numbers whenever ``G Λ`` is small next to
    ``ξ_G`` and lose the digits the comparison is about.
    """
    m, x, u = case.manifold, case.x, case.u
    G, H = m.split(x.double())
    uG, uH = m.split(u.double())
    P, Q = mT(G) @ G, mT(H) @ H
    A = (P @ Q).reshape(-1, case.h, case.h).numpy()
    B = (P @ mT(H) @ uH - mT(uG) @ G @ Q).reshape(-1, case.h, case.h).numpy()
    X = np.stack([scipy.linalg.solve_sylvester(a, a, b) for a, b in zip(A, B, strict=True)])
    Lam = mT(torch.from_numpy(X).reshape(P.shape))
    expected = m.join(uG + G @ Lam, uH - H @ mT(Lam))
    cond = torch.linalg.cond(P).max().item() * torch.linalg.cond(Q).max().item()
    assert rel_err(m.proju(x, u).double(), expected) <= tol(case.dtype, 100) * cond


# --------------------------------------------------------------------------- equivariance
def _euclidean_push(m, g, A):
    """The Euclidean gradient transforms as ``(∇_G Aᵀ, ∇_H A⁻¹)``."""
    gG, gH = m.split(g)
    return m.join(gG @ mT(A), torch.linalg.solve(A, gH, left=False))


@pytest.mark.parametrize(
    "method", ["proju", "egrad2rgrad", "christoffel", "christoffel_uv", "expmap2", "expmap"]
)
@given(case=gl_cases(), log_kappa=log_kappas)
def test_equivariance(method, case, log_kappa):
    """Every map commutes with the action (measured in the acted metric).

    The mix ``expmap`` is an RK4 integration; it commutes to rounding, not merely to the
    integrator's ``rtol``, because its automatic step count (the rule and its check) is a
    function of metric norms at the start point, so ``x`` and ``A · x`` take the same steps.
    """
    m, x, u, v = case.manifold, case.x, case.u, case.v
    kappa = kappa_for(case, log_kappa)
    A = case.group(kappa)
    xa = m.act(x, A)
    if method == "egrad2rgrad":
        acted = m.egrad2rgrad(xa, _euclidean_push(m, u, A))
        expected = m.push(x, m.egrad2rgrad(x, u), A)
    elif method == "christoffel_uv":
        acted = m.christoffel(xa, m.push(x, u, A), m.push(x, v, A))
        expected = m.push(x, m.christoffel(x, u, v), A)
    elif method in ("expmap", "expmap2"):
        u = scaled(m, x, u, 0.3)
        acted = getattr(m, method)(xa, m.push(x, u, A))
        expected = m.act(getattr(m, method)(x, u), A)
        # compare displacements, which are tangent vectors at the acted point
        acted, expected = acted - xa, expected - xa
    else:
        acted = getattr(m, method)(xa, m.push(x, u, A))
        expected = m.push(x, getattr(m, method)(x, u), A)
    assert metric_rel(m, xa, acted, expected) <= tol(case.dtype, 50) * acted_cond(m, xa) ** 3


# --------------------------------------------------------------------------- invariant loss
def _loss_grad(m, x, T):
    x = x.detach().requires_grad_(True)
    G, H = m.split(x)
    loss = ((G @ mT(H) - T) ** 2).sum()
    (grad,) = torch.autograd.grad(loss, x)
    return grad


@pytest.mark.parametrize("metric", METRICS)
@given(case=gl_cases(dtype=torch.float64, factor_cond=1.0))
def test_invariant_loss_gradient_norm_constant_on_orbit(metric, case):
    """Riemannian gradient horizontal, norm constant along an orbit (spread < 1e-10).

    ``A`` spans condition numbers 1…1e3 (singular values from 1 down to 1/κ, not normalised, so
    the orbit moves far in Euclidean terms); the Euclidean gradient norm varies by orders of
    magnitude. The factors are well conditioned: the 1e-10 budget is ``~κ² cond(P) ε``.
    """
    m = GLQuotient(case.n, metric)
    x = case.x
    g = gen(case.seed + 3)
    T = torch.randn(*case.batch, case.n, case.m, generator=g, dtype=torch.float64)
    rnorms, enorms = [], []
    for k, kappa in enumerate(np.logspace(0, 3, 7)):
        A = conditioned(case.batch, case.h, case.h, kappa, gen(case.seed + k))
        s = torch.linalg.svdvals(A)
        A = A / s[..., :1].unsqueeze(-1)  # largest singular value 1, smallest 1/κ
        xa = m.act(x, A)
        egrad = _loss_grad(m, xa, T)
        rgrad = m.egrad2rgrad(xa, egrad)
        rnorms.append(m.norm(xa, rgrad))
        enorms.append(torch.linalg.vector_norm(egrad, dim=(-2, -1)))
        if k == 0:
            # horizontal: proju leaves it unchanged
            assert metric_rel(m, xa, m.proju(xa, rgrad), rgrad) <= tol(torch.float64, 1000)
            assert m.check_vector_on_tangent(xa, rgrad, atol=0, rtol=1e-10)
    R, E = torch.stack(rnorms), torch.stack(enorms)
    spread = (R.max(0).values - R.min(0).values) / R.mean(0)
    assert spread.max().item() < 1e-10
    if case.h > 1:
        assert (E.max(0).values / E.min(0).values).min().item() > 30.0


# --------------------------------------------------------------------------- Christoffel
@pytest.mark.parametrize("eps", [0.0, 0.3])
@pytest.mark.parametrize("metric", METRICS)
@settings(max_examples=6)
@given(case=gl_cases(dtype=torch.float64, batches=((),), max_h=3, max_extra=2))
def test_christoffel_vs_autodiff_metric_matrix(metric, eps, case):
    """Closed form vs ``M⁻¹[DM[u]u − ½∇(uᵀMu)]`` of the dense flattened metric.

    General (not only horizontal) ``u``; with ``eps > 0`` the oracle uses the relaxed metric.
    """
    m = GLQuotient(case.n, metric, eps=eps)
    oracle = gl_metric_matrix(case.n, case.h, metric, eps)
    for u in (case.u, m.proju(case.x, case.u) if eps == 0 else case.v):
        expected = autodiff_christoffel(oracle, case.x, u)
        assert rel_err(m.christoffel(case.x, u), expected) <= 1e-12


@pytest.mark.parametrize("eps", [0.0, 0.3])
@given(case=gl_cases())
def test_christoffel_symmetric_bilinear(eps, case):
    """``Γ(u, v) = Γ(v, u)``, ``Γ(u, u)`` is the diagonal, bilinear in each argument."""
    m = GLQuotient(case.n, case.manifold.metric_name, eps=eps)
    x, u, v = case.x, case.u, case.v
    w = torch.randn(x.shape, generator=gen(case.seed + 5), dtype=torch.float64).to(x.dtype)
    a, b = 0.7, -1.3
    k = tol(case.dtype, 1000)
    assert rel_err(m.christoffel(x, u, v), m.christoffel(x, v, u)) <= k
    assert rel_err(m.christoffel(x, u, u), m.christoffel(x, u)) <= k
    lhs = m.christoffel(x, a * u + b * w, v)
    rhs = a * m.christoffel(x, u, v) + b * m.christoffel(x, w, v)
    assert rel_err(lhs, rhs) <= k
    # polarisation identity
    polar = 0.25 * (m.christoffel(x, u + v) - m.christoffel(x, u - v))
    assert rel_err(m.christoffel(x, u, v), polar) <= k


@pytest.mark.parametrize("eps", [0.0, 0.3])
@given(case=gl_cases(), scale=st.sampled_from([1e-3, 0.1, 1.0]))
def test_expmap2_is_the_sum_of_its_terms(eps, case, scale):
    """``expmap2`` (two products per factor, ``F (I - ½C_F) + u_F (I - ½C_uF)``) equals
    ``x + u - ½ Γ(u, u)`` summed as written, to rounding: within 50 machine epsilons of the
    largest entry of the three terms (the products sum ``h`` terms; 7.4 at most over 1500
    draws of this strategy)."""
    x = case.x
    for m in (
        GLQuotient(case.n, case.manifold.metric_name, eps=eps),
        InterpolatedGLQuotient(case.n, 0.3, eps=eps),
    ):
        u = scale * m.proju(x, case.u) if eps == 0 else scale * case.u
        gamma = m.christoffel(x, u)
        expected = x + u - 0.5 * gamma
        got = m.expmap2(x, u)
        assert got.shape == x.shape and got.dtype == x.dtype
        size = max(float(t.abs().max()) for t in (x, u, gamma))
        assert float((got - expected).abs().max()) <= tol(case.dtype, 50) * size


@pytest.mark.parametrize("eps", [0.0, 0.3])
@pytest.mark.parametrize("metric", METRICS)
def test_christoffel_vs_geomstats(metric, eps):
    """Geomstats' autodiff Christoffel symbols of the same metric matrix."""
    pytest.importorskip("geomstats")
    for seed, (n, m_, h) in enumerate([(2, 2, 1), (3, 4, 2), (3, 3, 2)]):
        g = gen(seed)
        man = GLQuotient(n, metric, eps=eps)
        x = man.join(conditioned((), n, h, 3.0, g), conditioned((), m_, h, 3.0, g))
        u = torch.randn(x.shape, generator=g, dtype=torch.float64)
        expected = geomstats_christoffel(gl_metric_matrix(n, h, metric, eps), x, u)
        assert rel_err(man.christoffel(x, u), expected) <= 1e-12


# --------------------------------------------------------------------------- geodesics
@settings(max_examples=6)
@given(case=gl_cases(dtype=torch.float64))
def test_expmap2_is_third_order(case):
    """``|expmap2 − expmap|`` shrinks by ≈ 8 when ``t`` halves (at ``t = 0.1``, in float64).

    The order is a property of the map, measured where round-off cannot blur it; float32 is
    checked against float64 by the next test. (In float32 there is no ``t`` at which the
    ratio is clean: at 0.2 the fourth-order term moves it to 12 for some 1×1 points, at 0.1
    round-off moves it below 6.)
    """
    m, x = case.manifold, case.x
    u = scaled(m, x, case.u, 1.0)
    errs = []
    for s in (0.1, 0.05):
        exact = m.expmap(x, s * u, steps=100)
        errs.append(torch.linalg.vector_norm(m.expmap2(x, s * u) - exact, dim=(-2, -1)))
    ratio = errs[0] / errs[1]
    assert bool(((ratio > 6) & (ratio < 10)).all()), ratio


@settings(max_examples=6)
@given(case=gl_cases(dtype=torch.float32))
def test_expmap2_float32_agrees_with_float64(case):
    """The float32 map is the float64 map up to float32 round-off."""
    m, x = case.manifold, case.x
    u = scaled(m, x, case.u, 0.2)
    expected = m.expmap2(x.double(), u.double())
    assert rel_err(m.expmap2(x, u), expected) <= tol(torch.float32, 10)  # measured ≤ 0.7 eps


@settings(max_examples=6)
@given(case=gl_cases())
def test_geodesic_velocity_stays_horizontal(case):
    """The exact geodesic from a horizontal vector has horizontal velocity, and constant speed,
    throughout.

    The automatic step count holds the end point to ``rtol`` (``1e-8`` in float64, ``1e-5`` in
    float32) of the displacement; the velocity follows to about 10 times that (measured 8.7e-8
    in float64 on a mix path at factor condition 5, where 50 fixed steps missed by 2e-3), and
    the horizontal projection at ``y`` rounds to ``50 ε K³`` (``K`` the factors' condition at
    ``y``, the rounding bound of the GL maps; measured ≤ 6 ε K³ over 900 float32 paths). A path
    that leaves GL (the mix metric is not complete) is not a case.
    """
    m, x = case.manifold, case.x
    u = scaled(m, x, m.proju(x, case.u), 0.5)
    rtol = rtol_for(case.dtype)
    for t in (0.25, 0.5, 1.0):
        try:
            y, w = m.geodesic(x, t * u)
        except LeftManifold:
            reject()
        K = max(torch.linalg.cond(F.double()).max().item() for F in m.split(y))
        rounding = tol(case.dtype, 50) * K**3
        gap = m.norm(y, w - m.proju(y, w)) / m.norm(y, w)
        assert gap.max().item() <= rtol + rounding
        speed = m.norm(y, w) / m.norm(x, t * u)
        assert (speed - 1).abs().max().item() <= 100 * rtol + rounding


@settings(max_examples=6)
@given(case=gl_cases(dtype=torch.float64), horizontal=st.booleans())
def test_expmap_default_accuracy(case, horizontal):
    """Default ``expmap`` is accurate to ~1e-6 relative at ``||u|| = 0.1``."""
    m, x = case.manifold, case.x
    u = m.proju(x, case.u) if horizontal else case.u
    u = scaled(m, x, u, 0.1)
    reference = m.expmap(x, u, steps=160)  # RK4: 16⁴ times more accurate than 10 steps
    assert rel_err(m.expmap(x, u) - x, reference - x) <= 1e-6


@given(case=gl_cases())
def test_retr_transp_and_expmap_transp(case):
    m, x = case.manifold, case.x
    u = scaled(m, x, m.proju(x, case.u), 0.2)
    assert torch.equal(m.retr(x, u), x + u)
    y, w = m.retr_transp(x, u, case.v)
    assert torch.equal(y, x + u)
    assert metric_rel(m, y, m.proju(y, w), w) <= conditioned_tol(m, y)
    y2, w2 = m.expmap_transp(x, u, case.v)
    assert torch.allclose(y2, m.expmap(x, u))
    assert metric_rel(m, y2, w2, m.proju(y2, case.v)) <= tol(case.dtype, 10)
    assert torch.equal(m.transp(x, y, case.v), m.proju(y, case.v))
    assert torch.equal(m.projx(x), x)


# --------------------------------------------------------------------------- eps > 0
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eps_handles_rank_deficient_factors(metric, dtype):
    """With eps > 0 every map is defined and finite on rank-deficient factors."""
    g = gen(0)
    m = GLQuotient(5, metric, eps=1e-2)
    G = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
    G[..., 2] = G[..., 0] - G[..., 1]  # rank 2
    H = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    H[1, :, 1] = 0.0  # a zero column
    x = m.join(G, H).to(dtype)
    u = torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype)
    u = scaled(m, x, u, 0.1)  # the step size at which the default expmap is specified
    assert m.check_point_on_manifold(x)
    for out in (
        m.inner(x, u),
        m.proju(x, u),
        m.egrad2rgrad(x, u),
        m.christoffel(x, u),
        m.christoffel(x, u, 2 * u),
        m.expmap2(x, u),
        m.expmap(x, u),
    ):
        assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("method", ["proju", "egrad2rgrad", "christoffel", "expmap2", "inner"])
@pytest.mark.parametrize("metric", METRICS)
def test_eps_continuity(method, metric):
    """The relaxed geometry tends to the exact one as eps → 0 (error linear in eps)."""
    g = gen(1)
    x = GLQuotient(4, metric).join(conditioned((3,), 4, 2, 3.0, g), conditioned((3,), 5, 2, 3.0, g))
    u = 0.3 * torch.randn(x.shape, generator=g, dtype=torch.float64)
    exact = getattr(GLQuotient(4, metric), method)(x, u)
    errs = [
        rel_err(
            getattr(GLQuotient(4, metric, eps=e), method)(x, u), exact, 2 - (method == "inner") * 2
        )
        for e in (1e-3, 1e-5, 1e-7)
    ]
    assert errs[0] < 1e-1
    # linear convergence: a factor 100 in eps gives at least a factor 10 in error
    assert errs[1] < 0.1 * errs[0] and errs[2] < 0.1 * errs[1]


@pytest.mark.parametrize("metric", METRICS)
def test_eps_christoffel_vs_generic(metric):
    """The eps-relaxed closed-form Christoffel agrees with the generic autodiff path."""
    g = gen(2)
    m = GLQuotient(4, metric, eps=0.5)
    x = m.join(
        torch.randn(2, 4, 3, generator=g, dtype=torch.float64),
        torch.randn(2, 5, 3, generator=g, dtype=torch.float64),
    )
    u, v = (torch.randn(x.shape, generator=g, dtype=torch.float64) for _ in range(2))
    assert rel_err(m.christoffel(x, u), m.generic().christoffel(x, u)) <= 1e-10
    assert rel_err(m.christoffel(x, u, v), m.generic().christoffel(x, u, v)) <= 1e-10


# --------------------------------------------------------------------------- cached point
@pytest.mark.parametrize(
    "method", ["inner", "norm", "proju", "egrad2rgrad", "christoffel", "expmap2", "expmap"]
)
@settings(max_examples=5)
@given(case=gl_cases())
def test_cached_point_identical(method, case):
    """``m.at(x)`` gives bit-identical results to the uncached methods, also on reuse."""
    m, x, u = case.manifold, case.x, scaled(case.manifold, case.x, case.u, 0.3)
    p = m.at(x)
    expected = getattr(m, method)(x, u)
    for _ in range(2):
        assert torch.equal(getattr(m, method)(p, u), expected)
    assert m.at(p) is p


# --------------------------------------------------------------------------- geoopt checks
@pytest.mark.parametrize("metric", METRICS)
def test_check_point_and_vector_through_geoopt(metric):
    g = gen(3)
    m = GLQuotient(5, metric)
    x = m.join(conditioned((2,), 5, 3, 10.0, g), conditioned((2,), 4, 3, 10.0, g))
    ok, reason = m.check_point_on_manifold(x, explain=True)
    assert ok and "condition" in reason
    m.assert_check_point_on_manifold(x)

    bad = x.clone()
    bad[1, :5, 2] = bad[1, :5, 0]  # G of head 1 loses rank
    ok, reason = m.check_point_on_manifold(bad, explain=True)
    assert not ok and "rank deficient" in reason and "eps" in reason
    assert GLQuotient(5, metric, eps=1e-3).check_point_on_manifold(bad)

    nan = x.clone()
    nan[0, 0, 0] = float("nan")
    ok, reason = m.check_point_on_manifold(nan, explain=True)
    assert not ok and "finite" in reason

    ok, reason = m.check_point_on_manifold(torch.randn(3, 2, dtype=torch.float64), explain=True)
    assert not ok  # 3 rows: n=5 alone is more

    u = torch.randn(x.shape, generator=g, dtype=torch.float64)
    assert m.check_vector_on_tangent(x, m.proju(x, u))
    omega = torch.randn(2, 3, 3, generator=g, dtype=torch.float64)
    ok, reason = m.check_vector_on_tangent(x, m.vertical(m.at(x), omega), explain=True)
    assert not ok and "horizontal" in reason
    with pytest.raises(ValueError):
        m.assert_check_vector_on_tangent(x, u)


@pytest.mark.parametrize("metric", METRICS)
def test_dist_and_logmap_not_implemented(metric):
    m = GLQuotient(3, metric)
    x = m.random(6, 2, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="closed form"):
        m.dist(x, x)
    with pytest.raises(NotImplementedError, match="closed form"):
        m.logmap(x, x)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("metric", METRICS)
def test_bad_shapes(metric):
    m = GLQuotient(5, metric)
    x = m.random(9, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="shape"):
        m.proju(x, torch.randn(8, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="shape"):
        m.inner(x, torch.randn(9, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="h <= m"):
        m.proju(torch.randn(9, 5, dtype=torch.float64), torch.randn(9, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="h <= n"):
        m.proju(torch.randn(13, 6, dtype=torch.float64), torch.randn(13, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="n=5"):
        m.proju(torch.randn(5, 1, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="h <= m"):
        m.random(7, 3)
    with pytest.raises(ValueError, match="columns"):
        m.join(torch.randn(5, 3), torch.randn(4, 2))
    with pytest.raises(ValueError, match="rows"):
        m.join(torch.randn(4, 3), torch.randn(4, 3))


def test_bad_constructor_arguments():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="n must"):
            GLQuotient(bad)
    with pytest.raises(ValueError, match="metric"):
        GLQuotient(3, "euclidean")
    with pytest.raises(ValueError, match="eps"):
        GLQuotient(3, eps=-1e-3)
    with pytest.raises(ValueError, match="eps"):
        GLQuotient(3, eps=float("nan"))
    with pytest.raises(ValueError, match="exp_steps"):
        GLQuotient(3, exp_steps=0)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_point_rejected(metric, dtype):
    m = GLQuotient(3, metric)
    x = torch.ones(6, 2, dtype=dtype)
    u = torch.ones(6, 2, dtype=torch.float64)
    for method in ("proju", "inner", "egrad2rgrad", "christoffel", "expmap2"):
        with pytest.raises(ValueError, match="floating"):
            getattr(m, method)(x, u)


@pytest.mark.parametrize("metric", METRICS)
def test_integer_vector_rejected(metric):
    m = GLQuotient(3, metric)
    x = m.random(6, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="floating"):
        m.proju(x, torch.ones(6, 2, dtype=torch.int64))


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("factor", ["G", "H"])
@pytest.mark.parametrize(
    "method", ["proju", "egrad2rgrad", "christoffel", "expmap2", "expmap", "norm"]
)
def test_rank_deficient_factor_raises(metric, factor, method):
    """eps=0 and a rank-deficient factor: ValueError naming the problem and suggesting eps."""
    g = gen(4)
    m = GLQuotient(5, metric)
    G = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
    H = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    F = G if factor == "G" else H
    F[1, :, 2] = 0.0
    x = m.join(G, H)
    u = torch.randn(x.shape, generator=g, dtype=torch.float64)
    if metric == "mix" and method == "norm":
        # tr(Q η_Gᵀη_G) + tr(P η_Hᵀη_H) needs no inverse: defined (a semi-norm) and finite
        assert bool(torch.isfinite(m.norm(x, u)).all())
        return
    with pytest.raises(ValueError, match=r"rank deficient.*eps") as info:
        getattr(m, method)(x, u)
    assert f"{factor}ᵀ{factor}" in str(info.value)


@pytest.mark.parametrize("metric", METRICS)
def test_nearly_rank_deficient_raises(metric):
    """Columns dependent up to rounding: a ValueError naming ``GᵀG`` and suggesting eps.

    ``G[:, 2] = G[:, 0] + G[:, 1]`` rounded: ``cond(G) ≈ 7e15``, so ``cond(GᵀG) ≈ 3e31``, far
    past ``1/eps`` (the point is rank deficient to float64 precision, as
    ``_check_point_on_manifold`` says), and the computed ``GᵀG`` has its smallest eigenvalue
    at rounding level, of either sign. No finite answer is right there: where the Cholesky
    factorization of that Gram matrix happens to succeed (about a third of the seeds), the
    projection comes out finite but wrong (not idempotent, by 7e-2 to 5e-1). The ValueError is
    the right outcome; the library gives it when the factorization fails, which it does for
    this seed (checked first: ``info == 3``, the last pivot not positive).
    """
    g = gen(5)
    m = GLQuotient(5, metric)
    G = torch.randn(5, 3, generator=g, dtype=torch.float64)
    G[:, 2] = G[:, 0] + G[:, 1]
    assert torch.linalg.cholesky_ex(gram(G)).info.item() == 3  # the case this test is about
    x = m.join(G, torch.randn(4, 3, generator=g, dtype=torch.float64))
    u = torch.randn(x.shape, generator=g, dtype=torch.float64)
    for method in ("proju", "egrad2rgrad", "christoffel", "expmap2"):
        with pytest.raises(ValueError, match=r"GᵀG is not positive definite.*eps"):
            getattr(m, method)(x, u)


def test_float32_and_float64_preserved():
    for dtype in (torch.float32, torch.float64):
        for metric in METRICS:
            m = GLQuotient(4, metric)
            g = gen(6)
            x = m.join(conditioned((3,), 4, 2, 2.0, g), conditioned((3,), 3, 2, 2.0, g)).to(dtype)
            u = scaled(m, x, torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype), 0.1)
            for method in ("proju", "egrad2rgrad", "christoffel", "expmap2", "expmap"):
                assert getattr(m, method)(x, u).dtype == dtype
            assert m.inner(x, u).dtype == dtype
    assert math.isfinite(eps_of(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31), factor=st.sampled_from("GH"))
def test_point_check_flags_singular_to_working_precision(dtype, seed, factor):
    """The formulas factorize FᵀF (condition cond(F)²): the point check refuses cond(F)² ≥ 1/eps
    of the dtype, suggesting float64 or eps, and accepts cond(F)² well below it."""
    g = gen(seed)
    m = GLQuotient(6)
    limit = torch.finfo(dtype).eps ** -0.5  # cond(F) at which cond(FᵀF) reaches 1/eps
    bad = {f: 3 * limit if f == factor else 2.0 for f in "GH"}
    x_bad = m.join(conditioned((), 6, 3, bad["G"], g), conditioned((), 5, 3, bad["H"], g))
    ok, reason = m.check_point_on_manifold(x_bad.to(dtype), explain=True)
    assert not ok and f"{factor} is rank deficient" in reason and "float64" in reason
    x_ok = m.join(conditioned((), 6, 3, limit / 3, g), conditioned((), 5, 3, limit / 3, g))
    assert m.check_point_on_manifold(x_ok.to(dtype))
    assert GLQuotient(6, eps=1e-3).check_point_on_manifold(x_bad.to(dtype))


def test_point_check_on_an_empty_batch():
    m = GLQuotient(4)
    assert m.check_point_on_manifold(m.random(0, 7, 2))


def test_constructor_accepts_numpy_integers_and_rejects_infinite_eps():
    assert GLQuotient(np.int64(5)).n == 5
    with pytest.raises(ValueError, match="eps"):
        GLQuotient(3, eps=float("inf"))


@pytest.mark.parametrize("metric", METRICS)
def test_inner_checks_its_second_vector(metric):
    m = GLQuotient(4, metric)
    x = m.random(7, 2, dtype=torch.float64)
    u = torch.randn_like(x)
    with pytest.raises(ValueError, match="v has shape"):
        m.inner(x, u, torch.randn(7, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="v has dtype"):
        m.inner(x, u, u.float())


def test_interpolated_rejects_bad_arguments():
    with pytest.raises(ValueError, match="s must lie"):
        InterpolatedGLQuotient(3, 1.5)
    with pytest.raises(ValueError, match="n must be"):
        InterpolatedGLQuotient(0, 0.5)
    with pytest.raises(ValueError, match="h <= n"):
        InterpolatedGLQuotient(2, 0.5).proju(torch.ones(5, 3), torch.ones(5, 3))
