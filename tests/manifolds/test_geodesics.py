"""Exact geodesics: the closed-form inv geodesic and the span-reduced integrator of the GL metrics.

References are independent computations: RK4 with many steps (the integrator, itself checked
against the full-space autodiff integration of the generic base at equal step counts), the
group action, the metric, and finite differences.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from unittest import mock

import pytest
import torch
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from quotientgeo import GLQuotient, RotaryGLQuotient
from quotientgeo.bench.cost import CostCounter
from quotientgeo.linalg import DEFERRED_SQUARINGS, DeferredChecks, mT
from quotientgeo.manifolds import GLTotalSpace
from quotientgeo.manifolds.base import speeds_at_most
from quotientgeo.manifolds.gl import total as total_module
from quotientgeo.manifolds.gl.inv import inv_geodesic, inv_geodesics, squarings_at_speed
from quotientgeo.manifolds.ode import MAX_STEPS, LeftManifold, controlled, rk4, rtol_for, steps_for
from quotientgeo.testing.numerics import conditioned, gen, rel_err, tol
from quotientgeo.testing.strategies import gl_cases

sizes = st.floats(0.05, 3.0)


def scaled(m, x, u, size):
    return size * u / m.norm(x, u, keepdim=True)


def integrated(m, x, u, t=1.0, steps=1000):
    """The span-reduced RK4 integration of the GL total space, whatever ``m``'s own path is."""
    return GLTotalSpace.geodesic(m.total, x, u, t, steps=steps)


def displacement_err(y, ref, x):
    """``||y - ref|| / ||ref - x||`` (max over the batch), float64."""
    return rel_err(y - x, ref - x)


def metric_displacement_err(m, y, ref, x):
    """``||y - ref||_x / ||ref - x||_x`` (max over the batch), float64: the relative error an
    automatic step count states, in the metric at the start point."""
    x, y, ref = x.double(), y.double(), ref.double()
    return (m.norm(x, y - ref) / m.norm(x, ref - x)).max().item()


# --------------------------------------------------------------------------- closed form
@settings(max_examples=6)
@given(case=gl_cases(metric="inv", dtype=torch.float64), size=sizes, horizontal=st.booleans())
def test_inv_closed_form_equals_fine_rk4(case, size, horizontal):
    m, x = case.manifold, case.x
    u = scaled(m, x, m.proju(x, case.u) if horizontal else case.u, size)
    y, w = m.geodesic(x, u)
    y_ref, w_ref = integrated(m, x, u, steps=1000)
    assert displacement_err(y, y_ref, x) <= 1e-10
    assert rel_err(w, w_ref) <= 1e-10


def _killing_speed(F, Omega, B):
    """``g_F(K, K)`` of the Killing field ``K(F) = ΩF + FB`` of the inv factor metric."""
    K = Omega @ F + F @ B
    return torch.linalg.solve(mT(F) @ F, mT(K) @ K).diagonal(dim1=-2, dim2=-1).sum(-1)


@settings(max_examples=8)
@given(
    n=st.integers(1, 7),
    h=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
    variant=st.sampled_from(["closed form", "B = Xᵀ", "no X − Xᵀ term"]),
)
def test_inv_orbit_is_geodesic_because_the_point_is_critical(n, h, seed, variant):
    """The derivation in the docs: an orbit ``t ↦ expm(tΩ) F expm(tB)`` of isometries is a
    geodesic iff ``F`` is a critical point of ``‖K‖²`` (``∇_K K = −½ grad g(K, K)`` for a
    Killing field ``K``); the closed form's ``Ω`` and ``B = R⁻¹XᵀR`` make it one, and the
    gradient vanishes. Two wrong subgroups do not (for ``h > 1``), so the check can fail."""
    n = max(n, h)
    g = gen(seed)
    F = conditioned((), n, h, 3.0, g)
    xi = torch.randn(n, h, generator=g, dtype=torch.float64)
    Q, R = torch.linalg.qr(F)
    W = xi @ torch.linalg.inv(R)
    X = mT(Q) @ W
    W_perp = W - Q @ X
    skew = X - mT(X)
    if variant == "no X − Xᵀ term":
        skew = torch.zeros_like(X)
    Omega = W_perp @ mT(Q) - Q @ mT(W_perp) + Q @ skew @ mT(Q)
    B = mT(X) if variant == "B = Xᵀ" else torch.linalg.solve(R, mT(X) @ R)
    point = F.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(_killing_speed(point, Omega, B), point)
    scale = _killing_speed(F, Omega, B) / F.norm()
    if variant == "closed form":
        assert (Omega @ F + F @ B - xi).norm() <= 1e-12 * xi.norm()  # the initial velocity
        assert grad.norm() <= 1e-12 * scale  # measured ≤ 1.2e-14
    elif h > 1:  # for h = 1 the wrong subgroups are the right one
        assert grad.norm() > 1e-3 * scale  # measured ≥ 0.02


