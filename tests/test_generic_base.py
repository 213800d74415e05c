"""Symmetries defined through the generic base: ScaleQuotient, InterpolatedGLQuotient, user classes.

Properties over random inputs (float64, small sizes): metric invariance under the action,
horizontality and idempotence of ``proju``, equivariance of ``expmap2``; the interpolated
metric reproduces ``GLQuotient`` at ``s = 0`` (inv) and ``s = 1`` (mix); a subclass missing a
primitive fails at construction; the example script runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quotientgeo.manifolds import (
    GLQuotient,
    InterpolatedGLQuotient,
    QuotientManifold,
    ScaleQuotient,
)

DT = torch.float64
RTOL = 1e-10
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)
pytestmark = pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "define_a_symmetry.py"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def well_conditioned(gen, batch, rows, cols) -> torch.Tensor:
    """``U diag(σ) Vᵀ`` with orthonormal ``U`` (rows×cols), ``σ ∈ [0.5, 2]``: condition ≤ 4."""
    U = torch.linalg.qr(torch.randn(*batch, rows, cols, generator=gen, dtype=DT))[0]
    V = torch.linalg.qr(torch.randn(*batch, cols, cols, generator=gen, dtype=DT))[0]
    sigma = 0.5 + 1.5 * torch.rand(*batch, 1, cols, generator=gen, dtype=DT)
    return (U * sigma) @ V.transpose(-1, -2)


@st.composite
def scale_cases(draw):
    ndim = draw(st.integers(1, 2))
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    # a block of one entry has a single point as quotient; start at two entries
    block = (
        draw(st.integers(2, 4)),
        *draw(st.lists(st.integers(1, 3), min_size=ndim - 1, max_size=ndim - 1)),
    )
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    m = ScaleQuotient(ndim)
    x = torch.randn(*batch, *block, generator=gen, dtype=DT) + 0.1
    u, v = (torch.randn(x.shape, generator=gen, dtype=DT) for _ in range(2))
    g = torch.exp(torch.randn(batch, generator=gen, dtype=DT))
    omega = torch.randn(batch, generator=gen, dtype=DT)
    return m, x, u, v, g, omega


@st.composite
def gl_cases(draw, s=None):
    s = draw(st.floats(0, 1)) if s is None else s
    batch = tuple(draw(st.lists(st.integers(1, 2), max_size=2)))
    h = draw(st.integers(1, 3))
    n, m_rows = h + draw(st.integers(0, 3)), h + draw(st.integers(0, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.cat(
        [well_conditioned(gen, batch, n, h), well_conditioned(gen, batch, m_rows, h)], dim=-2
    )
    u, v = (torch.randn(x.shape, generator=gen, dtype=DT) for _ in range(2))
    A = well_conditioned(gen, batch, h, h)
    omega = torch.randn(*batch, h, h, generator=gen, dtype=DT)
    return InterpolatedGLQuotient(n, s), x, u, v, A, omega


def check_properties(m, x, u, v, g, omega) -> None:
    """Invariance, horizontality, idempotence, equivariance on ``m`` and on ``m.generic()``."""
    for path in (m, m.generic()):
        gx, gu, gv = m.act(x, g), m.push(x, u, g), m.push(x, v, g)
        # metric invariance: <g·u, g·v>_{g·x} = <u, v>_x
        assert rel(path.inner(gx, gu, gv), path.inner(x, u, v)) < 1e-9
        # horizontality: <proj u, V ω>_x = 0, and idempotence
        pu = path.proju(x, u)
        vert = m.vertical(m.at(x), omega)
        scale = path.norm(x, u) * path.norm(x, vert) + 1e-300
        assert (path.inner(x, pu, vert).abs() / scale).max() < 1e-9
        assert (path.norm(x, path.proju(x, pu) - pu) / path.norm(x, u)).max() < 1e-9
        assert (path.norm(x, path.proju(x, vert)) / path.norm(x, vert)).max() < 1e-9
        # expmap2 equivariance: Exp2_{g·x}(g·u) = g·Exp2_x(u)
        assert rel(path.expmap2(gx, gu), m.act(path.expmap2(x, u), g)) < 1e-9


# ---------------------------------------------------------------- ScaleQuotient
@SETTINGS
@given(scale_cases())
def test_scale_properties(case):
    check_properties(*case)


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


@SETTINGS
@given(scale_cases())
def test_scale_horizontal_geodesic_keeps_norm(case):
    m, x, u, *_ = case
    xi = m.proju(x, u)
    y = m.expmap(x, xi)
    assert rel(y.flatten(-m.ndim).norm(dim=-1), x.flatten(-m.ndim).norm(dim=-1)) < 1e-12


def test_scale_rejects_bad_arguments():
    with pytest.raises(ValueError, match="ndim"):
        ScaleQuotient(0)
    with pytest.raises(ValueError, match="at least ndim=2"):
        ScaleQuotient(2).proju(torch.ones(3), torch.ones(3))
    assert not ScaleQuotient(1)._check_point_on_manifold(torch.zeros(2, 3))[0]
    assert ScaleQuotient(1).check_point_on_manifold(torch.ones(0, 3))
    x = torch.randn(2, 3, dtype=DT)
    x[1] = 0.0
    for method in ("proju", "egrad2rgrad", "inner", "christoffel", "expmap"):
        with pytest.raises(ValueError, match="zero block"):
            getattr(ScaleQuotient(1), method)(x, torch.randn_like(x))


@pytest.mark.parametrize("ndim", [1, 2])
def test_scale_expmap_differentiable_at_zero(ndim):
    """d/du Exp_w(u) at u = 0 is the identity (regression: 0/0 in the gradient of ν = |u_⊥|/r)."""
    m = ScaleQuotient(ndim)
    x = torch.randn(3, 4, 2, dtype=DT)
    u = torch.zeros_like(x, requires_grad=True)
    v = torch.randn_like(x)
    (m.expmap(x, u) * v).sum().backward()
    assert torch.allclose(u.grad, v, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- InterpolatedGLQuotient
@SETTINGS
@given(gl_cases())
def test_interpolated_properties(case):
    check_properties(*case)


@pytest.mark.parametrize(("s", "metric"), [(0.0, "inv"), (1.0, "mix")])
@SETTINGS
@given(data=st.data())
def test_interpolated_endpoints_reproduce_gl(s, metric, data):
    ip, x, u, v, _, _ = data.draw(gl_cases(s=s))
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


def test_interpolated_rejects_bad_arguments():
    with pytest.raises(ValueError, match="s must lie"):
        InterpolatedGLQuotient(3, 1.5)
    with pytest.raises(ValueError, match="n must be"):
        InterpolatedGLQuotient(0, 0.5)
    with pytest.raises(ValueError, match="h <= n"):
        InterpolatedGLQuotient(2, 0.5).proju(torch.ones(5, 3), torch.ones(5, 3))


# ---------------------------------------------------------------- user subclasses
PRIMITIVES = {
    "lie_shape": lambda self, p: (),
    "vertical": lambda self, p, omega: omega[..., None] * p.x,
    "metric": lambda self, p, u: u,
}


@pytest.mark.parametrize("missing", sorted(PRIMITIVES))
def test_subclass_missing_a_primitive_fails_at_construction(missing):
    methods = {k: f for k, f in PRIMITIVES.items() if k != missing}
    cls = type("Incomplete", (QuotientManifold,), {"ndim": 1, **methods})
    with pytest.raises(TypeError, match=missing):
        cls()


def test_complete_user_subclass_works():
    cls = type("Complete", (QuotientManifold,), {"ndim": 1, **PRIMITIVES})
    m = cls()
    x = torch.tensor([[1.0, 2.0, 2.0]], dtype=DT)
    u = torch.tensor([[1.0, 0.0, 0.0]], dtype=DT)
    assert torch.allclose(m.proju(x, u), u - x / 9)
    assert torch.allclose(m.christoffel(x, u), torch.zeros_like(u))  # flat metric


# ---------------------------------------------------------------- example
def test_example_script_runs():
    out = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, check=True
    )
    lines = out.stdout.splitlines()
    assert lines[0].startswith("step   0") and "rescaled" in lines[-1]
    riemann = [float(line.rsplit(" ", 1)[-1]) for line in lines[-2:]]
    assert riemann[0] == pytest.approx(riemann[1], rel=1e-6)
    sharp = [float(line.rsplit(" ", 1)[-1]) for line in lines if "geodesic sharpness" in line]
    assert len(sharp) == 2 and sharp[0] > 0
    assert sharp[0] == pytest.approx(sharp[1], rel=1e-4)  # measured on the model, orbit-invariant


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
