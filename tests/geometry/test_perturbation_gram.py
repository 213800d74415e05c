"""The Gram pass of the maximiser, piece by piece, against the straightforward formula.

A piece's three vectors ``(ξ_k, ξ_{k-1}, ∇)`` are read in one concatenation
(:meth:`Piece.rows`), ``∇`` becomes the Riemannian gradient in place (in the gradients' own
tensors, :meth:`Piece.gradient_gram_`) and the Gram matrix comes from that one tensor
(:meth:`PerturbationSpace.gradient_gram`), or only its last column, the products with ``g``
(``row=True``, :meth:`PerturbationSpace.gradient_row`: for the adaptive rest ``Σ v ∇``, taken
before ``∇`` becomes ``g``); here ``g = ŵ² ∇`` and ``K_ij = Σ vᵢ vⱼ / ŵ²``
(``ŵ = max(|x|, floor)``) are computed entry by entry from the flattened vectors, and a
chunk's generic path against ``rgrad`` and :meth:`gram`, over random models, seeds, piece
sizes, masked segments, weights at the floor and half-precision parameters. Tolerance: float64
to ``1e-12`` of ``√(K_ii K_jj)`` for ``K_ij`` (the order of the sums differs, and a sum of
products rounds with the norms of its vectors), the float32 compute dtype of bfloat16
parameters to ``1e-5``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from quotientgeo import ParameterGeometry
from quotientgeo.geometry import Source, find_symmetries
from quotientgeo.geometry import perturbation as pt
from quotientgeo.testing import TinyTransformerClassifier

DT = torch.float64


def random_like(space: pt.Perturbations, gen: torch.Generator, zeros: float = 0.0):
    out = {}
    for name, t in space.local().items():
        r = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
        out[name] = r.masked_fill(torch.rand(t.shape, generator=gen) < zeros, 0.0)
    return out


def assert_gram_close(got: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """``|K_ij - E_ij| ≤ rtol √(E_ii E_jj)``: a sum of products rounds in proportion to the
    vectors' norms (Cauchy–Schwarz), not to the sum, which cancels where they are nearly
    orthogonal (a bound relative to each entry fails such draws at the level of rounding)."""
    scale = expected.diagonal().sqrt()
    bound = rtol * scale[:, None] * scale[None, :]
    assert ((got.double() - expected).abs() <= bound).all(), (got, expected)


def assert_row_close(got: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """The last column of :func:`assert_gram_close`'s bound: ``|r_i - E_i2| ≤ rtol
    √(E_ii E_22)``."""
    scale = expected.diagonal().sqrt()
    bound = rtol * scale * scale[2]
    assert ((got.double() - expected[:, 2]).abs() <= bound).all(), (got, expected)


def check_pieces(space: pt.Perturbations, seed: int, zeros: float, rtol: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    x0, w = random_like(space, gen, zeros), random_like(space, gen)
    prev, grads = random_like(space, gen), random_like(space, gen)
    dtype = space.dtype
    assert space.rest
    for piece in space.rest:
        xi = piece.rows(piece.differences(w, x0, dtype))[0]
        torch.testing.assert_close(xi, piece.read(w, dtype) - piece.read(x0, dtype))
        rows = piece.rows(
            piece.differences(w, x0, dtype),
            piece.entries(prev, dtype),
            piece.entries(grads, dtype),
        )
        g, gram = piece.space(piece.read(x0, dtype)).gradient_gram(rows)
        # the straightforward formula, in float64 from the flattened vectors
        x = piece.read(x0, dtype).double()
        scale = x.abs().clamp_min(space.rest_manifold.floor)
        vectors = [xi.double(), piece.read(prev, dtype).double(), piece.read(grads, dtype).double()]
        vectors[2] = vectors[2] * scale**2
        expected = torch.tensor(
            [[float((u * v / scale**2).sum()) for v in vectors] for u in vectors], dtype=DT
        )
        torch.testing.assert_close(g.double(), vectors[2], rtol=rtol, atol=0.0)
        # the upper triangle is the Gram matrix, mirrored once the parts are summed (what the
        # maximiser takes); the lower one is the same products in the other order, unused
        mirrored = pt.mirror_upper(gram)
        assert torch.equal(mirrored, mirrored.mT) and torch.equal(mirrored.triu(), gram.triu())
        assert_gram_close(mirrored, expected, rtol)
        # the gradients replaced by g in their own tensors (in place, or written back)
        out = {name: t.clone() for name, t in grads.items()}
        gram = piece.gradient_gram_(
            piece.space(piece.read(x0, dtype)), piece.differences(w, x0, dtype), prev, out
        )
        assert_gram_close(pt.mirror_upper(gram), expected, rtol)
        stored = vectors[2].to(out[piece.names[0]].dtype).double()  # in the gradients' dtype
        torch.testing.assert_close(piece.read(out, dtype).double(), stored, rtol=rtol, atol=0)
        for name in grads:  # nothing else written
            if name not in piece.names:
                assert torch.equal(out[name], grads[name])
        # the last column alone, from the concatenated rows and from the gradients' tensors
        rows = piece.rows(
            piece.differences(w, x0, dtype),
            piece.entries(prev, dtype),
            piece.entries(grads, dtype),
        )
        g, row = piece.space(piece.read(x0, dtype)).gradient_row(rows)
        torch.testing.assert_close(g.double(), vectors[2], rtol=rtol, atol=0.0)
        assert_row_close(row, expected, rtol)
        again = {name: t.clone() for name, t in grads.items()}
        row = piece.gradient_gram_(
            piece.space(piece.read(x0, dtype)),
            piece.differences(w, x0, dtype),
            prev,
            again,
            row=True,
        )
        assert row.shape == (3,)
        assert_row_close(row, expected, rtol)
        for name in grads:  # g written where gradient_gram_ writes it, nothing else
            assert torch.equal(again[name], out[name])
        grads = out


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    shape=st.sampled_from([(8, 2, 1), (16, 4, 2), (12, 3, 1)]),
    piece=st.sampled_from([0, 7, 100, 10_000]),
    zeros=st.sampled_from([0.0, 0.3]),
    symmetric=st.booleans(),
)
def test_piece_gram_matches_the_formula(seed, shape, piece, zeros, symmetric):
    d, heads, layers = shape
    torch.manual_seed(seed)
    model = TinyTransformerClassifier(d=d, heads=heads, layers=layers, classes=3).to(DT)
    geometry = find_symmetries(model) if symmetric else ParameterGeometry(model)
    with pytest.MonkeyPatch.context() as mp:
        if piece:  # pieces of a few entries: small parameters shared, large ones sliced
            mp.setattr(pt, "PIECE", piece)
            mp.setattr(pt, "SMALL", piece)
            mp.setattr(pt, "CHUNK_FRACTION", 1e-9)  # (or a chunk's worth of entries)
            mp.setattr(pt, "MIN_CHUNK_BYTES", piece)
        space = pt.Perturbations(geometry, "second_order")
    if piece == 7:
        assert len(space.rest) > 1
    check_pieces(space, seed, zeros, rtol=1e-12)


def test_masked_segments():
    """Hidden units 0..3 as GL(1) pairs: both weights partly in the rest."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    geometry = ParameterGeometry(model).add_gl_pair(
        Source("0.weight", rows=(0, 4)), Source("2.weight", axis=1, cols=(0, 4)), heads=4
    )
    space = pt.Perturbations(geometry, "second_order")
    assert any(seg.mask is not None for piece in space.rest for seg in piece.segments)
    check_pieces(space, 0, 0.2, rtol=1e-12)