@settings(max_examples=8)
@given(case=gl_cases(metric="inv"), size=sizes)
def test_inv_closed_form_has_constant_speed_and_rescales_time(case, size):
    m, x = case.manifold, case.x
    u = scaled(m, x, m.proju(x, case.u), size)
    # rounding is relative to the point: relative to a displacement of size s it is ε / s
    k = tol(case.dtype, 1e3) * max(size, 1.0) ** 2
    kd = k / min(size, 1.0)
    for t in (0.3, 1.0, 1.7):
        y, w = m.geodesic(x, u, t)
        assert (m.norm(y, w) / size - 1).abs().max().item() <= k
        # γ_{aξ}(t) = γ_ξ(a t)
        y2, w2 = m.geodesic(x, t * u)
        assert displacement_err(y2, y, x) <= kd
        assert rel_err(w2, t * w) <= k
    # per-point times broadcast over the batch dimensions
    times = 0.2 + 1.5 * torch.rand(case.batch, generator=gen(case.seed), dtype=case.dtype)
    y, _ = m.geodesic(x, u, times)
    y_each = m.geodesic(x, u * times[..., None, None])[0]
    assert displacement_err(y, y_each, x) <= kd / 0.2


@settings(max_examples=8)
@given(case=gl_cases(metric="inv"), size=sizes, log_cond=st.floats(0.0, 1.5))
def test_inv_closed_form_is_equivariant_and_stays_horizontal(case, size, log_cond):
    m, x = case.manifold, case.x
    u = scaled(m, x, m.proju(x, case.u), size)
    A = case.group(10.0**log_cond)
    k = tol(case.dtype, 1e3) * 10.0 ** (3 * log_cond) * max(size, 1.0) ** 2
    xa = m.act(x, A)
    ya, wa = m.geodesic(xa, m.push(x, u, A))
    y, w = m.geodesic(x, u)
    assert displacement_err(ya, m.act(y, A), xa) <= k / min(size, 1.0)
    assert rel_err(wa, m.push(y, w, A)) <= k
    for t in (0.5, 1.0):
        y, w = m.geodesic(x, u, t)
        gap = m.norm(y, w - m.proju(y, w)) / m.norm(y, w)
        assert gap.max().item() <= k


@settings(max_examples=8)
@given(
    case=gl_cases(metric="inv", dtype=torch.float64),
    size=sizes,
    rotary=st.booleans(),
)
def test_inv_expmap_is_the_geodesic_point_without_its_velocity(case, size, rotary):
    """``expmap`` skips ``γ'(1)`` and gives ``geodesic(x, u)[0]`` to the last bit, on the GL
    quotient and on the rotary one that shares its closed form; its gradient is the point's."""
    m, x = case.manifold, case.x
    if rotary:
        h = x.shape[-1]
        if h % 2:
            reject()
        m = RotaryGLQuotient(m.n, "inv")
    u = scaled(m, x, m.proju(x, case.u), size).requires_grad_(True)
    point, _ = m.geodesic(x, u)
    moved = m.expmap(x, u)
    assert torch.equal(moved, point)
    cotangent = torch.randn_like(point)
    (expected,) = torch.autograd.grad(point, u, cotangent)
    (got,) = torch.autograd.grad(m.expmap(x, u), u, cotangent)
    assert torch.equal(got, expected)


