"""The operator: it is the Riemannian Hessian of the Levi-Civita connection, symmetric in
whitened coordinates, zero on the vertical directions, and the coordinates convert."""

from __future__ import annotations

import pytest
import torch
from curvature_models import TwoFactor, cubic_loss, data, tiny_transformer
from hypothesis import assume, given
from hypothesis import strategies as st

from quotientgeo.curvature import RiemannianHessian
from quotientgeo.testing import cross_entropy

METRICS = ["inv", "mix", 0.3]


def levi_civita_hessian(model, geometry, batches, xi):
    """``P^h (D(grad f)[ξ] + Γ(ξ, grad f))`` with ``grad f = G⁻¹ ∇f`` of the total space,
    differentiated by forward-mode AD over the point (independent of the operator)."""
    manifold = geometry.manifolds()[0]
    (x0,), _ = geometry.gather()
    empty = torch.zeros(0, dtype=x0.dtype)

    def f(x):
        params = geometry.scatter([x], empty)
        call = lambda inp: torch.func.functional_call(model, params, (inp,))  # noqa: E731
        return sum(cubic_loss(call, b) for b in batches) / len(batches)

    def rgrad(x):
        return manifold.metric_inv(manifold.at(x), torch.func.grad(f)(x))

    grad = rgrad(x0)
    _, dgrad = torch.func.jvp(rgrad, (x0,), (xi,))
    return manifold.proju(x0, dgrad + manifold.christoffel(x0, xi, grad)), grad


@given(
    metric=st.sampled_from(METRICS),
    shape=st.sampled_from([(5, 4, 2), (3, 6, 3), (4, 4, 1)]),
    seed=st.integers(0, 2**16),
)
def test_the_operator_is_the_hessian_of_the_levi_civita_connection(metric, shape, seed):
    n, m, h = shape
    model = TwoFactor(n, m, h, seed=seed)
    # both sides solve with the Gram matrices GᵀG and HᵀH (and the projection's normal
    # equations): at an ill-conditioned point each loses digits to rounding (of order ε·κ and
    # more), differently. The identity is checked where the factors are well conditioned.
    with torch.no_grad():
        kappa = float(torch.linalg.cond(model.G) ** 2 + torch.linalg.cond(model.H) ** 2)
    assume(kappa < 1e3)
    geometry = model.geometry(metric)
    batches = data(d_in=n, d_out=m, seed=seed + 1)
    hessian = RiemannianHessian(model, cubic_loss, batches, symmetries=geometry)
    manifold = geometry.manifolds()[0]
    (x0,), _ = geometry.gather()
    gen = torch.Generator().manual_seed(seed)
    xi = manifold.proju(x0, torch.randn(x0.shape, generator=gen, dtype=x0.dtype))
    expected, _ = levi_civita_hessian(model, geometry, batches, xi)
    got = hessian.apply(xi.reshape(-1)).reshape(x0.shape)
    assert (got - expected).norm() <= 1e-10 * expected.norm()


@pytest.mark.parametrize("metric", METRICS)
def test_the_connection_term_matters_away_from_critical_points(metric):
    model = TwoFactor(5, 4, 2, seed=0)
    geometry = model.geometry(metric)
    batches = data(seed=1)
    manifold = geometry.manifolds()[0]
    (x0,), _ = geometry.gather()
    gen = torch.Generator().manual_seed(0)
    xi = manifold.proju(x0, torch.randn(x0.shape, generator=gen, dtype=x0.dtype))
    expected, grad = levi_civita_hessian(model, geometry, batches, xi)
    # on this model the term with the gradient is a tenth of the whole or more
    assert manifold.christoffel(x0, xi, grad).norm() > 0.1 * expected.norm()


@pytest.mark.parametrize("geometry", ["riemannian", "euclidean"])
def test_whitened_operator_is_symmetric_and_tangent_maps_it_to_the_hessian(geometry):
    model = TwoFactor(5, 4, 2, bias=True)
    hessian = RiemannianHessian(
        model, cubic_loss, data(), symmetries=model.geometry("inv"), geometry=geometry
    )
    A = hessian.to_dense()
    assert A.shape == (hessian.dim, hessian.dim) == (5 * 2 + 4 * 2 + 4,) * 2
    assert (A - A.T).abs().max() <= 1e-12 * A.abs().max()
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(hessian.dim, generator=gen, dtype=torch.float64)
    # tangent(A z) = Hess(tangent(z)); whiten inverts tangent on horizontal vectors
    xi = hessian.tangent(z)
    assert torch.allclose(hessian.tangent(hessian @ z), hessian.apply(xi), rtol=1e-10, atol=1e-12)
    assert torch.allclose(hessian.tangent(hessian.whiten(xi)), xi, rtol=1e-12, atol=1e-13)
    # self-adjoint in the metric: <η, Hess ξ> = <Hess η, ξ>
    eta = hessian.tangent(torch.randn(hessian.dim, generator=gen, dtype=torch.float64))
    left, right = hessian.inner(eta, hessian.apply(xi)), hessian.inner(hessian.apply(eta), xi)
    assert abs(left - right) <= 1e-10 * abs(left)


def test_vertical_directions_are_zero_eigenvalues():
    model, batches = tiny_transformer()
    hessian = RiemannianHessian(model, cross_entropy, batches)
    manifolds, (points, _) = hessian.geometry.manifolds(), hessian.geometry.gather()
    gen = torch.Generator().manual_seed(0)
    vertical = []
    for m, x in zip(manifolds, points, strict=True):
        p = m.at(x)
        omega = torch.randn(x.shape[0], *m.lie_shape(p), generator=gen, dtype=x.dtype)
        vertical.append(m.vertical(p, omega))
    v = torch.cat([t.reshape(-1) for t in vertical] + [torch.zeros(hessian.geometry.n_adaptive)])
    z = hessian.whiten(v)
    assert z.norm() > 0
    assert (hessian @ z).norm() <= 1e-12 * (hessian @ torch.randn_like(z)).norm()
    # at least as many zero eigenvalues as vertical dimensions (h² per head: 2 kinds × 2 heads
    # × 4² = 64; the loss may have null directions of its own, e.g. a shift of all logits)
    eigenvalues = torch.linalg.eigvalsh(hessian.to_dense())
    scale = eigenvalues.abs().max()
    assert int((eigenvalues.abs() <= 1e-12 * scale).sum()) >= 64


def test_operator_follows_the_model_dtype_and_counts_its_products():
    model = TwoFactor().float()
    batches = [(x.float(), y.float()) for x, y in data()]
    hessian = RiemannianHessian(model, cubic_loss, batches, symmetries=model.geometry())
    assert hessian.dtype == torch.float32 and hessian.device == torch.device("cpu")
    out = hessian @ torch.ones(hessian.dim, 3)
    assert out.shape == (hessian.dim, 3) and out.dtype == torch.float32
    assert hessian.products == 3 and hessian.passes == 2 + 2  # the gradient, one product
    single = hessian @ torch.ones(hessian.dim)
    assert torch.allclose(single, out[:, 0])
    with pytest.raises(ValueError, match="multiply a vector"):
        hessian @ torch.ones(hessian.dim + 1)


def test_to_scipy_is_the_same_operator():
    model = TwoFactor(bias=True)
    hessian = RiemannianHessian(model, cubic_loss, data(), symmetries=model.geometry())
    A = hessian.to_scipy()
    z = torch.randn(hessian.dim, dtype=torch.float64)
    assert A.shape == (hessian.dim, hessian.dim)
    assert torch.allclose(torch.as_tensor(A @ z.numpy()), hessian @ z, rtol=1e-12, atol=1e-14)
