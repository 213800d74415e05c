"""RotaryGLQuotient: the GL pair quotient by the commutant of rotary rotations.

The closed-form projection is checked against the generic base (dense normal equations
built from ``vertical`` and ``metric``), for horizontality and idempotence, and for
equivariance under the subgroup, which fails for generic GL(h) elements.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from quotientgeo import GLQuotient, RotaryGLQuotient
from quotientgeo.testing.numerics import conditioned, gen

DT = torch.float64


@st.composite
def rotary_cases(draw):
    metric = draw(st.sampled_from(["inv", "mix", 0.3]))
    pairing = draw(st.sampled_from(["half", "interleaved"]))
    h = draw(st.integers(2, 7))
    dims = draw(st.sampled_from([None, *range(2, h + 1, 2)]))
    if dims is None and h % 2:
        dims = h - 1
    n, m = h + draw(st.integers(0, 3)), h + draw(st.integers(0, 3))
    batch = draw(st.sampled_from([(), (2,), (2, 3)]))
    g = gen(draw(st.integers(0, 2**31 - 1)))
    manifold = RotaryGLQuotient(n, metric, rotary_dims=dims, pairing=pairing)
    # factors with condition numbers <= 10, so that the tolerances below (in units of eps ·
    # cond²) mean the same for every drawn case
    x = torch.cat([conditioned(batch, n, h, 10.0, g), conditioned(batch, m, h, 10.0, g)], -2)
    u = torch.randn(*batch, n + m, h, generator=g, dtype=DT)
    return manifold, x, u, g


def rotation(manifold, h: int, angles: torch.Tensor) -> torch.Tensor:
    """``R``: rotation by ``angles[j]`` on each coordinate pair, identity elsewhere."""
    order, m, _ = manifold.coordinates(h)
    first, second = order[:m], order[m : 2 * m]
    R = torch.eye(h, dtype=DT)
    c, s = angles.cos(), angles.sin()
    R[first, first], R[second, second] = c, c
    R[first, second], R[second, first] = -s, s
    return R


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@given(rotary_cases())
def test_projection_matches_the_generic_base(case):
    manifold, x, u, _ = case
    generic = manifold.generic()
    generic.dense_max = 10**6
    assert relative(manifold.proju(x, u), generic.proju(x, u)) < 1e-10


@given(rotary_cases())
def test_projection_is_horizontal_and_idempotent(case):
    manifold, x, u, _ = case
    p = manifold.at(x)
    xi = manifold.proju(p, u)
    k = manifold.lie_shape(p)[0]
    basis = torch.eye(k, dtype=DT).reshape(k, *[1] * (x.dim() - 2), k).expand(k, *x.shape[:-2], k)
    vertical = torch.stack([manifold.vertical(p, w) for w in basis])
    pairing = manifold.inner(x, vertical, xi.expand_as(vertical))
    scale = manifold.norm(x, vertical) * manifold.norm(x, xi)
    assert float((pairing.abs() / scale).max()) < 1e-10
    assert relative(manifold.proju(p, xi), xi) < 1e-10
    # the full GL(h) horizontal space is smaller: its projection stays horizontal here
    gl = manifold.gl
    assert relative(manifold.proju(p, gl.proju(x, u)), gl.proju(x, u)) < 1e-10


@given(rotary_cases())
def test_projection_is_equivariant_under_the_subgroup_only(case):
    manifold, x, u, g = case
    # cond(A) <= 4 (moduli and singular values in [1/2, 2]): with factors of condition <= 10
    # the moved factors have condition <= 40, their Gram matrices <= 1600, so a fixed bound
    # holds for every drawn case. Measured worst over 600 examples: 1.8e-14 (81 eps).
    A = manifold.random_group(x, generator=g, condition=4.0)
    assert float(torch.linalg.cond(A).max()) <= 4.0 + 1e-9
    moved = manifold.act(x, A)
    lhs = manifold.proju(moved, manifold.push(x, u, A))
    assert relative(lhs, manifold.push(x, manifold.proju(x, u), A)) < 1e-12


def test_generic_gl_elements_are_not_equivariant():
    g = gen(0)
    manifold = RotaryGLQuotient(9, "mix", rotary_dims=4, pairing="half")
    x = torch.randn(15, 6, generator=g, dtype=DT)
    u = torch.randn(15, 6, generator=g, dtype=DT)
    A = torch.randn(6, 6, generator=g, dtype=DT)
    lhs = manifold.proju(manifold.act(x, A), manifold.push(x, u, A))
    assert relative(lhs, manifold.push(x, manifold.proju(x, u), A)) > 1e-2


@pytest.mark.parametrize(("dims", "pairing"), [(None, "half"), (4, "half"), (4, "interleaved")])
def test_group_elements_commute_with_every_rotation(dims, pairing):
    """``A`` commutes with ``R_Δ``: scores ``qᵀ R_Δ k`` are unchanged by ``(A⁻ᵀq, A k)``."""
    manifold = RotaryGLQuotient(8, rotary_dims=dims, pairing=pairing)
    h, g = 6, gen(1)
    x = torch.randn(14, h, generator=g, dtype=DT)
    A = manifold.random_group(x, generator=g)
    generic = torch.randn(h, h, generator=g, dtype=DT)
    m = (h if dims is None else dims) // 2
    for _ in range(3):
        R = rotation(manifold, h, torch.rand(m, generator=g, dtype=DT) * 2 * math.pi)
        assert relative(A @ R, R @ A) < 1e-13
        assert relative(generic @ R, R @ generic) > 1e-2


def test_names_metrics_and_keys():
    manifold = RotaryGLQuotient(5, "inv", rotary_dims=2, pairing="interleaved")
    assert manifold.group_name((9, 4)) == "(C*)^1 × GL(2)"
    assert RotaryGLQuotient(5).group_name((9, 4)) == "(C*)^2"
    mix = manifold.with_metric("mix")
    assert isinstance(mix, RotaryGLQuotient) and mix.gl.metric_name == "mix"
    assert (mix.rotary_dims, mix.pairing) == (2, "interleaved")
    keys = {
        RotaryGLQuotient(5, "mix").geometry_key(),
        RotaryGLQuotient(5, "mix", rotary_dims=2).geometry_key(),
        RotaryGLQuotient(5, "mix", pairing="interleaved").geometry_key(),
        RotaryGLQuotient(5, "inv").geometry_key(),
        GLQuotient(5, "mix").geometry_key(),
    }
    assert len(keys) == 5


@pytest.mark.parametrize(
    ("kwargs", "shape", "match"),
    [
        ({"rotary_dims": 3}, None, "even"),
        ({"pairing": "odd"}, None, "pairing"),
        ({}, (9, 3), "odd number"),
        ({"rotary_dims": 6}, (9, 4), "fewer than rotary_dims"),
    ],
)
def test_errors(kwargs, shape, match):
    with pytest.raises(ValueError, match=match):
        manifold = RotaryGLQuotient(5, **kwargs)
        manifold.proju(torch.randn(shape, dtype=DT), torch.randn(shape, dtype=DT))
