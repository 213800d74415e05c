"""The adaptive rest's Gram pass and step by compiled kernels (``compile=True``,
:mod:`quotientgeo.sharpness.fused`) against the eager passes and against the formulas.

The Gram kernel's ``K`` equals ``V diag(1/ŵ²) Vᵀ`` of ``V = (w̃ - x₀, ξ', ŵ²∇)`` formed densely
in float64, and the eager :meth:`Piece.gradient_gram_`, to rounding; its ``g = ŵ² ∇`` equals the
eager one bit for bit. The step kernel writes ``ξ' ← w̃ - x₀`` and ``w̃ ← x₀ + c₀ξ + c₁ξ' + c₂g``;
the held step, for an iterate held in tensors of its own, ``ξ' ← ξ`` and ``c₀ξ + c₁ξ' + c₂g``
into new tensors. Whole measurements with and without them agree in float64 and leave the model
as it was; the dispatcher sees one operator per pass for all the pieces together. Pieces that do
not qualify take the eager path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quotientgeo import AdaptiveGeometry, adaptive_sharpness, geodesic_sharpness
from quotientgeo.bench.cost import CostCounter
from quotientgeo.geometry.perturbation import Piece, Segment
from quotientgeo.sharpness import fused
from quotientgeo.sharpness.fused import fused_gram, fused_held_step, fused_step
from quotientgeo.testing import TinyTransformerClassifier, cross_entropy

sys.path.insert(0, str(Path(__file__).parents[1] / "geometry"))  # the families' tiny models
from tiny_families import regression


@pytest.fixture(scope="module", autouse=True)
def _compiles():
    """Skip where torch.compile cannot build a kernel here (no C++ compiler)."""
    try:
        torch.compile(lambda x: x * 2 + 1, dynamic=False)(torch.ones(3))
    except Exception as err:  # pragma: no cover - depends on the machine
        pytest.skip(f"torch.compile unavailable: {type(err).__name__}: {err}")


def _piece(sizes, seed, floor=1e-12):
    """A piece of ``len(sizes)`` parameters and its tensors: weights ``x0 + ξ``, ``x0`` (some
    entries below the floor, some zero), ``ξ'`` and ``∇``, by name."""
    gen = torch.Generator().manual_seed(seed)
    names = [f"p{i}" for i in range(len(sizes))]

    def draw(scale=1.0):
        return {
            n: scale * torch.randn(k, generator=gen, dtype=torch.float64)
            for n, k in zip(names, sizes, strict=True)
        }

    x0 = draw()
    for t in x0.values():
        t[::5] *= 1e-14  # ŵ = floor there
        t[::7] = 0.0
    xi, prev, grads = draw(0.01), draw(0.01), draw()
    weights = {n: x0[n] + xi[n] for n in names}
    segments = tuple(Segment(n, 0, k) for n, k in zip(names, sizes, strict=True))
    return Piece(segments, AdaptiveGeometry(floor)), weights, x0, prev, grads


def _dense_gram(piece, weights, x0, prev, grads):
    cat = lambda d: torch.cat([d[s.name] for s in piece.segments])  # noqa: E731
    scale_squared = cat(x0).square().clamp_min(piece.manifold.floor**2)
    V = torch.stack((cat(weights) - cat(x0), cat(prev), scale_squared * cat(grads)))
    return V @ (V / scale_squared).mT, V[2]


