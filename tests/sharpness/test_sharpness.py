"""Sharpness measures: invariance along orbits, closed forms, the maximiser, model safety."""

from __future__ import annotations

import functools
import itertools
import json
import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import quotientgeo.geometry.perturbation as perturbation_module
import quotientgeo.sharpness.apgd as apgd_module
from quotientgeo.geometry import ParameterGeometry
from quotientgeo.manifolds import (
    AdaptiveGeometry,
    GLQuotient,
    InterpolatedGLQuotient,
    RescaleQuotient,
    ScaleQuotient,
)
from quotientgeo.sharpness import (
    Measure,
    SharpnessResult,
    adaptive_sharpness,
    average_sharpness,
    geodesic_sharpness,
)
from quotientgeo.testing import TinyTransformerClassifier, cross_entropy, moved_along_orbits
from quotientgeo.testing.assertions import (
    SHARPNESS_RTOL,
    assert_same,
    assert_sharpness_invariance,
    snapshot,
)
from quotientgeo.testing.numerics import relative_change

pytestmark = pytest.mark.filterwarnings("ignore:no parameter symmetry detected:UserWarning")

DT = torch.float64
SCALES = (1e-2, 1e-1, 1.0, 10.0, 100.0)


def reparametrise(model, scale, seed=0):
    """Copy of ``model`` with every head's QK and VO pair acted on by ``A = scale·U diag(σ) Vᵀ``
    (condition ≤ 4)."""
    return moved_along_orbits(model, scale=scale, seed=seed)


# ---------------------------------------------------------------------- 1. invariance
Classifier = functools.partial(TinyTransformerClassifier, dropout=0.1)
classification_loss = cross_entropy


@pytest.fixture(scope="module")
def transformer_problem():
    torch.manual_seed(0)
    model = Classifier().to(DT)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(12, 6, 32, generator=gen, dtype=DT), torch.randint(0, 3, (12,), generator=gen))
    ]
    return model, batches


def invariance_check(model, loss_fn, batches, outputs, rho, n_iter):
    assert_sharpness_invariance(
        model, loss_fn, batches, outputs, rho=rho, n_iter=n_iter, scales=SCALES, adaptive_min=0.1
    )


def test_invariance_transformer_encoder(transformer_problem):
    model, batches = transformer_problem
    model.eval()
    invariance_check(model, classification_loss, batches, lambda m: m(batches[0][0]), 0.05, 12)


def test_invariance_bert(tiny_bert):
    model = tiny_bert(DT, initializer_range=0.3)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (6, 8), generator=gen)
    target = torch.randn(6, 16, generator=gen, dtype=DT)

    def loss_fn(m, batch):
        return (m(input_ids=batch).last_hidden_state.mean(1) - target).square().mean()

    invariance_check(model, loss_fn, [ids], lambda m: m(input_ids=ids).last_hidden_state, 0.05, 10)


# ---------------------------------------------------------------------- 3. diagonal networks
class DiagonalNet(nn.Module):
    """``y = X (u ⊙ v)``."""

    def __init__(self, u, v):
        super().__init__()
        self.u, self.v = nn.Parameter(u), nn.Parameter(v)

    def forward(self, X):
        return X @ (self.u * self.v)


@pytest.fixture(scope="module")
def diagonal_problem():
    gen = torch.Generator().manual_seed(0)
    d, N = 6, 20
    X, _ = torch.linalg.qr(torch.randn(N, d, generator=gen, dtype=DT))  # XᵀX = I
    y = torch.randn(N, generator=gen, dtype=DT)
    signs = lambda: torch.randint(0, 2, (d,), generator=gen).to(DT) * 2 - 1  # noqa: E731
    u = signs() * (0.8 + 0.7 * torch.rand(d, generator=gen, dtype=DT))
    v = signs() * (0.8 + 0.7 * torch.rand(d, generator=gen, dtype=DT))
    model = DiagonalNet(u, v)
    geometry = ParameterGeometry(model).add_rescale_pair("u", "v")
    beta0, beta_star = (u * v), X.T @ y
    return model, geometry, [(X, y)], beta0, beta_star


def squared_loss(model, batch):
    X, y = batch
    return (model(X) - y).square().sum()


