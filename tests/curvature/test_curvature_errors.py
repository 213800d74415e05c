"""The model is restored bit-exactly, also on errors; wrong arguments give clear errors."""

from __future__ import annotations

import pytest
import torch
from curvature_models import TwoFactor, WithNorm, cubic_loss, data, snapshot

import quotientgeo as qg
from quotientgeo.curvature import RiemannianHessian


def assert_restored(model, before):
    state, grads, modes = before
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(p.grad is g for p, g in grads)
    assert [m.training for m in model.modules()] == modes


def geometry_of(model):
    return qg.ParameterGeometry(model).add_gl_pair(
        qg.Source("pair.G", axis=1), qg.Source("pair.H", axis=1)
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda m, b: qg.hessian_trace(m, cubic_loss, b, n_probes=3, symmetries=geometry_of(m)),
        lambda m, b: qg.hessian_eigenvalues(m, cubic_loss, b, symmetries=geometry_of(m)),
        lambda m, b: qg.hessian_density(m, cubic_loss, b, n_steps=4, symmetries=geometry_of(m)),
    ],
)
def test_model_is_restored_bit_exactly(call):
    model = WithNorm().train()
    batches = data()
    model(batches[0][0]).sum().backward()  # .grad set, running statistics moved
    before = snapshot(model)
    call(model, batches)
    assert_restored(model, before)


def test_model_is_restored_when_the_loss_fails_in_a_product():
    model = WithNorm().train()
    batches = data()
    before = snapshot(model)
    calls = []

    def failing(m, batch):
        calls.append(1)
        if len(calls) > 3:  # after the gradient pass, inside the first product
            raise RuntimeError("boom")
        return cubic_loss(m, batch)

    with pytest.raises(RuntimeError, match="boom") as info:
        qg.hessian_trace(model, failing, batches, symmetries=geometry_of(model), progress=False)
    assert any("restored" in note for note in getattr(info.value, "__notes__", []))
    assert_restored(model, before)


def test_clear_errors():
    model, batches = TwoFactor(), data()
    geometry = model.geometry()
    kw = dict(symmetries=geometry, progress=False)
    with pytest.raises(ValueError, match="method must be one of"):
        qg.hessian_trace(model, cubic_loss, batches, method="pyhessian", **kw)
    with pytest.raises(ValueError, match="per_block=True needs"):
        qg.hessian_trace(model, cubic_loss, batches, method="xtrace", per_block=True, **kw)
    with pytest.raises(ValueError, match="needs k < D"):
        qg.hessian_eigenvalues(model, cubic_loss, batches, k=18, **kw)
    with pytest.raises(ValueError, match="which must be"):
        qg.hessian_eigenvalues(model, cubic_loss, batches, which="top", **kw)
    with pytest.raises(ValueError, match="geometry must be"):
        RiemannianHessian(model, cubic_loss, batches, geometry="adaptive")
    with pytest.raises(ValueError, match="batches is empty"):
        RiemannianHessian(model, cubic_loss, [], symmetries=geometry)
    with pytest.raises(TypeError, match="batches is a tensor"):
        RiemannianHessian(model, cubic_loss, torch.ones(3), symmetries=geometry)
    with pytest.raises(ValueError, match="scalar tensor"):
        RiemannianHessian(model, lambda m, b: m(b[0]), batches, symmetries=geometry)
    damped = qg.ParameterGeometry(model).add(
        qg.GLQuotient(5, "mix", eps=qg.BallDamping()),
        qg.Source("G", axis=1),
        qg.Source("H", axis=1),
    )
    with pytest.raises(ValueError, match=r"pass eps=BallDamping\(radius\)"):
        RiemannianHessian(model, cubic_loss, batches, symmetries=damped)
    # with the radius given, it measures
    RiemannianHessian(model, cubic_loss, batches, symmetries=damped, eps=qg.BallDamping(0.1))
