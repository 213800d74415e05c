"""The finite-difference product moves the model's own parameters in place: the model comes
back bit-exactly (weights, buffers, modes, ``.grad``), also when the loss fails inside a
product, and the product equals the one on the model's copy."""

from __future__ import annotations

import copy

import pytest
import torch
from curvature_models import WithNorm, cubic_loss, data, snapshot

import quotientgeo as qg
from quotientgeo.curvature import RiemannianHessian


def geometry_of(model):
    return qg.ParameterGeometry(model).add_gl_pair(
        qg.Source("pair.G", axis=1), qg.Source("pair.H", axis=1)
    )


def assert_restored(model, before):
    state, grads, modes = before
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(p.grad is g for p, g in grads)
    assert [m.training for m in model.modules()] == modes


@pytest.mark.parametrize("geometry", ["riemannian", "euclidean"])
@pytest.mark.parametrize("seed", [0, 1])
def test_finite_difference_restores_the_model_bit_exactly(geometry, seed):
    model = WithNorm().train()
    batches = data(seed=seed + 1)
    model(batches[0][0]).sum().backward()  # .grad set, running statistics moved
    twin = copy.deepcopy(model)
    before = snapshot(model)
    H = RiemannianHessian(
        model,
        cubic_loss,
        batches,
        product="finite_difference",
        geometry=geometry,
        symmetries=geometry_of(model),
    )
    z = torch.randn(H.dim, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    first = H @ z
    assert_restored(model, before)
    again = H @ z  # the second product starts from the very same weights
    assert torch.equal(first, again)
    # the same operator on an untouched copy gives the same numbers
    other = RiemannianHessian(
        twin,
        cubic_loss,
        batches,
        product="finite_difference",
        geometry=geometry,
        symmetries=geometry_of(twin),
    )
    assert torch.equal(other @ z, first)


def test_finite_difference_restores_the_model_when_the_loss_fails():
    model = WithNorm().train()
    batches = data()
    before = snapshot(model)
    calls = []

    def failing(m, batch):
        calls.append(1)
        if len(calls) == 4:  # after the gradient (2 batches), at x + tξ on the second batch
            raise RuntimeError("boom")
        return cubic_loss(m, batch)

    H = RiemannianHessian(
        model, failing, batches, product="finite_difference", symmetries=geometry_of(model)
    )
    with pytest.raises(RuntimeError, match="boom") as info:
        H @ torch.ones(H.dim, dtype=torch.float64)
    assert any("restored" in note for note in getattr(info.value, "__notes__", []))
    assert_restored(model, before)


@pytest.mark.parametrize("seed", [0, 1])
def test_blocks_written_whole_give_the_same_product(monkeypatch, seed):
    """Where a region is no view of its parameter (or the model is sharded) the blocks'
    parameters are written whole from a copy in their layout: the same product bit for bit,
    and the model restored bit-exactly."""
    from quotientgeo.curvature import inplace

    model = WithNorm().train()
    batches = data(seed=seed + 1)

    def product():
        H = RiemannianHessian(
            model, cubic_loss, batches, product="finite_difference", symmetries=geometry_of(model)
        )
        v = torch.randn(
            H.dim, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
        )
        return H, H @ v

    H, through_views = product()
    assert isinstance(H._loss, inplace.InPlaceLoss) and H._loss._views is not None
    before = snapshot(model)
    monkeypatch.setattr(inplace, "block_views", lambda *args: None)
    H, whole = product()
    assert H._loss._views is None
    assert torch.equal(whole, through_views)
    assert_restored(model, before)


@pytest.mark.parametrize("release", [True, False])
def test_finite_difference_holds_no_factors_through_its_passes(monkeypatch, release):
    """The symmetry blocks' ``h × h`` factors (their points' caches) are released before the
    passes and formed again after them: the passes' peak holds nothing of them, and the
    products are the same as with the factors held (``release`` patched out)."""
    from quotientgeo.curvature.parts import QuotientPart
    from quotientgeo.testing import TinyTransformerClassifier, cross_entropy

    if not release:
        monkeypatch.setattr(QuotientPart, "release", lambda self: None)
    torch.manual_seed(0)
    model = TinyTransformerClassifier(16, 2, 2, classes=3, dim_feedforward=32).double().eval()
    gen = torch.Generator().manual_seed(1)
    batch = (
        torch.randn(4, 5, 16, generator=gen, dtype=torch.float64),
        torch.randint(0, 3, (4,), generator=gen),
    )
    held: list[int] = []
    parts: list[QuotientPart] = []

    def loss_fn(model, batch):
        held.append(sum(len(p.point.cache) for p in parts))
        return cross_entropy(model, batch)

    H = RiemannianHessian(model, loss_fn, [batch], product="finite_difference")
    parts += [p for p in H.parts if isinstance(p, QuotientPart)]
    assert parts
    z = torch.randn(H.dim, 2, generator=gen, dtype=torch.float64)
    held.clear()
    out = H @ z
    assert len(held) == 4  # two passes per column
    assert (max(held) == 0) == release
    assert all(p.point.cache for p in parts)  # formed again
    monkeypatch.undo()
    H_held = RiemannianHessian(model, cross_entropy, [batch], product="finite_difference")
    monkeypatch.setattr(QuotientPart, "release", lambda self: None)
    assert torch.equal(out, H_held @ z)
