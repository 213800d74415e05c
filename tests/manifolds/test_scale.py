"""ScaleQuotient beyond the contract: horizontal geodesics keep the block norm, bad arguments and
zero blocks are refused, and the exact exponential map is differentiable at ``u = 0``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from quotientgeo.manifolds import ScaleQuotient
from quotientgeo.testing.numerics import rel
from quotientgeo.testing.strategies import scale_cases

DT = torch.float64
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)


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