def test_diagonal_mix_exact_closed_form(diagonal_problem):
    model, geometry, batches, beta0, beta_star = diagonal_problem
    rho = 0.1
    result = geodesic_sharpness(
        model,
        squared_loss,
        batches,
        rho=rho,
        metric="mix",
        perturbation="exact",
        symmetries=geometry,
        n_iter=20,
        progress=False,
    )
    expected = 2 * math.sqrt(2) * rho * float((beta0 - beta_star).norm()) + 2 * rho**2
    assert result.value == pytest.approx(expected, rel=1e-2)
    assert result.perturbation_norms[0] == pytest.approx(rho, rel=1e-6)


def trust_region_max(g, M, radius):
    """``max gᵀb + bᵀ diag(M) b`` over ``||b|| ≤ radius`` via the secular equation.

    Stationarity ``g + 2 M b = 2 λ b`` gives ``b(λ) = g / (2 (λ - M))``; the maximiser has
    ``λ > max(M, 0)`` and ``||b(λ)|| = radius`` (no hard case for generic ``g``).
    """
    lo = max(float(M.max()), 0.0) + 1e-12
    phi = lambda lam: float((g / (2 * (lam - M))).norm()) - radius  # noqa: E731
    hi = lo + 1.0
    while phi(hi) > 0:
        hi *= 2
    lam = brentq(phi, lo, hi, xtol=1e-14)
    b = g / (2 * (lam - M))
    return float(g @ b + b @ (M * b))


def test_diagonal_inv_second_order_model(diagonal_problem):
    model, geometry, batches, beta0, beta_star = diagonal_problem
    rho = 0.02
    r = beta0 * (beta0 - beta_star)
    D = beta0 * (2 * beta0 - beta_star)
    # 4 b·r + 4 bᵀ D b over 2 ||b||² ≤ ρ²
    expected = trust_region_max(4 * r, 4 * D, rho / math.sqrt(2))
    result = geodesic_sharpness(
        model,
        squared_loss,
        batches,
        rho=rho,
        perturbation="exact",
        symmetries=geometry.with_metric("inv"),
        n_iter=20,
        progress=False,
    )
    assert result.value == pytest.approx(expected, rel=5e-2)


def test_a_geometry_is_measured_in_the_metric_it_declares(diagonal_problem):
    """``metric=None`` measures each block as declared; naming another metric for a declared
    geometry is an error, and ``with_metric`` is the way to measure it in another one."""
    model, geometry, batches, *_ = diagonal_problem
    kw = dict(rho=0.02, n_iter=5, progress=False)
    inv = geometry.with_metric("inv")
    assert geometry.metrics == ("mix",) and inv.metrics == ("inv",)
    as_declared = geodesic_sharpness(model, squared_loss, batches, symmetries=inv, **kw)
    named = geodesic_sharpness(model, squared_loss, batches, symmetries=inv, metric="inv", **kw)
    assert as_declared.value == named.value and named.settings["metric"] == "inv"
    mix = geodesic_sharpness(model, squared_loss, batches, symmetries=geometry, **kw)
    assert mix.settings["metric"] == "mix" and mix.value != as_declared.value
    with pytest.raises(ValueError, match=r"metric='inv', but the geometry declares 'mix'"):
        geodesic_sharpness(model, squared_loss, batches, symmetries=geometry, metric="inv", **kw)


# ---------------------------------------------------------------------- 4. adaptive baseline
def mlp(seed=0, dtype=DT):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def mlp_batches(n=2, dtype=DT):
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randn(10, 5, generator=gen, dtype=dtype), torch.randint(0, 3, (10,), generator=gen))
        for _ in range(n)
    ]


def test_adaptive_equals_the_ablation_configuration(transformer_problem):
    model, batches = transformer_problem
    kw = dict(rho=0.05, n_iter=6, restarts=2, seed=7, progress=False)
    a = adaptive_sharpness(model, classification_loss, batches, **kw)
    b = geodesic_sharpness(
        model,
        classification_loss,
        batches,
        symmetries=None,
        perturbation="first_order",
        norm="adaptive",
        **kw,
    )
    assert a.value == b.value and a.worst_losses == b.worst_losses and a.trace == b.trace
    assert a.settings["measure"] == "adaptive"