@settings(max_examples=6, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_fused_gram_equals_the_formula_and_the_eager_pass(sizes, seed):
    piece, weights, x0, prev, grads = _piece(sizes, seed)
    expected, g = _dense_gram(piece, weights, x0, prev, grads)
    eager_grads = {n: t.clone() for n, t in grads.items()}
    space = piece.space(piece.read(x0, torch.float64))
    xi = piece.differences(weights, x0, torch.float64)
    eager = piece.gradient_gram_(space, xi, prev, eager_grads)

    K = fused_gram([piece], weights, x0, prev, grads, torch.float64)
    assert K is not None
    assert torch.equal(K, K.mT)  # each sum taken once
    scale = expected.diagonal().sqrt()
    bound = 1e-13 * scale[:, None] * scale[None, :]
    assert ((K - expected).abs() <= bound).all()
    assert ((K - eager.triu() - eager.triu(1).mT).abs() <= bound).all()
    fused_g = torch.cat([grads[s.name] for s in piece.segments])
    assert torch.equal(fused_g, torch.cat([eager_grads[s.name] for s in piece.segments]))
    assert torch.allclose(fused_g, g, rtol=1e-15, atol=0)


@settings(max_examples=4, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=2),
    seed=st.integers(0, 2**16),
)
def test_fused_step_is_the_combination(sizes, seed):
    piece, weights, x0, prev, grads = _piece(sizes, seed)
    c = torch.randn(3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    xi = {n: weights[n] - x0[n] for n in weights}
    expected = {n: x0[n] + (c[2] * grads[n] + c[1] * prev[n] + c[0] * xi[n]) for n in weights}
    before = {n: t.clone() for n, t in grads.items()}
    assert fused_step([piece], weights, x0, prev, grads, c, torch.float64)
    for n in weights:
        assert torch.equal(prev[n], xi[n])
        assert torch.allclose(weights[n], expected[n], rtol=1e-15, atol=1e-300)
        assert torch.equal(grads[n], before[n])


@settings(max_examples=4, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_fused_held_step_is_the_combination(sizes, seed):
    """``ξ_k`` held in tensors of its own (the symmetric parameters' weights, where it is
    parked): ``targets ← c₀ξ + c₁ξ' + c₂g`` and ``ξ' ← ξ``, the gradients untouched."""
    piece, xi, _, prev, grads = _piece(sizes, seed)
    c = torch.randn(3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    expected = {n: c[2] * grads[n] + c[1] * prev[n] + c[0] * xi[n] for n in xi}
    held = {n: t.clone() for n, t in xi.items()}
    before = {n: t.clone() for n, t in grads.items()}
    targets = {n: torch.full_like(t, torch.nan) for n, t in xi.items()}
    assert fused_held_step([piece], xi, prev, grads, targets, c, torch.float64)
    for n in xi:
        assert torch.equal(prev[n], held[n]) and torch.equal(xi[n], held[n])
        assert torch.equal(targets[n], expected[n])
        assert torch.equal(grads[n], before[n])


def test_pieces_in_one_call_are_the_pieces_one_by_one():
    """The rest's pieces go to the kernels in one call: the Gram matrices add up, the step is
    the same, bit for bit, and a piece that does not qualify leaves the whole call undone."""
    piece, weights, x0, prev, grads = _piece([40, 7, 300], 5)
    first, second = (
        Piece(piece.segments[:1], piece.manifold),
        Piece(piece.segments[1:], piece.manifold),
    )
    copies = [{n: t.clone() for n, t in grads.items()} for _ in range(2)]
    together = fused_gram([first, second], weights, x0, prev, copies[0], torch.float64)
    apart = [fused_gram([p], weights, x0, prev, copies[1], torch.float64) for p in (first, second)]
    assert together is not None and all(K is not None for K in apart)
    assert torch.allclose(together, apart[0] + apart[1], rtol=1e-14, atol=0)
    assert all(torch.equal(copies[0][n], copies[1][n]) for n in grads)
    c = torch.tensor([0.3, -0.2, 0.05], dtype=torch.float64)
    states = [[{n: t.clone() for n, t in d.items()} for d in (weights, prev)] for _ in range(2)]
    assert fused_step([first, second], states[0][0], x0, states[0][1], grads, c, torch.float64)
    for p in (first, second):
        assert fused_step([p], states[1][0], x0, states[1][1], grads, c, torch.float64)
    for a, b in zip(states[0], states[1], strict=True):
        assert all(torch.equal(a[n], b[n]) for n in a)
    masked = Piece((Segment("p0", 0, 40, torch.arange(40) % 2 == 0),), piece.manifold)
    assert fused_gram([second, masked], weights, x0, prev, grads, torch.float64) is None
    assert not fused_step([second, masked], weights, x0, prev, grads, c, torch.float64)
    assert fused_gram([], weights, x0, prev, grads, torch.float64) is None


def test_pieces_that_do_not_qualify_take_the_eager_path():
    piece, weights, x0, prev, grads = _piece([10, 20], 0)
    untouched = {n: t.clone() for n, t in grads.items()}

    class OwnScale(AdaptiveGeometry):
        def metric(self, p, u):
            return u

    masked = Piece(
        (Segment("p0", 0, 10, torch.arange(10) % 2 == 0), piece.segments[1]), piece.manifold
    )
    narrow = {n: t.float() for n, t in weights.items()}
    sharded = Piece(piece.segments, piece.manifold, sharded=True)
    for part, w in (
        (masked, weights),
        (Piece(piece.segments, OwnScale()), weights),
        (sharded, weights),
        (piece, narrow),
    ):
        assert fused_gram([part], w, x0, prev, grads, torch.float64) is None
    c = torch.ones(3, dtype=torch.float64)
    assert not fused_step([masked], weights, x0, prev, grads, c, torch.float64)
    assert not fused_step([sharded], weights, x0, prev, grads, c, torch.float64)
    assert all(torch.equal(grads[n], untouched[n]) for n in grads)


def _classifier():
    torch.manual_seed(0)
    model = TinyTransformerClassifier(16, 2, 2, classes=5).double().eval()
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 6, 16, generator=gen, dtype=torch.float64), torch.randint(0, 5, (8,)))
        for _ in range(2)
    ]
    return model, batches


