"""The finite-difference product: central differences of gradients, error of order 2 in the
step, the same operator as double backward in the limit."""

from __future__ import annotations

import gc
import itertools
import math

import pytest
import torch
from curvature_models import TwoFactor, cubic_loss, data, tiny_transformer

import quotientgeo as qg
from quotientgeo.curvature import RiemannianHessian
from quotientgeo.testing import cross_entropy


@pytest.mark.parametrize("geometry", ["riemannian", "euclidean"])
def test_finite_difference_product_converges_at_order_two(geometry):
    model, batches = TwoFactor(bias=True), data()
    kw = dict(symmetries=model.geometry("inv"), geometry=geometry)
    exact = RiemannianHessian(model, cubic_loss, batches, **kw)
    z = torch.randn(exact.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    reference = exact @ z
    errors = []
    for step in (1e-2, 5e-3, 2.5e-3):
        fd = RiemannianHessian(
            model, cubic_loss, batches, product="finite_difference", step=step, **kw
        )
        errors.append(float((fd @ z - reference).norm() / reference.norm()))
    orders = [math.log2(a / b) for a, b in itertools.pairwise(errors)]
    assert all(1.8 < p < 2.2 for p in orders), (errors, orders)
    # the default step balances truncation and rounding
    fd = RiemannianHessian(model, cubic_loss, batches, product="finite_difference", **kw)
    assert float((fd @ z - reference).norm() / reference.norm()) < 1e-8
    assert fd.passes == 2 + 2 * 2  # the gradient, then two gradients per batch


def test_unknown_product_is_refused():
    model = TwoFactor()
    with pytest.raises(ValueError, match="product must be"):
        RiemannianHessian(model, cubic_loss, data(), symmetries=model.geometry(), product="forward")


def test_functions_take_the_finite_difference_product():
    model, batches = TwoFactor(bias=True), data()
    kw = dict(symmetries=model.geometry(), method="exact", progress=False)
    exact = qg.hessian_trace(model, cubic_loss, batches, **kw)
    fd = qg.hessian_trace(model, cubic_loss, batches, product="finite_difference", **kw)
    assert fd.settings["product"] == "finite_difference"
    assert fd.value == pytest.approx(exact.value, rel=1e-8)


def test_the_operator_keeps_its_base_point_and_no_gradient():
    """Of the tensors a finite-difference operator makes, those as large as a kind of symmetry
    blocks are its base point's: each product takes the connection term's gradient from its own
    two gradients (the order-two test above checks that it is ``∇f + O(t²)``)."""
    model, batches = tiny_transformer()

    def storages() -> dict[int, int]:
        return {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in gc.get_objects()
            if type(t) is torch.Tensor
        }

    gc.collect()
    before = storages()
    H = RiemannianHessian(model, cross_entropy, batches, product="finite_difference")
    gc.collect()
    base = [*H._points, H._w]
    smallest = min(t.untyped_storage().nbytes() for t in base)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}  # views of them kept
    made = {p for p, n in storages().items() if p not in before and n >= smallest} - params
    assert made == {t.untyped_storage().data_ptr() for t in base}


@pytest.mark.parametrize("plus_there", [True, False])
@pytest.mark.parametrize("minus_there", [True, False])
def test_the_gradients_difference_and_mean(plus_there, minus_there):
    """``.grad ← ∇₊ − ∇₋`` and, for the chosen parameters, ``(∇₊ + ∇₋) / 2``, a missing
    gradient counting as zero."""
    from quotientgeo.curvature.inplace import _subtract_grads

    gen = torch.Generator().manual_seed(0)
    params = [torch.zeros(3, 2, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    plus = [torch.randn(3, 2, generator=gen, dtype=torch.float64) for _ in params]
    minus = [torch.randn(3, 2, generator=gen, dtype=torch.float64) for _ in params]
    plus[1] = plus[1] if plus_there else None
    minus[1] = minus[1] if minus_there else None
    for p, g in zip(params, minus, strict=True):
        p.grad = None if g is None else g.clone()
    zero = torch.zeros(3, 2, dtype=torch.float64)
    given = [zero if t is None else t.clone() for t in plus]
    taken = [zero if t is None else t for t in minus]
    means = _subtract_grads(params, [None if t is None else t.clone() for t in plus], [1, 2])
    for p, a, b in zip(params, given, taken, strict=True):
        if p.grad is None:
            assert not (plus_there or minus_there)
        else:
            torch.testing.assert_close(p.grad, a - b, rtol=0, atol=1e-15)
    for m, i in zip(means, [1, 2], strict=True):
        if m is None:
            assert i == 1 and not (plus_there or minus_there)
        else:
            torch.testing.assert_close(m, (given[i] + taken[i]) / 2, rtol=0, atol=1e-15)