def test_adaptive_sharpness_definition_on_a_linear_loss():
    """``L(w) = c·w``: the worst case over ``||ξ / |w|||₂ ≤ ρ`` is ``ρ ||c ⊙ |w|||₂``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False).to(DT)
    with torch.no_grad():
        model.weight[0, 2] = 0.0  # a zero weight cannot move (floor 1e-12)
    x = torch.randn(7, 4, dtype=DT)
    c = x.sum(0)
    result = adaptive_sharpness(
        model, lambda m, b: m(b).sum(), [x], rho=0.3, n_iter=5, progress=False
    )
    expected = 0.3 * float((c * model.weight[0].detach().abs()).norm())
    assert result.value == pytest.approx(expected, rel=1e-10)


def test_adaptive_rest_geometry_closed_forms():
    """The adaptive rest's manifold: ball ``||ξ / ŵ||²``, gradient ``∇ ŵ²``, straight lines."""
    w = torch.tensor([0.5, -2.0, 0.0, 3.0], dtype=DT)
    geom = AdaptiveGeometry()
    w_hat = torch.tensor([0.5, 2.0, geom.floor, 3.0], dtype=DT)
    xi = torch.tensor([0.1, 0.2, 1e-13, -0.3], dtype=DT)
    grad = torch.tensor([1.0, -1.0, 2.0, 0.5], dtype=DT)
    torch.testing.assert_close(geom.inner(w, xi), ((xi / w_hat) ** 2).sum())
    torch.testing.assert_close(geom.egrad2rgrad(w, grad), grad * w_hat**2)
    torch.testing.assert_close(geom.retr(w, xi), w + xi)
    torch.testing.assert_close(geom.isotropic(geom.at(w), grad), grad * w_hat)


def _isotropy_cases(metric):
    return [
        (GLQuotient(5, metric), (3, 9, 2)),
        (RescaleQuotient(metric), (2, 2, 4)),
        (ScaleQuotient(2), (3, 4, 2)),
        (ScaleQuotient(1), (3, 4)),
        (AdaptiveGeometry(), (2, 5)),
    ]


@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_random_directions_are_standard_gaussians_of_the_metric(metric):
    """``<T e, T e'>_x = e·e'``: isotropic, hence equivariant in distribution; the closed
    forms and the base class's dense derivation agree on it."""
    gen = torch.Generator().manual_seed(0)
    for manifold, shape in _isotropy_cases(metric):
        for path in (manifold, manifold.generic()):
            pt = path.at(manifold.random(*shape, dtype=DT) + 0.5)
            e1, e2 = (torch.randn(shape, generator=gen, dtype=DT) for _ in range(2))
            inner = path.inner(pt, path.isotropic(pt, e1), path.isotropic(pt, e2))
            want = (e1 * e2).sum(dim=tuple(range(-manifold.ndim, 0)))
            torch.testing.assert_close(inner, want)
            xi = path.random_tangent(pt, generator=gen)
            torch.testing.assert_close(path.proju(pt, xi), xi)  # horizontal


def test_random_directions_isotropic_for_the_interpolated_metric():
    gen = torch.Generator().manual_seed(0)
    manifold = InterpolatedGLQuotient(5, 0.3)
    pt = manifold.at(manifold.random(3, 9, 2, dtype=DT))
    e1, e2 = (torch.randn(3, 9, 2, generator=gen, dtype=DT) for _ in range(2))
    inner = manifold.inner(pt, manifold.isotropic(pt, e1), manifold.isotropic(pt, e2))
    torch.testing.assert_close(inner, (e1 * e2).sum(dim=(-1, -2)))


def test_metric_spectrum_endpoints_and_invariance(transformer_problem):
    """``metric=s``: ``(1-s)·inv + s·mix``; s = 0, 1 give inv, mix; any s is orbit-invariant."""
    model, batches = transformer_problem
    model.eval()

    def value(m, metric):
        # one map for every metric: the default's would differ (exact for inv, not for s = 0)
        kw = dict(rho=0.05, n_iter=6, progress=False, perturbation="second_order")
        return geodesic_sharpness(m, classification_loss, batches, metric=metric, **kw).value

    for s, name in ((0.0, "inv"), (1.0, "mix")):
        assert relative_change(value(model, s), value(model, name)) < 1e-9
    reference = value(model, 0.5)
    moved = reparametrise(model, 10.0, seed=3)
    assert relative_change(value(moved, 0.5), reference) <= SHARPNESS_RTOL
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        value(model, 1.5)