@settings(max_examples=12)
@given(
    case=gl_cases(metric="inv", dtype=torch.float64),
    size=st.floats(1e-5, 4.0),
    horizontal=st.booleans(),
    t=st.sampled_from([1.0, 0.5, -1.0]),
)
def test_inv_geodesic_within_a_speed_bound_squares_only_as_often_as_the_bound_needs(
    case, size, horizontal, t
):
    """Inside ``speeds_at_most(ν)``, a velocity of norm ``ν`` moves the point to the last bit
    as without the bound (the squarings the bound allows suffice: no check fails), in fewer
    operators where the bound needs fewer than the deferred maximum of squarings."""
    m, x = case.manifold, case.x
    u = scaled(m, x, m.proju(x, case.u) if horizontal else case.u, size)
    with DeferredChecks(factorisations=False) as free, CostCounter() as unbounded:
        expected = m.geodesic(x, u, t)
    with (
        DeferredChecks(factorisations=False) as bounded,
        CostCounter() as counted,
        speeds_at_most(size),
    ):
        got = m.geodesic(x, u, t)
    failed = bounded.failed()
    assert failed is not None and not bool(failed) and not bool(free.failed())
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    needed = squarings_at_speed(x.shape[-1], size * abs(t))
    fewer = 2 * DEFERRED_SQUARINGS - sum(needed)
    assert counted.by_op["where"] == unbounded.by_op["where"] - fewer


def test_inv_speed_bound_holds_for_the_widest_generator():
    """The velocity whose generator is widest in the 1-norm for its speed (``X`` skew with one
    constant column, ``W⊥ = 0``: ``‖X - Xᵀ‖₁ ≈ √(2h)·‖X‖_F``) needs 3 squarings at this size,
    which the bound gives (a bound without the skew part's factor 2 would give 2: a check
    fails)."""
    h, n, c = 16, 20, 0.07
    g = gen(0)
    F = conditioned((), n, h, 3.0, g)
    L = torch.linalg.cholesky(mT(F) @ F)
    v = torch.full((h, 1), c, dtype=torch.float64)
    v[0] = 0.0
    e = torch.zeros(h, 1, dtype=torch.float64)
    e[0] = 1.0
    X = v @ mT(e) - e @ mT(v)  # ‖X - Xᵀ‖₁ = 2c(h - 1) = 2.1 > 0.5 · 2²
    xi = F @ torch.linalg.solve_triangular(mT(L), X @ mT(L), upper=True, left=True)
    m = GLQuotient(n, "inv")
    x = m.join(F, conditioned((), n, h, 3.0, g))
    u = m.join(xi, torch.zeros_like(xi))
    speed = float(m.norm(x, u))
    assert speed == pytest.approx(float(torch.linalg.matrix_norm(X)), rel=1e-12)
    assert squarings_at_speed(h, speed)[0] == 3
    with DeferredChecks(factorisations=False) as checks, speeds_at_most(speed):
        y = m.expmap(x, u)
    failed = checks.failed()
    assert failed is not None and not bool(failed)
    torch.testing.assert_close(y, m.expmap(x, u), rtol=0, atol=0)


def test_inv_geodesic_beyond_its_speed_bound_fails_its_checks():
    """A velocity faster than the promise is not moved wrongly: its exponentials fail their
    checks (``NaN``, and a failure recorded inside deferred checks)."""
    m = GLQuotient(6, "inv")
    g = gen(3)
    x = m.random(2, 12, 3, generator=g, dtype=torch.float64)
    u = scaled(m, x, m.proju(x, torch.randn(x.shape, generator=g, dtype=x.dtype)), 3.0)
    with DeferredChecks(factorisations=False) as checks, speeds_at_most(1e-3):
        y = m.expmap(x, u)
    failed = checks.failed()
    assert failed is not None and bool(failed) and bool(y.isnan().any())