@pytest.mark.parametrize(
    "measure",
    [
        lambda **kw: adaptive_sharpness(rho=0.05, n_iter=8, **kw),
        lambda **kw: geodesic_sharpness(rho=0.05, metric="mix", n_iter=8, **kw),
    ],
    ids=["adaptive", "geodesic_mix"],
)
def test_compiled_measurement_equals_the_eager_one(measure, request):
    model, batches = _classifier()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    eager = measure(model=model, loss_fn=cross_entropy, batches=batches, progress=False)
    with CostCounter() as counter:
        fused = measure(
            model=model, loss_fn=cross_entropy, batches=batches, progress=False, compile=True
        )
    assert counter.by_op.get("adaptive_gram", 0) == 2 * 8  # all pieces in one call
    assert counter.by_op.get("adaptive_step", 0) >= 2 * 8 // 2
    if "geodesic" in request.node.callspec.id:  # the symmetric parameters' ξ_k is parked
        assert counter.by_op.get("held_step", 0) >= 2 * 8 // 2
    assert fused.value == pytest.approx(eager.value, rel=1e-10, abs=1e-14)
    for a, b in zip(fused.per_batch, eager.per_batch, strict=True):
        assert a == pytest.approx(b, rel=1e-10, abs=1e-14)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_compiled_measurement_of_a_family_equals_the_eager_one(name):
    """Families whose fused projections are partly covered by blocks (GPT-2's ``c_attn`` with
    its biases) or not (Llama's separate projections): exact inv moves the blocks, the rest is
    compiled where it qualifies."""
    model, loss_fn = regression(name)
    kw = dict(rho=0.05, metric="inv", n_iter=6, progress=False)
    eager = geodesic_sharpness(model, loss_fn, [None], **kw)
    with CostCounter() as counter:
        fused = geodesic_sharpness(model, loss_fn, [None], compile=True, **kw)
    assert counter.by_op.get("adaptive_gram", 0) > 0 and counter.by_op.get("adaptive_step", 0) > 0
    assert fused.value == pytest.approx(eager.value, rel=1e-10, abs=1e-14)


def test_compile_must_be_a_bool():
    model, batches = _classifier()
    with pytest.raises(TypeError, match="compile must be True or False"):
        adaptive_sharpness(model, cross_entropy, batches, rho=0.05, compile="yes")


def test_the_kernels_compile_for_more_segment_counts_than_torchs_default():
    """Each number of segments in a call compiles once; the rest in one call and the pieces'
    held segments in others give more than torch's default of 8 counts, so the calls raise the
    limit to ``RECOMPILE_LIMIT`` (and torch's own setting is left as it was): every count gets
    a graph of its own, none runs eagerly."""
    from torch._dynamo.utils import counters

    config = torch._dynamo.config  # pyright: ignore[reportAttributeAccessIssue]
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    before = getattr(config, name)
    double = fused._compiled(lambda xs: [x * 2 for x in xs])
    counters.clear()
    counts = range(1, before + 3)
    for n in counts:
        assert all(torch.equal(y, 2 * torch.ones(2)) for y in double([torch.ones(2)] * n))
    assert getattr(config, name) == before
    assert counters["stats"]["unique_graphs"] == len(counts)