def test_maximiser_never_below_a_random_direction_it_saw():
    model = mlp()
    batches = mlp_batches()
    result = geodesic_sharpness(
        model, classification_loss, batches, rho=0.5, n_iter=8, restarts=4, seed=3, progress=False
    )
    for b, restarts in enumerate(result.trace):
        seen = max(t[-1] for t in restarts)  # traces are best-so-far, so [-1] is each run's max
        random_starts = [t[0] for t in restarts[1:]]
        assert result.worst_losses[b] >= max(random_starts)
        assert result.worst_losses[b] == max(seen, result.base_losses[b])
        for t in restarts:
            assert all(x <= y for x, y in itertools.pairwise(t))
    avg = average_sharpness(
        model, classification_loss, batches, rho=0.5, n_samples=16, seed=3, progress=False
    )
    for b in range(len(batches)):
        assert result.worst_losses[b] >= avg.worst_losses[b]


def _reference_auto_pgd(f, M, rho, n_iter, start):
    """Auto-PGD as the reference code writes it: explicit vectors, and the gradient at the best
    point kept for the restarts. ``f`` maps a vector to a 0-dim tensor; the ball's metric is
    the SPD matrix ``M``."""

    def grad(x):
        x = x.detach().requires_grad_(True)
        value = f(x)
        return value.detach(), torch.linalg.solve(M, torch.autograd.grad(value, x)[0])

    def into_ball(v):
        return v * (rho / (v @ M @ v).sqrt()).clamp(max=1.0)

    marks = set(apgd_module.checkpoints(n_iter))
    c = c_prev = start
    eta = prev_eta = 2 * rho
    prev_cp, n_updates, losses = 0, 0, []
    best = best_c = best_g = prev_best = None
    for k in range(n_iter + 1):
        loss, g = grad(c)
        losses.append(float(loss))
        if k == 0:
            best, best_c, best_g, prev_best = loss, c, g, float(loss)
        elif loss > best:
            n_updates += 1
            best, best_c, best_g = loss, c, g
        if k == n_iter:
            break
        if k in marks:
            stalled = n_updates < 0.75 * (k - prev_cp)
            frozen = prev_eta == eta and prev_best == float(best)
            prev_eta, prev_best, prev_cp, n_updates = eta, float(best), k, 0
            if stalled or frozen:
                eta *= 0.5
                c, c_prev, g = best_c, best_c, best_g
        z = into_ball(c + eta * g / (g @ M @ g).sqrt())
        new = z if k == 0 else into_ball(c + 0.75 * (z - c) + 0.25 * (c - c_prev))
        c_prev, c = c, new
    return float(best), best_c, losses


class _VectorIterates:
    """:class:`~quotientgeo.sharpness.apgd.Iterates` as plain vectors in the metric ``M``; the
    gradient at an earlier best point is evaluated again at a restart."""

    def __init__(self, f, M, start):
        self.f, self.M = f, M
        self.cur, self.prev, self.best = start, start, start
        self.euclidean = self.g = self.pending = None
        self.evaluations = self.backward_passes = 0

    def value(self, k, grad):
        self.evaluations += 1
        x = self.cur.detach().requires_grad_(grad)
        with torch.enable_grad():
            value = self.f(x)
        self.pending = (value, x) if grad else None
        return value.detach()

    def gradient(self):
        self.backward_passes += 1
        value, x = self.pending
        self.euclidean = torch.autograd.grad(value, x)[0]

    def gram(self):
        self.g = torch.linalg.solve(self.M, self.euclidean)
        V = torch.stack([self.cur, self.prev, self.g])
        return V @ self.M @ V.T

    def keep_best(self, keep):
        assert isinstance(keep, bool)  # read on the host, once per iteration
        if keep:
            self.best = self.cur

    def advance(self, c):
        self.prev, self.cur = self.cur, c[0] * self.cur + c[1] * self.prev + c[2] * self.g

    def restart(self, best_is_current, k):
        self.cur = self.prev = self.best
        if not best_is_current:
            self.value(k, True)
        self.gradient()


