"""Element-wise GL(1) re-scaling quotient and the adaptive geometry."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quotientgeo import AdaptiveGeometry, RescaleQuotient
from quotientgeo.testing.numerics import gen, rel_err, tol
from quotientgeo.testing.oracles import autodiff_christoffel
from quotientgeo.testing.strategies import BATCHES, DTYPES, METRICS


@st.composite
def rescale_cases(draw, metric=None, dtype=None, batches=BATCHES, max_d=6):
    metric = draw(st.sampled_from(METRICS)) if metric is None else metric
    dtype = draw(st.sampled_from(DTYPES)) if dtype is None else dtype
    batch = draw(st.sampled_from(batches))
    d = draw(st.integers(1, max_d))
    g = gen(draw(st.integers(0, 2**31 - 1)))
    # |entries| in [0.5, 2] with random signs: the action is free and the metric well scaled
    mag = 0.5 + 1.5 * torch.rand(*batch, 2, d, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(*batch, 2, d, generator=g) < 0.5, -1.0, 1.0).double()
    x = (mag * sign).to(dtype)
    u, v = (torch.randn(*batch, 2, d, generator=g, dtype=torch.float64).to(dtype) for _ in "uv")
    log_alpha = draw(st.floats(-1.5, 1.5))  # |α| up to ~30: condition of the action ~1e3
    alpha = torch.exp(log_alpha * (2 * torch.rand(*batch, d, generator=g, dtype=torch.float64) - 1))
    alpha = alpha * torch.where(torch.rand(*batch, d, generator=g) < 0.5, -1.0, 1.0).double()
    return RescaleQuotient(metric), x, u, v, alpha.to(dtype)


def metric_rel(m, x, a, b):
    x, a, b = x.double(), a.double(), b.double()
    return (m.norm(x, a - b) / m.norm(x, b).clamp_min(1e-300)).max().item()


def rescale_metric_matrix(metric):
    def metric_matrix(xf):
        x = xf.reshape(2, -1)
        w = 1 / x.square() if metric == "inv" else x.flip(0).square()
        return torch.diag(w.reshape(-1))

    return metric_matrix


@given(rescale_cases())
def test_metric_invariance(case):
    m, x, u, v, alpha = case
    lhs = m.inner(m.act(x, alpha), m.push(x, u, alpha), m.push(x, v, alpha))
    scale = m.norm(x, u) * m.norm(x, v)
    err = ((lhs.double() - m.inner(x, u, v).double()).abs() / scale.double()).max().item()
    assert err <= tol(x.dtype, 100)


@given(rescale_cases())
def test_inner_formula(case):
    """inv ``Σ η_u ζ_u / u² + η_v ζ_v / v²``; mix ``Σ η_u ζ_u v² + η_v ζ_v u²``."""
    m, x, u, v, _ = case
    X, U, V = x.double(), u.double(), v.double()
    w = 1 / X.square() if m.metric_name == "inv" else X.flip(-2).square()
    expected = (U * V * w).sum((-2, -1))
    assert rel_err(m.inner(x, u, v), expected, 0) <= tol(x.dtype, 100) * (
        1 + (U.abs() * V.abs() * w).sum((-2, -1)).max().item() / expected.abs().min().item()
    )
    assert m.inner(x, u, keepdim=True).shape == (*x.shape[:-2], 1, 1)


@given(rescale_cases())
def test_proju(case):
    """Orthogonal to vertical, idempotent, on the shared horizontal space ``η_u/u = η_v/v``."""
    m, x, u, _, _ = case
    omega = torch.randn(x.shape[:-2] + x.shape[-1:], generator=gen(1), dtype=torch.float64)
    vert = m.vertical(m.at(x), omega.to(x.dtype))
    pu = m.proju(x, u)
    cos = m.inner(x, pu, vert).abs() / (m.norm(x, pu) * m.norm(x, vert))
    assert cos.max().item() <= tol(x.dtype, 100)
    assert metric_rel(m, x, m.proju(x, pu), pu) <= tol(x.dtype, 100)
    b = pu / x
    assert torch.allclose(b[..., 0, :], b[..., 1, :], rtol=tol(x.dtype, 100), atol=0)
    assert m.check_vector_on_tangent(x, pu)
    assert not m.check_vector_on_tangent(x, vert)


@pytest.mark.parametrize("method", ["proju", "egrad2rgrad", "christoffel", "expmap2", "expmap"])
@given(case=rescale_cases())
def test_equivariance(method, case):
    m, x, u, _, alpha = case
    xa = m.act(x, alpha)
    if method == "egrad2rgrad":  # the Euclidean gradient transforms as (∇_u / α, ∇_v α)
        grad = m.push(x, u, alpha.reciprocal())
        acted = m.egrad2rgrad(xa, grad)
        expected = m.push(x, m.egrad2rgrad(x, u), alpha)
        projected = m.metric_inv(m.at(xa), grad)  # what the projection inside egrad2rgrad receives
    elif method in ("expmap", "expmap2"):
        u = 0.2 * u / m.norm(x, u, keepdim=True)
        acted = getattr(m, method)(xa, m.push(x, u, alpha)) - xa
        expected = m.act(getattr(m, method)(x, u), alpha) - xa
    else:
        acted = getattr(m, method)(xa, m.push(x, u, alpha))
        expected = m.push(x, getattr(m, method)(x, u), alpha)
    if method in ("proju", "egrad2rgrad"):
        # an orthogonal projection rounds relative to its input: b = ½(ξ_u/u + ξ_v/v) can
        # cancel, leaving an output much shorter than the input
        if method == "proju":
            projected = m.push(x, u, alpha)
        gap = m.norm(xa, acted - expected).double() / m.norm(xa, projected).double()
        assert gap.max().item() <= tol(x.dtype, 200)
        return
    assert metric_rel(m, xa, acted, expected) <= tol(x.dtype, 200)


@given(rescale_cases(dtype=torch.float64, batches=((),), max_d=4))
def test_christoffel_vs_autodiff(case):
    m, x, u, v, _ = case
    expected = autodiff_christoffel(rescale_metric_matrix(m.metric_name), x, u)
    assert rel_err(m.christoffel(x, u), expected) <= 1e-12
    polar = 0.25 * (m.christoffel(x, u + v) - m.christoffel(x, u - v))
    assert rel_err(m.christoffel(x, u, v), polar) <= 1e-12
    assert rel_err(m.christoffel(x, u, v), m.christoffel(x, v, u)) <= 1e-14


@pytest.mark.parametrize("horizontal", [True, False])
@pytest.mark.parametrize("metric", METRICS)
@settings(max_examples=1)
@given(case=rescale_cases(dtype=torch.float64, batches=((2,),), max_d=3))
def test_expmap_equals_rk4_of_own_christoffel(metric, horizontal, case):
    """The closed-form geodesic is the RK4 integration of the generic Christoffel
    symbols (both metrics, also non-horizontal u; ||u/x|| ≤ 0.3 so 1 + 2bt > 0). RK4 with 100
    steps has truncation error ~(1/100)⁴·0.3⁵ ≈ 2e-11 relative."""
    _, x, u, _, _ = case
    m = RescaleQuotient(metric)
    u = m.proju(x, u) if horizontal else u
    u = 0.3 * u * x.abs().min() / u.abs().max()
    rk4 = m.generic().expmap(x, u, steps=100)
    assert rel_err(rk4 - x, m.expmap(x, u) - x) <= 1e-10


@given(rescale_cases(dtype=torch.float64))
def test_horizontal_geodesic_closed_forms(case):
    """inv ``(u e^{bt}, v e^{bt})``; mix ``(u √(1+2bt), v √(1+2bt))``; and metric norms
    inv ``2||b||²``, mix ``2||β ⊙ b||²``."""
    m, x, u, _, _ = case
    xi = m.proju(x, u)
    xi = 0.3 * xi * x.abs().min() / xi.abs().max()
    b = (xi / x)[..., :1, :]
    beta = x.prod(-2, keepdim=True)
    if m.metric_name == "inv":
        expected, sq = x * torch.exp(b), 2 * b.square().sum((-2, -1))
    else:
        expected, sq = x * torch.sqrt(1 + 2 * b), 2 * (beta * b).square().sum((-2, -1))
    assert rel_err(m.expmap(x, xi), expected) <= 1e-13
    assert rel_err(m.inner(x, xi), sq, 0) <= 1e-13
    if m.metric_name == "mix":  # β moves linearly: β(1) = β0 (1 + 2b)
        assert rel_err(m.expmap(x, xi).prod(-2, keepdim=True), beta * (1 + 2 * b)) <= 1e-13


@given(case=rescale_cases(), horizontal=st.booleans())
def test_expmap2_third_order(case, horizontal):
    """``expmap2 − expmap`` is O(t³): the error ratio between t and t/2 is ≈ 8 for horizontal
    u. For general u the t³ coefficient can vanish (mix: for special directions the geodesic's
    third derivative is ~0, the t⁴ term takes over), so there only ratio > 5 is asserted,
    which still rules out a second-order error (ratio 4)."""
    m, x, u, _, _ = case
    u = m.proju(x, u) if horizontal else u
    # per batch entry max |u / x| = 1, so the t³ term dominates float32 rounding at t/2; in
    # float64 a smaller t keeps the t⁴ term (which can oppose the t³ one) out of the ratio
    u = u / (u / x).abs().amax(dim=(-2, -1), keepdim=True)
    t = 0.02 if x.dtype == torch.float64 else 0.1
    errs = [
        torch.linalg.vector_norm(
            m.expmap2(x, s * u).double() - m.expmap(x.double(), s * u.double()), dim=(-2, -1)
        )
        for s in (t, t / 2)
    ]
    ratio = errs[0] / errs[1]
    if horizontal:
        assert bool(((ratio > 6) & (ratio < 10)).all()), ratio
    else:
        assert bool((ratio > 5).all()), ratio


@given(rescale_cases())
def test_egrad2rgrad_and_cache(case):
    m, x, u, _, _ = case
    # M⁻¹u written as the closed forms of the class docstring (u ⊙ x², or u divided by the
    # swapped x²): a precomputed reciprocal rounds differently, and the cancellation in
    # b = ½ (ξ_u/u + ξ_v/v) can amplify one ulp past 10 eps in float32.
    m_inv_u = u * x.square() if m.metric_name == "inv" else u / x.flip(-2).square()
    assert rel_err(m.egrad2rgrad(x, u), m.proju(x, m_inv_u)) <= tol(x.dtype, 10)
    p = m.at(x)
    for method in ("proju", "egrad2rgrad", "christoffel", "expmap2", "expmap", "inner"):
        assert torch.equal(getattr(m, method)(p, u), getattr(m, method)(x, u))


def test_bad_input_and_checks():
    m = RescaleQuotient("inv")
    x = m.random(3, 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\(\.\.\., 2, d\)"):
        m.proju(torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="shape"):
        m.proju(x, torch.randn(3, 2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="floating"):
        m.proju(x.long(), x)
    with pytest.raises(ValueError, match="metric"):
        RescaleQuotient("l2")
    zero = x.clone()
    zero[0, 1, 2] = 0
    ok, reason = m.check_point_on_manifold(zero, explain=True)
    assert not ok and "zero" in reason
    assert m.check_point_on_manifold(x)
    assert m.check_point_on_manifold(m.random(0, 2, 4))
    for metric in ("inv", "mix"):  # an error, not NaN
        for method in ("proju", "egrad2rgrad", "inner", "christoffel", "expmap"):
            with pytest.raises(ValueError, match="zero entries"):
                getattr(RescaleQuotient(metric), method)(zero, torch.ones_like(zero))
    with pytest.raises(NotImplementedError, match="closed form"):
        m.dist(x, x)
    with pytest.raises(NotImplementedError, match="closed form"):
        m.logmap(x, x)
    assert torch.equal(m.origin(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64))


# --------------------------------------------------------------------------- adaptive
@given(st.sampled_from(DTYPES), st.sampled_from(BATCHES), st.integers(1, 6), st.integers(0, 999))
def test_adaptive_geometry(dtype, batch, d, seed):
    """norm ``||ξ / |w|||``, rgrad ``∇ w²``, identity projection, Christoffel vs generic."""
    g = gen(seed)
    a = AdaptiveGeometry()
    w = (torch.randn(*batch, d, generator=g, dtype=torch.float64) + 3).to(dtype)
    xi = torch.randn(*batch, d, generator=g, dtype=torch.float64).to(dtype)
    k = tol(dtype, 50)
    assert rel_err(a.norm(w, xi), torch.linalg.vector_norm(xi / w.abs(), dim=-1), 0) <= k
    assert rel_err(a.egrad2rgrad(w, xi), xi * w.square(), 1) <= k
    assert torch.equal(a.proju(w, xi), xi)
    # the generic path inverts M by conjugate gradients, which stop at a relative residual
    # (1e-6 in float32): the solution error is bounded by that times cond(M) = (max|w|/min|w|)²
    cond = (w.abs().amax() / w.abs().amin()).item() ** 2
    assert rel_err(a.christoffel(w, xi), a.generic().christoffel(w, xi), 1) <= max(
        tol(dtype, 1000), (1e-13 if dtype == torch.float64 else 1e-6) * cond
    )
    assert a.inner(w, xi, keepdim=True).shape == (*batch, 1)


@settings(max_examples=1)
@given(st.integers(0, 999))
def test_adaptive_expmap_vs_rk4(seed):
    g = gen(seed)
    a = AdaptiveGeometry()
    w = torch.randn(4, generator=g, dtype=torch.float64) + 3
    xi = 0.3 * torch.randn(4, generator=g, dtype=torch.float64)
    assert rel_err(a.generic().expmap(w, xi, steps=100) - w, a.expmap(w, xi) - w, 1) <= 1e-10


def test_adaptive_floor():
    a = AdaptiveGeometry(floor=1e-6)
    w = torch.tensor([0.0, -2.0, 1e-9], dtype=torch.float64)
    xi = torch.ones(3, dtype=torch.float64)
    for out in (a.norm(w, xi), a.egrad2rgrad(w, xi), a.christoffel(w, xi), a.expmap(w, 1e-7 * xi)):
        assert bool(torch.isfinite(out).all())
    assert a.egrad2rgrad(w, xi)[0].item() == pytest.approx(1e-12)
    with pytest.raises(ValueError, match="floor"):
        AdaptiveGeometry(floor=0.0)
