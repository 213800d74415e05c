"""GeodesicSAM's first step against the straightforward formula, part by part.

The adaptive rest (every parameter for SAM and ASAM) is stepped with ``_foreach`` operators on
the parameters' own tensors, or with ``compile=True`` by one compiled kernel per pass for all
the pieces that are plain views (counted at the dispatcher); here the same step is computed
through the manifold API alone, ``ξ = ρ grad / ||grad||`` with, for every part,
``grad = rgrad(∇)`` (the rest's ``ŵ² ∇``, SAM's ``∇``), ``||grad||² = Σ sqnorm(grad)`` and the
part's move of ``ξ``, over random models, seeds,
piece sizes (parameters shared by pieces and sliced into several), chunk sizes and budgets
(symmetry blocks whose gradients and points are kept for the second pass, or only their
gradients, or neither), weights at the floor (exact zeros, and a floor of 0.05 that many
weights are below), masked rest entries, a non-contiguous parameter and half precision.
Tolerance: float64 to ``1e-13`` relative (the two differ in the order of the sums and products
only), bfloat16 to one unit in the last place of the weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from quotientgeo import ParameterGeometry
from quotientgeo.bench.cost import CostCounter
from quotientgeo.geometry import Source
from quotientgeo.geometry import perturbation as pt
from quotientgeo.manifolds import AdaptiveGeometry
from quotientgeo.optim import GeodesicSAM
from quotientgeo.testing import TinyTransformerClassifier

DT = torch.float64


def expected_first_step(opt: GeodesicSAM) -> dict[str, torch.Tensor]:
    """The weights after ``first_step`` by the manifold API: rgrad, sqnorm and move per part."""
    space, dtype, rho = opt.space, opt.space.dtype, opt.param_groups[0]["rho"]
    weights = {n: t.detach().clone() for n, t in space.local().items()}
    grads = {n: p.grad.detach().clone() for n, p in space.params.items()}
    steps, sq = [], torch.zeros((), dtype=dtype)
    for part in space.parts():
        s = part.space(part.read(weights, dtype))
        g = s.rgrad(part.read(grads, dtype))
        sq = sq + s.sqnorm(g)
        steps.append((part, s, g))
    scale = rho / (sq.sqrt() + torch.finfo(dtype).tiny)
    out = {n: t.clone() for n, t in weights.items()}
    for part, s, g in steps:
        part.write_(out, s.move(g * scale))
    return out


def check(
    model: nn.Module,
    loss_fn,
    *,
    rtol: float,
    atol: float,
    floor=None,
    budget=None,
    fused_calls: int = 0,
    **kw,
) -> None:
    opt = GeodesicSAM(model, torch.optim.SGD, lr=0.1, **kw)
    if budget is not None:  # what the first pass may keep (a piece's bytes), in chunks' gradients
        chunk = next(opt.space.all_chunks())
        size = chunk.read(opt.space.local(), opt.space.dtype).nbytes
        opt.space.piece_size = int(budget * size) // opt.space.dtype.itemsize
    if floor is not None and isinstance(opt.rest, AdaptiveGeometry):
        opt.rest.floor = floor  # (the pieces' manifold): weights below it are at the floor
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss_fn(model).backward()
    expected = expected_first_step(opt)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with CostCounter() as counter:
        opt.first_step()
    calls = [counter.by_op.get(name, 0) for name in ("rest_sqnorm", "rest_step")]
    assert calls == [fused_calls, fused_calls]  # each compiled pass one call for all pieces
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=rtol, atol=atol, msg=name)
        assert torch.equal(p.grad, grads[name])  # the gradients are read, not written
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    opt.restore()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name])


def zero_some_(model: nn.Module, fraction: float, seed: int) -> None:
    """Set about ``fraction`` of every parameter's entries to exact zeros (the floor ``ŵ``)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.masked_fill_(torch.rand(p.shape, generator=gen) < fraction, 0.0)