@given(seed=st.integers(0, 10_000), n=st.integers(2, 7), n_iter=st.integers(1, 40))
@settings(max_examples=30, deadline=None)
def test_auto_pgd_on_gram_matrices_follows_the_reference(seed, n, n_iter):
    """Auto-PGD on the Gram matrix of (current, previous, gradient), with the gradient at an
    earlier best point evaluated again at a restart, follows the reference implementation
    (explicit vectors, the best point's gradient kept) iterate for iterate, in a random metric
    and on a random non-concave function."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(n, n, generator=g, dtype=DT)
    M = A @ A.T + n * torch.eye(n, dtype=DT)
    B, a = torch.randn(n, n, generator=g, dtype=DT), torch.randn(n, generator=g, dtype=DT)

    def f(x):
        return torch.sin(3 * a @ x) + x @ B @ x - (x**4).sum()

    rho = 0.5
    start = torch.zeros(n, dtype=DT)
    best, best_c, losses = _reference_auto_pgd(f, M, rho, n_iter, start)
    iterates = _VectorIterates(f, M, start)
    got, got_losses = apgd_module.auto_pgd(iterates, rho=rho, n_iter=n_iter)
    torch.testing.assert_close(got_losses, torch.tensor(losses, dtype=DT), rtol=1e-12, atol=1e-12)
    assert float(got) == pytest.approx(best, rel=1e-12, abs=1e-12)
    # the best point is the one of the best value (at a flat maximum, iterates 1e-9 apart tie
    # to rounding, so the value, not the argmax, is compared)
    assert float(f(iterates.best)) == pytest.approx(float(f(best_c)), rel=1e-12, abs=1e-12)
    assert float(iterates.best @ M @ iterates.best) <= rho**2 * (1 + 1e-12)
    # one forward pass per iteration and one per restart from an earlier best point; one
    # backward pass per step (the last evaluation has none)
    restarts = iterates.evaluations - (n_iter + 1)
    assert 0 <= restarts <= len(apgd_module.checkpoints(n_iter))
    assert iterates.backward_passes == n_iter


@pytest.mark.parametrize(
    "measure",
    [
        Measure.geodesic(0.05, metric="mix", n_iter=8),
        Measure.geodesic(0.05, metric="inv", perturbation="exact", n_iter=8),
        Measure.geodesic(0.05, metric="mix", norm="adaptive", n_iter=8, restarts=2),
        Measure.average(0.05, metric="inv", n_samples=4),
    ],
    ids=["mix", "inv exact", "adaptive norm, restarts", "average"],
)
@pytest.mark.parametrize("small", [5, 10**9], ids=["sliced views", "shared pieces"])
def test_values_do_not_depend_on_how_the_blocks_are_chunked(
    transformer_problem, monkeypatch, measure, small
):
    """The geometry works on chunks of blocks and pieces of parameters to bound its memory:
    one block per chunk and 7-entry pieces (slices of every parameter of ``small`` entries or
    more, the smaller ones sharing pieces) give the values of the whole kinds at once (each
    head's arithmetic is the same; only the order of the sums changes)."""
    model, batches = transformer_problem
    whole = measure.evaluate(model, classification_loss, batches, progress=False)
    monkeypatch.setattr(perturbation_module, "CHUNK_FRACTION", 0.0)
    monkeypatch.setattr(perturbation_module, "MIN_CHUNK_BYTES", 1)
    monkeypatch.setattr(perturbation_module, "PIECE", 7)
    monkeypatch.setattr(perturbation_module, "SMALL", small)
    chunked = measure.evaluate(model, classification_loss, batches, progress=False)
    assert chunked.per_batch == pytest.approx(whole.per_batch, rel=1e-12, abs=1e-15)
    flat = [v for batch in whole.trace for run in batch for v in run]
    assert [v for batch in chunked.trace for run in batch for v in run] == pytest.approx(
        flat, rel=1e-12, abs=1e-15
    )


def test_checkpoints_match_auto_pgd():
    assert apgd_module.checkpoints(100) == [
        22,
        41,
        58,
        70,
        80,
        87,
        93,
        99,
    ]  # as ceil(p_j n) in the reference
    assert apgd_module.checkpoints(1) == []


# ---------------------------------------------------------------------- 5. model safety
class WithState(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.ReLU(), nn.Linear(8, 3)
        )
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x):
        a = self.attn(x[:, None, :4], x[:, None, :4], x[:, None, :4])[0][:, 0]
        return self.net(x) + a.sum(-1, keepdim=True)


@pytest.fixture
def stateful_model():
    torch.manual_seed(0)
    model = WithState().to(DT)
    model.train()
    model.net[2].eval()  # mixed modes must come back as they were
    x = torch.randn(6, 5, dtype=DT)
    classification_loss(model, (x, torch.zeros(6, dtype=torch.long))).backward()  # .grad set
    model.net[0].bias.grad = None
    return model


