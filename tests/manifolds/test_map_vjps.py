"""``expmap2_vjp`` and ``expmap_vjp``: the vector-Jacobian products ``J(u)ᵀ d`` of the maps.

The GL total spaces' closed forms (``h × h`` autodiff only: the second-order map for every
metric, the inv metric's closed-form geodesic) against three independent computations, in
float64: reverse-mode autodiff through the map itself (the base class's default), the generic
path (``m.generic()``: the Christoffel symbols by autodiff of the metric, the geodesic by RK4),
and the adjoint identity ``<J(u)ᵀ d, v> = <d, J(u) v>`` with ``J(u) v`` by forward-mode autodiff;
for every metric (inv, mix, interpolated), frame and ball damping, the rotary subgroup, ``G``
and ``H`` with as many rows or not, batch dimensions, seeds and speed bounds.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quotientgeo import BallDamping, FrameDamping, GLQuotient, RotaryGLQuotient
from quotientgeo.geometry.perturbation import PerturbationSpace, in_ball
from quotientgeo.manifolds.base import QuotientManifold, speeds_at_most
from quotientgeo.manifolds.gl import GLInvQuotient
from quotientgeo.testing.numerics import conditioned, gen, rel_err
from quotientgeo.testing.strategies import gl_cases

DT = torch.float64
RTOL = 1e-11  # the factors' condition numbers are at most 10: cond² · a few hundred eps


def _damped(kind: str, n: int, metric, radius: float):
    if kind == "frame":
        return in_ball(GLQuotient(n, metric, FrameDamping(1.0, 0.5)), radius)
    if kind == "ball":
        return in_ball(GLQuotient(n, metric, BallDamping()), radius)
    if kind == "rotary":
        return RotaryGLQuotient(n, metric)
    return GLQuotient(n, metric, eps=1e-3 if kind == "relaxed" else 0.0)


@st.composite
def cases(draw, method: str = "expmap2"):
    if method == "expmap":  # the closed-form geodesic: the inv metric, unrelaxed
        kind, metric = draw(st.sampled_from(["plain", "rotary"])), "inv"
    else:
        kind = draw(st.sampled_from(["plain", "relaxed", "frame", "ball", "rotary"]))
        metric = draw(st.sampled_from(["inv", "mix", 0.3]))
    h = 2 * draw(st.integers(1, 2)) if kind == "rotary" else draw(st.integers(1, 4))
    n = h + draw(st.integers(0, 3))
    m = n if draw(st.booleans()) else h + draw(st.integers(0, 3))
    batch = draw(st.sampled_from([(), (3,), (2, 3)]))
    g = gen(draw(st.integers(0, 2**31 - 1)))
    x = torch.cat([conditioned(batch, n, h, 10.0, g), conditioned(batch, m, h, 10.0, g)], -2)
    u, d, v = (torch.randn(x.shape, generator=g, dtype=DT) for _ in range(3))
    radius = draw(st.floats(0.05, 1.0))
    manifold = _damped(kind, n, metric, radius)
    return manifold, x, radius * u / u.norm(), d, v


@pytest.mark.parametrize("method", ["expmap2", "expmap"])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_the_closed_form_is_autodiff_through_the_map(method, data):
    m, x, u, d, _ = data.draw(cases(method))
    bound = data.draw(st.sampled_from([None, 2.0]))  # the squarings of the exponentials
    vjp = getattr(QuotientManifold, f"{method}_vjp")  # autodiff through m's own map
    with speeds_at_most(bound):
        assert rel_err(getattr(m, f"{method}_vjp")(x, u, d), vjp(m, x, u, d)) <= RTOL


@pytest.mark.parametrize("method", ["expmap2", "expmap"])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_the_closed_form_is_the_adjoint_of_the_maps_derivative(method, data):
    m, x, u, d, v = data.draw(cases(method))
    _, Jv = torch.func.jvp(lambda w: getattr(m, method)(x, w), (u,), (v,))
    lhs, rhs = (getattr(m, f"{method}_vjp")(x, u, d) * v).sum(), (d * Jv).sum()
    assert abs(float(lhs - rhs)) <= RTOL * float((d.abs() * Jv.abs()).sum())


@settings(max_examples=8, deadline=None)
@given(case=gl_cases(dtype=DT, max_h=3))
def test_the_closed_form_agrees_with_the_generic_path(case):
    m, x = case.manifold, case.x
    u = 0.3 * case.u / m.norm(x, case.u, keepdim=True)
    assert rel_err(m.expmap2_vjp(x, u, case.v), m.generic().expmap2_vjp(x, u, case.v)) <= 1e-10


@pytest.mark.slow
@settings(max_examples=4, deadline=None)
@given(case=gl_cases(metric="inv", dtype=DT, max_h=3))
def test_the_closed_form_geodesic_agrees_with_the_integrated_one(case):
    """The generic path integrates the geodesic by RK4: agreement to its accuracy."""
    m, x = case.manifold, case.x
    u = 0.3 * case.u / m.norm(x, case.u, keepdim=True)
    assert rel_err(m.expmap_vjp(x, u, case.v), m.generic().expmap_vjp(x, u, case.v)) <= 1e-8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_and_shape_follow_the_inputs(dtype):
    g = gen(3)
    m = GLQuotient(4, "mix")
    x = torch.cat([conditioned((2,), 4, 3, 5.0, g), conditioned((2,), 6, 3, 5.0, g)], -2)
    x = x.to(dtype)
    u, d = 0.1 * torch.randn_like(x), torch.randn_like(x)
    out = m.expmap2_vjp(x, u, d)
    assert out.dtype == dtype and out.shape == x.shape
    with pytest.raises(ValueError):
        m.expmap2_vjp(x, u, d[..., :-1, :])


def test_a_perturbation_space_pulls_back_through_it():
    """``PerturbationSpace.pullback`` is the manifold's ``expmap2_vjp`` or ``expmap_vjp`` at
    the space's speed bound (autodiff through the map up to rounding), ``d`` itself for the
    first-order map."""
    g = gen(5)
    m = GLQuotient(3, "inv")
    x = torch.cat([conditioned((4,), 3, 2, 5.0, g), conditioned((4,), 5, 2, 5.0, g)], -2)
    u, d = 0.1 * torch.randn_like(x), torch.randn_like(x)
    for move in ("expmap2", "expmap"):
        space = PerturbationSpace(m, x, move, m, speed=1.0)
        with speeds_at_most(1.0):
            expected = getattr(m, f"{move}_vjp")(x, u, d)
        torch.testing.assert_close(space.pullback(u, d), expected, rtol=0, atol=0)
        _, vjp = torch.func.vjp(lambda w, move=move: getattr(m, move)(x, w), u)
        torch.testing.assert_close(space.pullback(u, d), vjp(d)[0], rtol=1e-12, atol=1e-12)
    assert PerturbationSpace(m, x, "retr", m).pullback(u, d) is d


def test_a_subclass_with_its_own_map_gets_the_autodiff_of_that_map():
    """A quotient (or total space) that overrides ``expmap2``/``expmap`` with another map is
    not given the closed form of the map it replaced."""

    class Scaled(GLInvQuotient):
        def expmap2(self, x, u):
            return super().expmap2(x, 2.0 * u)

        def expmap(self, x, u, *, steps=None):
            return super().expmap(x, 0.5 * u, steps=steps)

    g = gen(7)
    m = Scaled(3)
    x = torch.cat([conditioned((2,), 3, 2, 5.0, g), conditioned((2,), 4, 2, 5.0, g)], -2)
    u, d = 0.1 * torch.randn_like(x), torch.randn_like(x)
    for method in ("expmap2", "expmap"):
        _, vjp = torch.func.vjp(lambda w, method=method: getattr(m, method)(x, w), u)
        got = getattr(m, f"{method}_vjp")(x, u, d)
        torch.testing.assert_close(got, vjp(d)[0], rtol=1e-12, atol=1e-12)