@pytest.mark.parametrize("seed", range(3))
def test_inv_closed_form_velocity_in_the_column_space_and_zero(seed):
    """``W⊥ = 0`` (``ξ = F B``) and ``ξ = 0`` need no special case."""
    g = gen(seed)
    F = conditioned((3,), 7, 3, 5.0, g)
    L = torch.linalg.cholesky(mT(F) @ F)
    B = 0.3 * torch.randn(3, 3, 3, generator=g, dtype=torch.float64)
    m = GLQuotient(7, "inv")
    x = m.join(F, F.clone())
    u = m.join(F @ B, torch.zeros_like(F))
    y_ref, _ = integrated(m, x, u, steps=2000)
    y, _ = inv_geodesic(F, F @ B, L)
    assert rel_err(y - F, m.split(y_ref)[0] - F) <= 1e-10
    y0, w0 = inv_geodesic(F, torch.zeros_like(F), L)
    assert torch.allclose(y0, F, rtol=0, atol=1e-14) and bool((w0 == 0).all())


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lead=st.sampled_from([(), (3,), (2, 2)]),
    rows=st.tuples(st.integers(3, 8), st.integers(3, 8)),
    h=st.integers(1, 3),
    t=st.sampled_from([1.0, 0.7, -0.4]),
)
def test_inv_geodesics_of_two_factors_equal_each_factor_alone(seed, lead, rows, h, t):
    """The factors of one point batched (every ``h × h`` step once for both, row counts apart)
    give each factor's own geodesic, point and velocity, to rounding."""
    g = gen(seed)
    Fs = [conditioned(lead, n, h, 4.0, g) for n in rows]
    xis = [0.4 * torch.randn(F.shape, generator=g, dtype=F.dtype) for F in Fs]
    Ls = [torch.linalg.cholesky(mT(F) @ F) for F in Fs]
    together = inv_geodesics(list(zip(Fs, xis, strict=True)), torch.stack(Ls), t)
    for F, xi, L, (point, velocity) in zip(Fs, xis, Ls, together, strict=True):
        alone, alone_velocity = inv_geodesic(F, xi, L, t)
        assert velocity is not None and point.shape == F.shape
        assert rel_err(point, alone) <= 1e-13 and rel_err(velocity, alone_velocity) <= 1e-13
    points = inv_geodesics(list(zip(Fs, xis, strict=True)), torch.stack(Ls), t, velocity=False)
    assert all(
        v is None and torch.equal(p, q) for (p, v), (q, _) in zip(points, together, strict=True)
    )


@pytest.mark.parametrize("seed", range(2))
def test_inv_closed_form_gradients_match_finite_differences(seed):
    g = gen(seed)
    F = conditioned((2,), 5, 2, 3.0, g)
    L = torch.linalg.cholesky(mT(F) @ F)
    for xi in (torch.zeros_like(F), 0.5 * torch.randn(F.shape, generator=g, dtype=F.dtype)):
        xi.requires_grad_(True)
        assert torch.autograd.gradcheck(lambda v: inv_geodesic(F, v, L, 0.8), (xi,))


def test_inv_closed_form_float32_agrees_with_float64():
    g = gen(5)
    m = GLQuotient(9, "inv")
    x = m.join(conditioned((4,), 9, 3, 10.0, g), conditioned((4,), 6, 3, 10.0, g))
    u = scaled(m, x, m.proju(x, torch.randn(x.shape, generator=g, dtype=x.dtype)), 1.0)
    y64 = m.expmap(x, u)
    y32 = m.expmap(x.float(), u.float())
    assert y32.dtype == torch.float32
    assert displacement_err(y32, y64, x) <= 1e-5