@pytest.mark.parametrize("failure", [None, RuntimeError, KeyboardInterrupt])
def test_model_restored_bit_exactly(stateful_model, failure):
    model = stateful_model
    before = snapshot(model)
    calls = {"n": 0}
    batches = mlp_batches()

    def loss_fn(m, batch):
        calls["n"] += 1
        if failure is not None and calls["n"] == 5:
            raise failure("injected")
        return classification_loss(m, batch)

    if failure is None:
        geodesic_sharpness(model, loss_fn, batches, rho=0.1, n_iter=4, progress=False)
        average_sharpness(model, loss_fn, batches, rho=0.1, n_samples=3, progress=False)
    else:
        with pytest.raises(failure, match="injected"):
            geodesic_sharpness(model, loss_fn, batches, rho=0.1, n_iter=4, progress=False)
    assert_same(before, snapshot(model))


@pytest.mark.parametrize("reverse", [False, True])
def test_the_starting_weights_are_copied_in_order_into_one_allocation_per_dtype(reverse):
    """``model_state_preserved`` yields the parameters' copies (equal values, no memory shared
    with them) in the order given, one after the other in one allocation per dtype, so that a
    run of them reads as one view; the model comes back bit-exactly."""
    from quotientgeo.sharpness.state import model_state_preserved

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(DT)
    model[1].to(torch.float32)
    params = dict(model.named_parameters())
    if reverse:
        params = dict(reversed(params.items()))
    before = snapshot(model)
    with model_state_preserved(model, params) as x0:
        assert list(x0) == list(params)
        for dtype in (DT, torch.float32):
            copies = [t for t in x0.values() if t.dtype == dtype]
            assert len({t.untyped_storage().data_ptr() for t in copies}) == 1
            for a, b in itertools.pairwise(copies):
                assert b.storage_offset() == a.storage_offset() + a.numel()
        for name, t in x0.items():
            assert torch.equal(t, params[name]) and t.is_contiguous()
            assert t.untyped_storage().data_ptr() != params[name].untyped_storage().data_ptr()
        with torch.no_grad():
            for p in params.values():
                p.add_(1.0)
    assert_same(before, snapshot(model))


# ---------------------------------------------------------------------- bad input
def test_bad_rho_and_sizes():
    model, batches = mlp(), mlp_batches()
    for rho in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="rho"):
            adaptive_sharpness(model, classification_loss, batches, rho=rho, progress=False)
    with pytest.raises(ValueError, match="n_iter"):
        adaptive_sharpness(model, classification_loss, batches, rho=0.1, n_iter=0, progress=False)
    with pytest.raises(ValueError, match="restarts"):
        adaptive_sharpness(model, classification_loss, batches, rho=0.1, restarts=0, progress=False)
    with pytest.raises(ValueError, match="metric must be one of"):
        geodesic_sharpness(
            model, classification_loss, batches, rho=0.1, metric="euclid", progress=False
        )
    with pytest.raises(TypeError, match="symmetries"):
        geodesic_sharpness(
            model, classification_loss, batches, rho=0.1, symmetries="yes", progress=False
        )
    with pytest.raises(ValueError, match="another model"):
        geodesic_sharpness(
            model,
            classification_loss,
            batches,
            rho=0.1,
            symmetries=ParameterGeometry(mlp()),
            progress=False,
        )


