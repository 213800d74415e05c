"""The finite-difference product: central differences of gradients, error of order 2 in the
step, the same operator as double backward in the limit."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from curvature_models import TwoFactor, cubic_loss, data

import quotientgeo as qg
from quotientgeo.curvature import RiemannianHessian


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