@settings(max_examples=6)
@given(case=gl_cases(metric="inv", dtype=torch.float64, max_h=4), size=sizes)
def test_rotary_inv_uses_the_same_total_space_geodesic(case, size):
    h = case.h if case.h % 2 == 0 else None
    if h is None:
        return
    rot = RotaryGLQuotient(case.n, "inv")
    x = case.x
    u = scaled(rot, x, rot.proju(x, case.u), size)
    y, w = rot.geodesic(x, u)
    y_ref, _ = integrated(case.manifold, x, u, steps=1000)
    assert displacement_err(y, y_ref, x) <= 1e-10
    # the velocity stays horizontal for the subgroup too
    assert (rot.norm(y, w - rot.proju(y, w)) / rot.norm(y, w)).max().item() <= 1e-10


def test_inv_with_eps_integrates():
    m = GLQuotient(5, "inv", eps=0.1)
    g = gen(3)
    x = m.join(conditioned((2,), 5, 2, 3.0, g), conditioned((2,), 4, 2, 3.0, g))
    u = scaled(m, x, torch.randn(x.shape, generator=g, dtype=x.dtype), 0.5)
    y = m.expmap(x, u)
    assert displacement_err(y, integrated(m, x, u, steps=400)[0], x) <= rtol_for(x.dtype)
    # and the relaxed geometry is not the closed form of the exact one
    assert displacement_err(y, GLQuotient(5, "inv").expmap(x, u), x) > 1e-6


# --------------------------------------------------------------------------- the integrator
@settings(max_examples=6)
@given(case=gl_cases(dtype=torch.float64, max_h=3, max_extra=3, batches=((), (2,))))
def test_span_reduced_rk4_equals_full_space_rk4(case):
    """Same step count: the reduced iterates are ``B C`` of the full-space ones (to rounding)."""
    m, x = case.manifold, case.x
    u = scaled(m, x, case.u, 0.7)
    reduced = integrated(m, x, u, steps=6)
    full = m.generic(metric_inv=True).geodesic(x, u, steps=6)
    assert displacement_err(reduced[0], full[0], x) <= 1e-11
    assert rel_err(reduced[1], full[1]) <= 1e-11


@settings(max_examples=5)
@given(
    case=gl_cases(dtype=torch.float64, max_h=3, max_extra=3),
    metric=st.sampled_from(["mix", 0.3, 0.8]),
    size=st.floats(0.05, 1.5),
    horizontal=st.booleans(),
)
def test_default_integration_meets_its_stated_accuracy(case, metric, size, horizontal):
    """The automatic count meets ``rtol`` in the metric at ``x`` (``||y − y*||_x ≤ rtol ||y* −
    x||_x``), or says that it cannot: at ``MAX_STEPS`` it warns with its estimate of the error,
    which must not understate the error by more than 3 times, or raises ``LeftManifold`` where a
    run of at least half the cap steps out of GL (near-singular paths, e.g. GL(1) with a factor
    through 0).
    The reference takes 4 times the steps the count took (RK4: 256 times more accurate)."""
    m = case.manifold.with_metric(metric)
    x = case.x
    u = scaled(m, x, m.proju(x, case.u) if horizontal else case.u, size)
    with warnings.catch_warnings(record=True) as caught, step_counts() as counts:
        warnings.simplefilter("always")
        try:
            y = m.expmap(x, u)
        except LeftManifold:
            assert 2 * counts[-1] >= MAX_STEPS  # only a run whose count cannot double
            return
    try:
        reference = integrated(m, x, u, steps=4 * counts[-1])
    except ValueError:  # the geodesic leaves GL before t = 1 (e.g. GL(1), both factors → 0)
        reject()
    err = metric_displacement_err(m, y, reference[0], x)
    stated = [float(w.message.args[0].split("error is ")[1].split(" at")[0]) for w in caught
              if "estimated relative error" in str(w.message)]  # fmt: skip
    if stated:
        assert counts[-1] == MAX_STEPS
        assert err <= 3 * stated[0]
    else:
        assert err <= rtol_for(torch.float64)