@pytest.mark.parametrize(
    "rho", [np.float32(0.1), np.float64(0.1), torch.tensor(0.1), torch.tensor(0.1, dtype=DT)]
)
def test_numpy_and_tensor_scalars_are_accepted(rho):
    """numbers.Real / numbers.Integral (numpy scalars) and 0-dim tensors mean their value."""
    model, batches = mlp(), mlp_batches(1)
    want = float(rho)
    for measure, size in ((geodesic_sharpness, "n_iter"), (average_sharpness, "n_samples")):
        kw = {size: np.int64(3), "seed": np.int64(5), "progress": False}
        if measure is geodesic_sharpness:
            kw["restarts"] = np.int64(2)
        got = measure(model, classification_loss, batches, rho=rho, **kw)
        plain = {k: int(v) if isinstance(v, np.integer) else v for k, v in kw.items()}
        ref = measure(model, classification_loss, batches, rho=want, **plain)
        assert got.value == ref.value and got.trace == ref.trace
        settings = got.settings
        assert type(settings["rho"]) is float and settings["rho"] == want
        assert type(settings["seed"]) is int and type(settings[size]) is int
        json.dumps(got.to_dict())  # numpy scalars would not serialise
    r = adaptive_sharpness(
        model, classification_loss, batches, rho=Fraction(1, 10), n_iter=2, progress=False
    )
    assert r.settings["rho"] == 0.1 and r.settings["restarts"] == 1
    kw = dict(rho=0.1, n_iter=2, progress=False)
    r = adaptive_sharpness(model, classification_loss, batches, seed=torch.tensor(5), **kw)
    assert r.to_dict() | {"wall_time": 0} == (
        adaptive_sharpness(model, classification_loss, batches, seed=5, **kw).to_dict()
        | {"wall_time": 0}
    )


def test_numeric_metric_accepts_numpy_and_tensor_scalars(transformer_problem):
    model, batches = transformer_problem
    kw = dict(rho=0.05, n_iter=3, progress=False)
    ref = geodesic_sharpness(model, classification_loss, batches, metric=0.5, **kw)
    for s in (np.float32(0.5), torch.tensor(0.5)):
        got = geodesic_sharpness(model, classification_loss, batches, metric=s, **kw)
        assert got.value == ref.value and type(got.settings["metric"]) is float
    with pytest.raises(ValueError, match="must lie in"):
        geodesic_sharpness(model, classification_loss, batches, metric=np.float64(1.5), **kw)
    with pytest.raises(ValueError, match="metric must be one of"):
        geodesic_sharpness(model, classification_loss, batches, metric=np.bool_(True), **kw)


def test_bad_scalar_arguments_are_rejected_clearly():
    model, batches = mlp(), mlp_batches(1)

    def run(**kw):
        kw.setdefault("rho", 0.1)
        geodesic_sharpness(model, classification_loss, batches, n_iter=2, progress=False, **kw)

    for rho in (np.float32("nan"), torch.tensor(float("inf")), np.float64(-1.0), torch.tensor(0)):
        with pytest.raises(ValueError, match=r"rho must be (> 0|a positive finite number)"):
            run(rho=rho)
    for rho in (True, np.bool_(True), torch.tensor(True), "0.1", torch.tensor([0.1, 0.2]), 1j):
        with pytest.raises(ValueError, match="rho must be a positive finite number"):
            run(rho=rho)
    for bad in (np.float64(3.0), 3.0, np.int64(0), True, torch.tensor(3.0), torch.tensor([3])):
        with pytest.raises(ValueError, match="n_iter must be a positive integer"):
            geodesic_sharpness(
                model, classification_loss, batches, rho=0.1, n_iter=bad, progress=False
            )
        with pytest.raises(ValueError, match="restarts must be a positive integer"):
            run(restarts=bad)
    for seed in (1.5, np.float32(1.0), False, "1"):
        with pytest.raises(ValueError, match="seed must be an integer"):
            run(seed=seed)
    with pytest.raises(ValueError, match="n_samples must be a positive integer"):
        average_sharpness(
            model, classification_loss, batches, rho=0.1, n_samples=np.int32(-1), progress=False
        )


