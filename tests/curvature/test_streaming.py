"""The finite-difference product in place: ``addmv_`` (``out ← β out + A z``) equals the product
added, whether the rest's part is streamed from the gradients or gathered; the lean Lanczos
recurrence holds two vectors of the operator's size through its products; a bfloat16 model's
rest is kept in bfloat16 and gives the product of a float32 copy of it."""

from __future__ import annotations

import gc

import pytest
import torch
from curvature_models import TwoFactor, cubic_loss, data, tiny_transformer
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import quotientgeo as qg
from quotientgeo.curvature.inplace import InPlaceLoss
from quotientgeo.curvature.lanczos import lanczos_extreme
from quotientgeo.testing import cross_entropy

DT = torch.float64


def masked_rest():
    """Hidden units 0..3 of a 4-6-3 network as GL(1) pairs: both weights partly in the rest."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    geometry = qg.ParameterGeometry(model).add_gl_pair(
        qg.Source("0.weight", rows=(0, 4)), qg.Source("2.weight", axis=1, cols=(0, 4)), heads=4
    )
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(10, 4, generator=gen, dtype=DT), torch.randn(10, 3, generator=gen, dtype=DT))
    ]

    def loss(m, batch):
        x, y = batch
        return ((m(x) - y) ** 2).mean() + 0.1 * (m(x) ** 3).mean()

    return model, geometry, loss, batches


def operator(case: str, **kw):
    if case == "transformer":
        model, batches = tiny_transformer()
        return qg.RiemannianHessian(
            model, cross_entropy, batches, product="finite_difference", **kw
        )
    if case == "two_factor":
        model = TwoFactor(6, 5, 2, bias=True, seed=3)
        return qg.RiemannianHessian(
            model, cubic_loss, data(d_in=6, d_out=5), symmetries=model.geometry(),
            product="finite_difference", **kw,
        )  # fmt: skip
    model, geometry, loss, batches = masked_rest()
    return qg.RiemannianHessian(
        model, loss, batches, symmetries=geometry, product="finite_difference", **kw
    )


@settings(max_examples=12, deadline=None)
@given(
    case=st.sampled_from(["transformer", "two_factor", "masked"]),
    geometry=st.sampled_from(["riemannian", "euclidean"]),
    beta=st.sampled_from([0.0, -0.75, 1.5]),
    seed=st.integers(0, 2**16),
)
def test_addmv_equals_the_product_added(case, geometry, beta, seed):
    H = operator(case, geometry=geometry)
    assert H._loss.streams == (case != "masked")  # the masked rest is gathered, not streamed
    gen = torch.Generator().manual_seed(seed)
    z, start = torch.randn(2, H.dim, generator=gen, dtype=H.dtype)
    expected = beta * start + H @ z
    out = start.clone()
    assert H.addmv_(out, z, beta=beta) is out
    torch.testing.assert_close(out, expected, rtol=1e-14, atol=1e-14 * float(expected.abs().max()))
    # into a given vector (streamed from the gradients where the model allows) or into a new
    # one (gathered first): the same product up to rounding
    product = H @ z
    into = H.addmv_(torch.full_like(z, float("nan")), z, beta=0.0)
    torch.testing.assert_close(into, product, rtol=1e-12, atol=1e-12 * float(product.abs().max()))
    # the columns of a matrix are the products of its columns
    Z = torch.randn(H.dim, 3, generator=gen, dtype=H.dtype)
    columns = torch.stack([H @ c for c in Z.unbind(1)], dim=1)
    torch.testing.assert_close(H @ Z, columns, rtol=0, atol=0)


def test_addmv_refuses_bad_output():
    H = operator("two_factor")
    z = torch.randn(H.dim, dtype=H.dtype)
    with pytest.raises(ValueError, match="share memory"):
        H.addmv_(z, z, beta=1.0)
    with pytest.raises(ValueError, match="contiguous"):
        H.addmv_(torch.zeros(H.dim, dtype=torch.float32), z, beta=1.0)
    with pytest.raises(ValueError, match="shape"):
        H.addmv_(torch.zeros(H.dim + 1, dtype=H.dtype), z, beta=1.0)


def test_lanczos_holds_two_vectors_of_the_operator_size(monkeypatch):
    """At the end of each product (the weights written back) the vectors made since the
    recurrence started that are as large as the adaptive rest are ``v_j`` and ``v_{j-1}``,
    which holds ``A v_j - β v_{j-1}``: the rest's part of the difference went into it from the
    gradients, no third vector."""
    H = operator("transformer")

    def large() -> set[int]:
        return {
            t.untyped_storage().data_ptr()
            for t in gc.get_objects()
            if type(t) is torch.Tensor and t.untyped_storage().nbytes() >= H._w.nbytes
        }

    gc.collect()
    before = large()  # alive throughout (the operator's among them): their storage not reused
    counts = []
    write = InPlaceLoss._write

    def watching(self, w, rest=None, xi=None):
        if rest is None:  # written back: the product's passes and gathers are done
            counts.append(len(large() - before))
        return write(self, w, rest, xi)

    monkeypatch.setattr(InPlaceLoss, "_write", watching)
    with pytest.warns(RuntimeWarning, match="did not reach"):
        found = lanczos_extreme(H, tol=1e-300, max_iter=8)
    assert found.iterations == len(counts) == 8
    assert counts == [2] * 8  # v_j and v_{j-1} (the first: v_1 and its output)


@pytest.mark.filterwarnings("ignore:the model has torch.bfloat16 parameters")
def test_bfloat16_rest_is_kept_exactly_and_gives_the_same_product(monkeypatch):
    model, batches = tiny_transformer(seed=2)
    model = model.to(torch.bfloat16)
    batches = [(x.to(torch.bfloat16), y) for x, y in batches]
    H = qg.RiemannianHessian(model, cross_entropy, batches, product="finite_difference")
    assert H._w.dtype == torch.bfloat16 and H.dtype == torch.float32
    z = torch.randn(H.dim, generator=torch.Generator().manual_seed(0))
    narrow = H @ z
    monkeypatch.setattr(InPlaceLoss, "rest_dtype", property(lambda self: self.dtype))
    wide = qg.RiemannianHessian(model, cross_entropy, batches, product="finite_difference")
    assert wide._w.dtype == torch.float32
    torch.testing.assert_close(narrow, wide @ z, rtol=0, atol=0)
    assert torch.equal(H._w.float(), wide._w)


class Rescaled(qg.AdaptiveGeometry):
    """The adaptive metric with its scale redefined (the same formula): the parts' unfused path."""

    def scale(self, p):
        return p.x.abs().clamp_min(self.floor)


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_a_redefined_rest_scale_gives_the_same_product(monkeypatch, beta):
    gen = torch.Generator().manual_seed(5)
    fused = operator("transformer")
    z, start = torch.randn(2, fused.dim, generator=gen, dtype=fused.dtype)
    expected = fused.addmv_(start.clone(), z, beta=beta)
    monkeypatch.setattr(qg.ParameterGeometry, "rest_manifold", lambda self: Rescaled())
    unfused = operator("transformer")
    assert not unfused.parts[-1]._fused and fused.parts[-1]._fused
    got = unfused.addmv_(start.clone(), z, beta=beta)
    torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13 * float(expected.abs().max()))