@pytest.mark.filterwarnings("ignore:the model has torch.bfloat16 parameters")
def test_half_precision_parameters():
    torch.manual_seed(1)
    model = TinyTransformerClassifier(d=8, heads=2, layers=1, classes=3).to(torch.bfloat16)
    space = pt.Perturbations(ParameterGeometry(model), "second_order")
    assert space.dtype == torch.float32
    check_pieces(space, 1, 0.0, rtol=1e-5)


@pytest.mark.parametrize("norm", ["riemannian", "adaptive"])
@pytest.mark.parametrize(
    ("metric", "move"),
    [("mix", "second_order"), ("inv", "exact"), ("inv", "second_order"), ("mix", "first_order")],
)
def test_chunk_gradient_gram_is_rgrad_and_gram(metric, move, norm):
    """The generic path (a chunk of symmetry blocks): ``g = rgrad(J(ξ)ᵀ ∇)`` and
    :meth:`~PerturbationSpace.gram` of ``(ξ, ξ_prev, g)``, for horizontal iterates (as the
    maximiser's are); the last column alone (``gradient_row``) in the manifold's own metric
    without applying it (``<v, g> = <v, J(ξ)ᵀ ∇>``), in the adaptive one with it."""
    torch.manual_seed(2)
    model = TinyTransformerClassifier(d=12, heads=3, layers=2, classes=3).to(DT)
    space = pt.Perturbations(find_symmetries(model, metric=metric), move, norm)
    gen = torch.Generator().manual_seed(3)
    x0, xi = random_like(space, gen), random_like(space, gen)
    prev, grads = random_like(space, gen), random_like(space, gen)
    for chunk in space.all_chunks():
        s = chunk.space(chunk.read(x0, DT))
        assert (s.ball is s.manifold) == (norm == "riemannian")
        vs = [s.manifold.proju(s.point, 0.01 * chunk.read(t, DT)) for t in (xi, prev)]
        vs.append(chunk.read(grads, DT))
        g, gram = s.gradient_gram(torch.stack(vs))
        expected_g = s.rgrad(s.pullback(vs[0], vs[2]))
        torch.testing.assert_close(g, expected_g, rtol=1e-12, atol=1e-14)
        expected = s.gram(vs[0], vs[1], expected_g)
        torch.testing.assert_close(pt.mirror_upper(gram), expected, rtol=1e-12, atol=1e-14)
        g, row = s.gradient_row(torch.stack(vs))
        torch.testing.assert_close(g, expected_g, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(row, expected[:, 2], rtol=1e-12, atol=1e-14)
        norm_g = s.gradient_sqnorm(expected_g, s.pullback(vs[0], vs[2]))
        torch.testing.assert_close(norm_g, expected[2, 2], rtol=1e-12, atol=1e-14)


@given(
    parts=st.integers(1, 6),
    k=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_mirroring_the_sum_is_the_sum_of_the_mirrored(parts, k, dtype, seed):
    """The maximiser sums the parts' unmirrored ``V M Vᵀ`` and mirrors the sum once: the same
    bits as summing the parts' mirrored Gram matrices in the same order."""
    gen = torch.Generator().manual_seed(seed)
    grams = [torch.randn(k, k, generator=gen, dtype=dtype) for _ in range(parts)]
    raw, mirrored = torch.zeros(k, k, dtype=dtype), torch.zeros(k, k, dtype=dtype)
    for gram in grams:
        raw.add_(gram)
        mirrored.add_(pt.mirror_upper(gram))
    assert torch.equal(pt.mirror_upper(raw), mirrored)


@pytest.mark.parametrize(
    ("layers", "dtype"), [(1, DT), (3, DT), (2, torch.bfloat16)], ids=["one", "congruent", "bf16"]
)
def test_chunk_read_into_a_given_tensor_is_the_read(layers, dtype):
    """``BlockChunk.read(..., out=)`` (the Gram pass reads ``ξ_k`` and ``ξ_{k-1}`` into the
    rows of one tensor) writes the points that a plain read returns, bit for bit, whether the
    blocks are read together (congruent layers), one by one, or from narrower parameters."""
    torch.manual_seed(4)
    model = TinyTransformerClassifier(d=12, heads=3, layers=layers, classes=3).to(dtype)
    space = pt.Perturbations(find_symmetries(model, metric="mix"), "second_order")
    tensors = random_like(space, torch.Generator().manual_seed(5))
    for chunk in space.all_chunks():
        expected = chunk.read(tensors, space.dtype)
        rows = torch.full((2, *expected.shape), torch.nan, dtype=space.dtype)
        assert chunk.read(tensors, space.dtype, out=rows[1]).data_ptr() == rows[1].data_ptr()
        assert torch.equal(rows[1], expected)
        assert rows[0].isnan().all()