class _Stream(IterableDataset):
    """An iterable dataset without ``__len__``: ``len(DataLoader(_Stream(...)))`` raises."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


@pytest.mark.parametrize("progress", [False, True])
def test_dataloader_over_an_iterable_dataset(progress):
    model, batches = mlp(), mlp_batches(2)
    loader = DataLoader(_Stream(batches), batch_size=None)
    with pytest.raises(TypeError):
        len(loader)  # the case: DataLoader has __len__, and it raises
    kw = dict(rho=0.1, progress=progress)
    for measure, size in (
        (geodesic_sharpness, "n_iter"),
        (adaptive_sharpness, "n_iter"),
        (average_sharpness, "n_samples"),
    ):
        got = measure(model, classification_loss, loader, **kw, **{size: 3})
        ref = measure(model, classification_loss, batches, **kw, **{size: 3})
        assert len(got.per_batch) == 2 and got.settings["n_batches"] == 2
        assert got.per_batch == ref.per_batch and got.trace == ref.trace


def test_empty_batches():
    for measure in (adaptive_sharpness, average_sharpness):
        with pytest.raises(ValueError, match="batches is empty"):
            measure(mlp(), classification_loss, [], rho=0.1, progress=False)
    with pytest.raises(ValueError, match="batches is empty"):
        adaptive_sharpness(mlp(), classification_loss, iter(()), rho=0.1, progress=False)


def test_non_scalar_loss_names_batch_and_iteration():
    model = mlp()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"shape \(10, 3\) \(batch 0, iteration 0 \(restart 0\)\)"):
        adaptive_sharpness(
            model, lambda m, b: m(b[0]).square(), mlp_batches(), rho=0.1, progress=False
        )
    assert_same(before, snapshot(model))


def test_non_finite_loss_names_batch_and_iteration():
    model = mlp()
    before = snapshot(model)
    calls = {"n": 0}

    batches = mlp_batches()

    def loss_fn(m, batch):
        calls["n"] += batch is batches[1]
        loss = classification_loss(m, batch)
        # batch 1, iteration 1 (before the first checkpoint, so before any restart)
        return loss * float("nan") if calls["n"] == 2 else loss

    with pytest.raises(ValueError, match=r"non-finite loss \(nan\) on batch 1 at iteration 1"):
        adaptive_sharpness(model, loss_fn, batches, rho=0.1, n_iter=9, progress=False)
    assert_same(before, snapshot(model))


def test_no_symmetry_warns_and_falls_back_to_adaptive():
    model, batches = mlp(), mlp_batches(1)
    with pytest.warns(UserWarning, match="no parameter symmetry detected"):
        r = geodesic_sharpness(
            model, classification_loss, batches, rho=0.1, n_iter=5, progress=False
        )
    a = adaptive_sharpness(model, classification_loss, batches, rho=0.1, n_iter=5, progress=False)
    assert r.value == a.value  # without blocks the geometry is the adaptive one


def test_half_precision_computes_in_float32():
    model = Classifier(d=8, heads=2, layers=1).to(torch.bfloat16)
    x = torch.randn(4, 3, 8, dtype=torch.bfloat16)
    batches = [(x, torch.tensor([0, 1, 2, 0]))]
    with pytest.warns(UserWarning, match="computed in float32"):
        r = geodesic_sharpness(
            model, classification_loss, batches, rho=0.05, n_iter=3, progress=False
        )
    assert math.isfinite(r.value) and r.settings["dtype"] == "torch.float32"
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


# ---------------------------------------------------------------------- ablations and results
def test_every_ablation_combination_runs():
    torch.manual_seed(0)
    model = Classifier(d=8, heads=2, layers=1).to(DT)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 8, generator=gen, dtype=DT), torch.tensor([0, 1, 2, 0]))]
    grid = itertools.product(
        ("mix", "inv"),
        ("second_order", "first_order", "exact"),
        ("riemannian", "adaptive"),
        ("auto", None),
    )
    for metric, perturbation, norm, symmetries in grid:
        kw = dict(
            rho=0.05,
            metric=metric,
            perturbation=perturbation,
            norm=norm,
            symmetries=symmetries,
            progress=False,
        )
        worst = geodesic_sharpness(model, classification_loss, batches, n_iter=2, **kw)
        average = average_sharpness(model, classification_loss, batches, n_samples=2, **kw)
        assert math.isfinite(worst.value) and math.isfinite(average.value)
        assert worst.value >= 0
        assert worst.perturbation_norms[0] <= 0.05 * (1 + 1e-9)


def test_result_to_dict_is_json():
    result = geodesic_sharpness(
        Classifier(d=8, heads=2, layers=1).to(DT),
        classification_loss,
        [(torch.randn(4, 3, 8, dtype=DT), torch.tensor([0, 1, 2, 0]))],
        rho=0.05,
        n_iter=3,
        progress=False,
    )
    assert isinstance(result, SharpnessResult)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["value"] == result.value and data["settings"]["metric"] == "mix"
    assert len(data["trace"][0][0]) == 4  # the base point and 3 iterates
    assert "GLQuotient(n=9, metric='mix', eps=0.0)" in data["settings"]["geometry"]
    assert "value=" in repr(result)


def test_progress_bar_is_silent_when_disabled(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adaptive_sharpness(
            mlp(), classification_loss, mlp_batches(1), rho=0.1, n_iter=2, progress=False
        )
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
