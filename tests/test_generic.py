"""The generic (autodiff) path of QuotientManifold agrees with every closed form (float64, eps=0).

``m.generic()`` uses only the primitives (``lie_shape``, ``vertical``, ``metric``), so this checks
the closed forms of GLQuotient and RescaleQuotient against an independent derivation.
"""

from __future__ import annotations

import pytest
import torch
from conftest import METRICS, conditioned, gen, gl_cases, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

from quotientgeo import GLQuotient, RescaleQuotient
from quotientgeo.linalg import mT

RTOL = 1e-10


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
