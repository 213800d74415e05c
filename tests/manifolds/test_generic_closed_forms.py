"""The generic (autodiff) path of ``QuotientManifold`` agrees with the closed forms (float64).

``m.generic()`` uses only the primitives (``lie_shape``, ``vertical``, ``metric``), so this checks
the closed forms of ``GLQuotient``, ``RescaleQuotient``, ``ScaleQuotient`` and
``InterpolatedGLQuotient`` against an independent derivation, at ``1e-10`` relative: per method,
for the layouts of the GL projection, for broadcast point and vector batches and for the
conjugate-gradient projection; and the interpolated metric at ``s = 0`` and ``s = 1`` reproduces
the inv and mix quotients. (``check_quotient``'s ``generic.*`` properties make the same
comparison for every shipped manifold, at the contract's tolerance.)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quotientgeo import GLQuotient, RescaleQuotient
from quotientgeo.linalg import mT
from quotientgeo.manifolds import InterpolatedGLQuotient
from quotientgeo.testing.numerics import conditioned, gen, rel, rel_err, well_conditioned
from quotientgeo.testing.strategies import METRICS, gl_cases, interpolated_cases, scale_cases

DT = torch.float64
RTOL = 1e-10
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)
pytestmark = pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr")


# ---------------------------------------------------------------- GLQuotient, RescaleQuotient


def _gl(case):
    m, x, u, v = case.manifold, case.x, case.u, case.v
    return m, x, 0.3 * u / m.norm(x, u, keepdim=True), v


@pytest.mark.parametrize(
    "method",
    [
        "proju",
        "egrad2rgrad",
        "christoffel",
        "expmap2",
        pytest.param("expmap", marks=pytest.mark.slow),
    ],
)
@settings(max_examples=5)
@given(case=gl_cases(dtype=torch.float64, max_h=3))
def test_gl_generic_agrees(method, case):
    m, x, u, _ = _gl(case)
    assert rel_err(getattr(m.generic(), method)(x, u), getattr(m, method)(x, u)) <= RTOL


@pytest.mark.parametrize("same_rows", [True, False])
@settings(max_examples=6)
@given(data=st.data())
def test_gl_proju_layouts_agree_with_generic(same_rows, data):
    """The projection's shift has a fused path for ``n == m`` and a blockwise one otherwise;
    both must match the generic path, also for non-contiguous and broadcast tangent vectors."""
    case = data.draw(gl_cases(dtype=torch.float64, max_h=3, same_rows=same_rows))
    m, x, u, _ = _gl(case)
    assert (case.n == case.m) == same_rows
    expected = m.generic().proju(x, u)
    u_strided = mT(mT(u).contiguous())  # same values, transposed memory layout
    assert rel_err(m.proju(x, u_strided), expected) <= RTOL
    if case.batch:
        # one tangent vector broadcast over the batch of base points
        u0 = u.reshape(-1, *u.shape[-2:])[0]
        expected0 = m.generic().proju(x, u0.expand_as(x))
        assert rel_err(m.proju(x, u0), expected0) <= RTOL


@pytest.mark.parametrize("h", [2, 3])
def test_gl_generic_christoffel_batch_equal_h(h):
    """Regression: forward-mode AD of cholesky_solve with a broadcast identity was wrong."""
    g = gen(0)
    m = GLQuotient(h + 1, "inv")
    x = torch.randn(h, 2 * h + 2, h, generator=g, dtype=torch.float64)  # batch size == h
    u = torch.randn(x.shape, generator=g, dtype=torch.float64)
    assert rel_err(m.generic().christoffel(x, u), m.christoffel(x, u)) <= RTOL


@settings(max_examples=8)
@given(case=gl_cases(dtype=torch.float64, max_h=3))
def test_gl_generic_christoffel_bilinear_agrees(case):
    m, x, u, v = _gl(case)
    assert rel_err(m.generic().christoffel(x, u, v), m.christoffel(x, u, v)) <= RTOL
    assert rel_err(m.generic().inner(x, u, v), m.inner(x, u, v), 0) <= RTOL


@st.composite
def rescale_cases(draw):
    metric = draw(st.sampled_from(METRICS))
    batch = draw(st.sampled_from(((), (2,), (2, 3))))
    d = draw(st.integers(1, 5))
    g = gen(draw(st.integers(0, 2**31 - 1)))
    # entries bounded away from zero: |entry| in [0.5, 2], random signs
    mag = 0.5 + 1.5 * torch.rand(*batch, 2, d, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(*batch, 2, d, generator=g) < 0.5, -1.0, 1.0)
    x = (mag * sign).to(torch.float64)
    u = 0.1 * torch.randn(*batch, 2, d, generator=g, dtype=torch.float64)
    v = torch.randn(*batch, 2, d, generator=g, dtype=torch.float64)
    return RescaleQuotient(metric), x, u, v


@pytest.mark.parametrize("method", ["proju", "egrad2rgrad", "christoffel", "expmap2"])
@settings(max_examples=8)
@given(case=rescale_cases())
def test_rescale_generic_agrees(method, case):
    m, x, u, v = case
    assert rel_err(getattr(m.generic(), method)(x, u), getattr(m, method)(x, u)) <= RTOL
    if method == "christoffel":
        assert rel_err(m.generic().christoffel(x, u, v), m.christoffel(x, u, v)) <= RTOL


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("method", ["proju", "christoffel", "expmap2"])
@settings(max_examples=4)
@given(seed=st.integers(0, 2**31), h=st.sampled_from([2, 3]), k=st.sampled_from([2, 3]))
def test_generic_broadcasts_point_and_vector_batches(metric, method, seed, h, k):
    """Point batch (1, k) and vector batch (k, 1): the generic path broadcasts like the closed
    form (regression: it reshaped u to the point's batch, which was wrong or crashed)."""
    g = gen(seed)
    m = GLQuotient(h + 1, metric)
    # well-conditioned factors: RTOL is a bound for cond(G), cond(H) <= 5 (errors grow as cond²)
    x = torch.cat(
        [conditioned((1, k), h + 1, h, 5.0, g), conditioned((1, k), h, h, 5.0, g)], dim=-2
    )
    u = 0.1 * torch.randn(k, 1, 2 * h + 1, h, generator=g, dtype=torch.float64)
    expected = getattr(m, method)(x, u)
    assert expected.shape == (k, k, 2 * h + 1, h)
    assert rel_err(getattr(m.generic(), method)(x, u), expected) <= RTOL


# ---------------------------------------------------------------- ScaleQuotient
@SETTINGS
@given(scale_cases())
def test_scale_closed_forms_match_generic(case):
    m, x, u, v, _, _ = case
    gen = m.generic()
    for name in ("proju", "egrad2rgrad", "christoffel", "expmap2"):
        assert rel(getattr(m, name)(x, u), getattr(gen, name)(x, u)) < RTOL, name
    assert rel(m.christoffel(x, u, v), gen.christoffel(x, u, v)) < RTOL
    assert rel(m.inner(x, u, v), gen.inner(x, u, v)) < RTOL


@settings(max_examples=5, deadline=None, derandomize=True)
@given(scale_cases())
def test_scale_exact_expmap_matches_rk4(case):
    m, x, u, *_ = case
    u = 0.5 * u / m.norm(x, u, keepdim=True)  # RK4 with 40 steps: error ~1e-9 at this length
    assert rel(m.expmap(x, u), m.generic().expmap(x, u, steps=40)) < 1e-7


# ---------------------------------------------------------------- InterpolatedGLQuotient
@pytest.mark.parametrize(("s", "metric"), [(0.0, "inv"), (1.0, "mix")])
@SETTINGS
@given(data=st.data())
def test_interpolated_endpoints_reproduce_gl(s, metric, data):
    ip, x, u, v, _, _ = data.draw(interpolated_cases(s=s))
    gl = GLQuotient(ip.n, metric)
    assert rel(ip.inner(x, u, v), gl.inner(x, u, v)) < RTOL
    for name in ("proju", "egrad2rgrad", "christoffel", "expmap2"):
        assert rel(getattr(ip, name)(x, u), getattr(gl, name)(x, u)) < RTOL, name
    assert rel(ip.christoffel(x, u, v), gl.christoffel(x, u, v)) < RTOL


@pytest.mark.parametrize("s", [0.0, 0.4, 1.0])
def test_interpolated_conjugate_gradient_path(s):
    """h² > dense_max: the projection by conjugate gradients matches the dense normal equations."""
    gen = torch.Generator().manual_seed(7)
    h = 6
    x = torch.cat([well_conditioned(gen, (2,), 9, h), well_conditioned(gen, (2,), 8, h)], -2)
    u = torch.randn(x.shape, generator=gen, dtype=DT)
    dense, cg = (
        InterpolatedGLQuotient(9, s, dense_max=64),
        InterpolatedGLQuotient(9, s, dense_max=0),
    )
    assert rel(cg.proju(x, u), dense.proju(x, u)) < RTOL
    assert rel(cg.egrad2rgrad(x, u), dense.egrad2rgrad(x, u)) < RTOL
    if s in (0.0, 1.0):
        gl = GLQuotient(9, "inv" if s == 0 else "mix")
        assert rel(cg.proju(x, u), gl.proju(x, u)) < RTOL


def test_interpolated_metric_inv_is_the_inverse():
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([well_conditioned(gen, (3,), 5, 3), well_conditioned(gen, (3,), 4, 3)], -2)
    u = torch.randn(x.shape, generator=gen, dtype=DT)
    for s in (0.0, 0.3, 1.0):
        m = InterpolatedGLQuotient(5, s)
        p = m.at(x)
        assert rel(m.metric(p, m.metric_inv(p, u)), u) < 1e-12
        assert rel(m.metric_inv(p, u), m.generic().metric_inv(p, u)) < RTOL


# ---------------------------------------------------------------- the generic view itself
def test_generic_path_delegates_primitives_and_precondition():
    """The generic view uses the manifold's primitives and preconditioner, nothing else."""
    m = GLQuotient(4, "mix")
    g = m.generic()
    x = m.random(2, 7, 3, dtype=DT)
    r = torch.randn(2, 3, 3, dtype=DT)
    p = g.at(x)
    torch.testing.assert_close(g.precondition(p, r), m.precondition(m.at(x), r))
    assert g.lie_shape(p) == (3, 3) and g.ndim == m.ndim
    assert g.generic(metric_inv=True).own_metric_inv