def classifier(seed: int, shape: tuple[int, int, int], zeros: float):
    """A float64 classifier of ``(width, heads, layers)`` with about ``zeros`` of its entries
    exact zeros, and the cross-entropy of a random batch: ``(model, loss_fn)``."""
    d, heads, layers = shape
    torch.manual_seed(seed)
    model = TinyTransformerClassifier(d=d, heads=heads, layers=layers, classes=3).to(DT)
    zero_some_(model, zeros, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(4, 3, d, generator=gen, dtype=DT)
    y = torch.randint(0, 3, (4,), generator=gen)
    return model, lambda m: nn.functional.cross_entropy(m(x), y)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    shape=st.sampled_from([(8, 2, 1), (16, 4, 2), (12, 3, 1)]),
    variant=st.sampled_from(["sam", "asam", "geodesic"]),
    perturbation=st.sampled_from(["second_order", "first_order"]),
    piece=st.sampled_from([0, 7, 100, 10_000]),
    zeros=st.sampled_from([0.0, 0.3]),
    floor=st.sampled_from([None, 0.05]),
    chunk=st.sampled_from([None, 1, 3000]),
)
def test_first_step_matches_the_formula_part_by_part(
    seed, shape, variant, perturbation, piece, zeros, floor, chunk
):
    model, loss_fn = classifier(seed, shape, zeros)
    with pytest.MonkeyPatch.context() as mp:
        if piece:  # pieces of a few entries: small parameters shared, large ones sliced
            mp.setattr(pt, "PIECE", piece)
            mp.setattr(pt, "SMALL", piece)
        if piece or chunk:  # (a piece holds a chunk's worth of entries where that is more)
            mp.setattr(pt, "CHUNK_FRACTION", 1e-9)
            mp.setattr(pt, "MIN_CHUNK_BYTES", chunk or piece)
        if piece == 7 and not chunk:  # pieces of 7 entries
            assert len(GeodesicSAM(model, torch.optim.SGD, variant=variant).space.rest) > 1
        kw = {"perturbation": perturbation} if variant == "geodesic" else {}
        check(model, loss_fn, rtol=1e-13, atol=1e-15, floor=floor, rho=0.05, variant=variant, **kw)


@pytest.mark.parametrize("budget", [0, 1.5, 2, 10])
@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_chunks_kept_for_the_second_pass_or_computed_again(budget, metric):
    """A budget of 1.5 chunks keeps the first chunk's gradient only, 2 its gradient and point,
    10 every chunk's: each way the step is the formula's."""
    torch.manual_seed(3)
    model = TinyTransformerClassifier(d=12, heads=3, layers=2, classes=3).to(DT)
    x = torch.randn(4, 3, 12, dtype=DT)
    y = torch.randint(0, 3, (4,))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pt, "CHUNK_FRACTION", 1e-9)
        mp.setattr(pt, "MIN_CHUNK_BYTES", 1)  # a chunk per block
        check(
            model,
            lambda m: nn.functional.cross_entropy(m(x), y),
            rtol=1e-13,
            atol=1e-15,
            budget=budget,
            metric=metric,
        )


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("variant", ["sam", "asam", "geodesic"])
def test_masked_rest_entries(variant, compile):
    """Hidden units 0..3 as GL(1) pairs: both weights partly in the rest (masked segments);
    compiled, the masked segments' pieces take the eager passes (geodesic: every piece here),
    the others the kernels."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    symmetries = ParameterGeometry(model).add_gl_pair(
        Source("0.weight", rows=(0, 4)), Source("2.weight", axis=1, cols=(0, 4)), heads=4
    )
    x = torch.randn(10, 4, dtype=DT)
    y = torch.randint(0, 3, (10,))
    kw = {"symmetries": symmetries} if variant == "geodesic" else {}
    check(
        model,
        lambda m: nn.functional.cross_entropy(m(x), y),
        rtol=1e-13,
        atol=1e-15,
        variant=variant,
        compile=compile,
        fused_calls=int(compile and variant != "geodesic"),
        **kw,
    )
    if variant == "geodesic":
        opt = GeodesicSAM(model, torch.optim.SGD, lr=0.1, variant=variant, **kw)
        assert any(seg.mask is not None for piece in opt.space.rest for seg in piece.segments)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("variant", ["sam", "asam"])
def test_non_contiguous_parameter(variant, compile):
    """Compiled, the piece of the non-contiguous parameter takes the eager passes."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    model[0].weight = nn.Parameter(torch.randn(5, 4, dtype=DT).t())  # a transposed view
    assert not model[0].weight.is_contiguous()
    x = torch.randn(6, 5, dtype=DT)
    kw = {"variant": variant, "compile": compile}
    check(model, lambda m: m(x).square().mean(), rtol=1e-13, atol=1e-15, **kw)