@contextlib.contextmanager
def step_counts():
    """The step counts of the GL integrator's RK4 runs inside the block, in order."""
    counts = []

    def counting(acceleration, y, v, t, steps):
        counts.append(steps)
        return rk4(acceleration, y, v, t, steps)

    with mock.patch.object(total_module, "rk4", counting):
        yield counts


def _steps_taken(m, x, u):
    """``m.expmap(x, u)`` and the step counts of its RK4 runs (the reference's first)."""
    with step_counts() as counts:
        return m.expmap(x, u), counts


def _moved_copy_agrees(m, x, u, A):
    """The step counts at ``x`` and at ``A · x`` are equal, and the end points equivariant to
    the rounding bound of the GL maps (``50 ε K³``, ``K`` the acted factors' condition; see
    ``tests/manifolds/test_gl.py``), measured in the acted metric on the displacements."""
    xa = m.act(x, A)
    y, counts = _steps_taken(m, x, u)
    ya, counts_a = _steps_taken(m, xa, m.push(x, u, A))
    assert counts_a == counts
    expected, acted = m.act(y, A) - xa, ya - xa
    K = max(torch.linalg.cond(F.double()).max().item() for F in m.split(xa))
    gap = (m.norm(xa, acted - expected) / m.norm(xa, expected)).max().item()
    assert gap <= tol(x.dtype, 50) * K**3


def test_moved_copy_takes_the_same_steps_where_the_check_grows_the_count():
    """The reported miss (mix, n = 3, m = 4, h = 2, seed 1, factor conditions 1 and 9, a group
    element of condition 10): the rule gives 23 steps at both points, and the check grew the
    moved copy's count to 28 but not the point's, since it measured the error in Euclidean
    norms; the end points then differed by 5.6e-10 of the displacement. In the metric at the
    start point both keep 23 steps."""
    g = gen(1)
    m = GLQuotient(3, "mix")
    x = m.join(conditioned((), 3, 2, 1.0, g), conditioned((), 4, 2, 9.0, g))
    u = torch.randn(x.shape, generator=g, dtype=torch.float64)
    torch.randn(x.shape, generator=g, dtype=torch.float64)  # the case's second vector
    A = conditioned((), 2, 2, 10.0, gen(1 + 7919))
    _moved_copy_agrees(m, x, scaled(m, x, u, 0.3), A)


@settings(max_examples=8)
@given(
    case=gl_cases(dtype=torch.float64, max_h=3, max_extra=3, factor_cond=10.0),
    metric=st.sampled_from(["mix", 0.5]),
    size=st.floats(0.05, 1.5),
    log_kappa=st.floats(0.0, 2.0),
)
def test_moved_copy_takes_the_same_steps(case, metric, size, log_kappa):
    """The rule's rate and the check's error estimate are metric norms at the start point, so a
    point and its copy moved by ``A ∈ GL(h)`` (condition up to 100) take the same steps."""
    m = case.manifold.with_metric(metric)
    x = case.x
    try:
        _moved_copy_agrees(m, x, scaled(m, x, case.u, size), case.group(10.0**log_kappa))
    except ValueError:  # the geodesic leaves GL before t = 1
        reject()


@pytest.mark.parametrize("n", [1, 2, 5, 400])
def test_error_control_reaches_the_tolerance_from_any_count(n):
    """RK4 on ``ÿ = -y`` (``y(t) = cos t``, 2 × 2 matrices as points, a batch of end times): the
    control grows a count that is too small until the end point is within ``rtol`` of the
    displacement, and a count that suffices costs one run more, of half its steps."""
    x = torch.ones(3, 2, 2, dtype=torch.float64)
    t = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64).reshape(3, 1, 1)
    counts = []

    def run(steps):
        counts.append(steps)
        y, v = rk4(lambda y, v: (-y,), (x,), (torch.zeros_like(x),), t, steps)
        return y, v

    y, _ = controlled(run, n, x, ndim=2)
    exact = torch.cos(t) * x
    assert displacement_err(y, exact, x) <= rtol_for(torch.float64)
    assert counts[0] == max(n, 2) // 2 and counts[1] == max(n, 2)
    if n == 400:  # 400 steps suffice: the reference and the run
        assert len(counts) == 2
    else:
        assert len(counts) > 2 and counts == sorted(counts)


@pytest.mark.parametrize("offset", [1.0, 1e2, 1e4, 1e6])
def test_error_control_stops_at_the_rounding_of_the_end_point(offset):
    """``ÿ = -(y - c)`` in float32, ``y(t) = c + cos t``: the displacement (about 0.46) is small
    against the point (``c``), so float32 resolves it only to ``ε c / 0.46``, above ``rtol``.
    The control accepts the first count whose two runs agree to their rounding (before, it
    grew the count to ``MAX_STEPS``, each run adding rounding, and warned), and the end point
    is within that rounding of the exact one."""
    c = torch.full((3, 2, 2), offset, dtype=torch.float32)
    x = c + 1
    t = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float32).reshape(3, 1, 1)
    counts = []

    def run(steps):
        counts.append(steps)
        y, v = rk4(lambda y, v: (-(y - c),), (x,), (torch.zeros_like(x),), t, steps)
        return y, v

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        y, _ = controlled(run, 36, x, ndim=2)  # 36: the rule's count for a rate of 1 (float32)
    exact = c.double() + torch.cos(t.double())
    eps = torch.finfo(torch.float32).eps
    resolution = 4 * math.sqrt(36) * eps * torch.linalg.vector_norm(exact, dim=(-2, -1))
    assert (torch.linalg.vector_norm(y.double() - exact, dim=(-2, -1)) <= resolution).all()
    assert counts == [18, 36]  # the reference and the run: no growth
    if offset == 1.0:  # where float32 resolves the displacement, to rtol as well
        assert displacement_err(y.double(), exact, x.double()) <= rtol_for(torch.float32)


def test_step_count_rule():
    assert steps_for(0.0, torch.float64) == 1
    assert steps_for(1.0, torch.float64) == 200  # N = ⌈κ (16 / 1e-8)^{1/4}⌉
    assert steps_for(1.0, torch.float32) == 36  # N = ⌈κ (16 / 1e-5)^{1/4}⌉
    with pytest.raises(ValueError, match="not finite"):
        steps_for(float("nan"), torch.float64)
    with pytest.warns(RuntimeWarning, match="RK4 steps"):
        assert steps_for(1e6, torch.float64) == 1024
    m = GLQuotient(4, "mix", exp_steps=7)
    x = m.random(7, 2, dtype=torch.float64)
    assert m.rk4_steps(m.at(x), torch.randn_like(x), torch.tensor(1.0)) == 7
    with pytest.raises(ValueError, match="steps"):
        m.expmap(x, torch.randn_like(x), steps=0)


# --------------------------------------------------------------------------- default move
@pytest.mark.parametrize(("metric", "same_as"), [("inv", "exact"), ("mix", "second_order")])
def test_default_perturbation_is_exact_where_the_geodesic_is_closed_form(
    tiny_bert, metric, same_as
):
    from quotientgeo import geodesic_sharpness

    model = tiny_bert(initializer_range=0.3)
    ids = torch.randint(0, 40, (4, 6), generator=gen(0))
    target = torch.randn(4, 16, generator=gen(1), dtype=torch.float64)

    def loss_fn(m, batch):
        return (m(input_ids=batch).last_hidden_state.mean(1) - target).square().mean()

    def measure(**kw):
        return geodesic_sharpness(
            model, loss_fn, [ids], rho=0.3, metric=metric, n_iter=3, progress=False, **kw
        )

    default = measure()
    assert default.settings["perturbation"] == "default"
    assert default.worst_losses == measure(perturbation=same_as).worst_losses
    other = "second_order" if same_as == "exact" else "exact"
    assert default.worst_losses != measure(perturbation=other).worst_losses