@pytest.mark.parametrize("variant", ["sam", "asam", "geodesic"])
def test_compiled_rest_matches_the_formula(variant):
    """``compile=True``: the rest's two passes are one compiled kernel each for all its pieces
    (small parameters shared by pieces, large ones sliced), and the step is the formula's to
    the eager path's tolerance (the norm's sums are taken in another order), with exact zeros
    and weights below a floor of 0.05 (most of them)."""
    model, loss_fn = classifier(5, (16, 4, 2), zeros=0.3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pt, "PIECE", 100)  # several pieces, one call
        mp.setattr(pt, "SMALL", 100)
        mp.setattr(pt, "MIN_CHUNK_BYTES", 100)
        mp.setattr(pt, "CHUNK_FRACTION", 1e-9)
        check(
            model,
            loss_fn,
            rtol=1e-13,
            atol=1e-15,
            floor=0.05,
            rho=0.05,
            variant=variant,
            compile=True,
            fused_calls=1,
        )


@pytest.mark.filterwarnings("ignore:the model has torch.bfloat16 parameters")
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("variant", ["sam", "asam", "geodesic"])
def test_bfloat16_weights(variant, compile):
    """The compute dtype (float32) differs from the weights': pieces read as one vector (and
    compiled, by the eager passes)."""
    torch.manual_seed(2)
    model = TinyTransformerClassifier(d=8, heads=2, layers=1, classes=3).to(torch.bfloat16)
    x = torch.randn(4, 3, 8, dtype=torch.bfloat16)
    y = torch.randint(0, 3, (4,))
    check(
        copy.deepcopy(model),
        lambda m: nn.functional.cross_entropy(m(x).float(), y),
        rtol=2**-7,
        atol=0.0,
        variant=variant,
        compile=compile,
    )


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    shapes=st.lists(
        st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple), min_size=1, max_size=4
    ),
    floor=st.sampled_from([1e-12, 0.3]),
)
def test_adaptive_list_formulas_match_the_manifold_api(seed, shapes, floor):
    """``whitened_gradients`` and ``add_scaled_rgrad_`` (lists of tensors, any shapes) against
    ``egrad2rgrad`` and ``inner`` of the flattened entries, with some weights below the floor."""
    gen = torch.Generator().manual_seed(seed)
    m = AdaptiveGeometry(floor=floor)
    w = [torch.randn(s, generator=gen, dtype=DT) for s in shapes]
    for t in w:
        t.masked_fill_(torch.rand(t.shape, generator=gen) < 0.2, 0.0)
    d = [torch.randn(s, generator=gen, dtype=DT) for s in shapes]
    c = torch.rand((), generator=gen, dtype=DT) + 0.5
    flat_w, flat_d = torch.cat([t.reshape(-1) for t in w]), torch.cat([t.reshape(-1) for t in d])
    rgrad = m.egrad2rgrad(flat_w, flat_d)
    whitened = m.whitened_gradients(w, d)
    got = sum(float(t.square().sum()) for t in whitened)
    assert got == pytest.approx(float(m.inner(flat_w, rgrad)), rel=1e-13)
    for t, s in zip(whitened, shapes, strict=True):
        assert t.shape == s
    moved = [t.clone() for t in w]
    m.add_scaled_rgrad_(moved, d, c)
    got = torch.cat([t.reshape(-1) for t in moved])
    torch.testing.assert_close(got, flat_w + c * rgrad, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in d]), flat_d, rtol=0, atol=0)
