"""Blocks that share parameters form one quotient by the product of their groups.

A 3-layer ReLU MLP with biases: the hidden units of layer 1 are re-scaled by one group
(``W1`` rows, ``b1``, ``W2`` columns) and those of layer 2 by another (``W2`` rows, ``b2``,
``W3`` columns); both act on ``W2``. Declared with ``product=True`` they form one
:class:`ProductQuotient`:

- the model's output is unchanged along each group and along both, and changed by negative
  scales, which lie outside the groups;
- the product's projection is horizontal and idempotent, every part's vertical vectors
  project to 0, the metric is invariant under the product action, and the closed forms agree
  with the generic (autodiff) path;
- it equals a hand-built single block on the whole union (same group, same metric):
  projections, gradients, norms and geodesic sharpness;
- geodesic sharpness measured on it is invariant along the product orbits, while a geometry
  that declares only one of the groups is not;
- gather/scatter reproduce every parameter with products beside ordinary blocks, partial
  coverage and the batched scatter;
- non-commuting actions, actions that do not preserve the metric, a group declared twice,
  zero entries and parts without a finite action are refused with a clear ``ValueError``
  that leaves the geometry unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from quotientgeo import (
    GLQuotient,
    ParameterGeometry,
    ProductQuotient,
    QuotientManifold,
    ScaleQuotient,
    Source,
    geodesic_sharpness,
)
from quotientgeo.testing import moved_along_orbits
from quotientgeo.testing.assertions import assert_parts_read_and_write_like_the_geometry

DT = torch.float64
RTOL = 1e-10
SETTINGS = settings(max_examples=10, deadline=None, derandomize=True)
pytestmark = pytest.mark.filterwarnings("ignore:Attempted to insert a get_attr")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "defining-a-symmetry.md"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


class ReLUUnits(QuotientManifold):
    """Hidden units as columns of ``x = [incoming; outgoing]``, ``n_in`` incoming rows: action
    ``(in / a, out · a)``, ``a > 0``; vertical ``ω (-in, out)``; column-norm metric."""

    def __init__(self, n_in: int):
        super().__init__()
        self.n_in = n_in

    def lie_shape(self, p):
        return (p.x.shape[-1],)

    def vertical(self, p, omega):
        w_in, w_out = p.x[..., : self.n_in, :], p.x[..., self.n_in :, :]
        return omega[..., None, :] * torch.cat([-w_in, w_out], dim=-2)

    def metric(self, p, u):
        w_in, w_out = p.x[..., : self.n_in, :], p.x[..., self.n_in :, :]
        sq = lambda t: t.square().sum(-2, keepdim=True).expand_as(t)  # noqa: E731
        return u / torch.cat([sq(w_in), sq(w_out)], dim=-2)

    def act(self, x, a):
        a = a[..., None, :]
        return torch.cat([x[..., : self.n_in, :] / a, x[..., self.n_in :, :] * a], dim=-2)


class MLP(nn.Module):
    def __init__(self, d_in=4, h1=6, h2=5, d_out=3):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d_in, h1), nn.Linear(h1, h2), nn.Linear(h2, d_out)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def layer1(geometry, per_head=False, **kw):
    h1 = geometry.model.fc1.out_features
    d_in = geometry.model.fc1.in_features
    units = (["fc1.weight", "fc1.bias"], Source("fc2.weight", axis=1))
    return geometry.add(
        ReLUUnits(d_in + 1), *units, heads=h1 if per_head else 1, label="layer 1", **kw
    )


def layer2(geometry, per_head=False, **kw):
    h2 = geometry.model.fc2.out_features
    h1 = geometry.model.fc2.in_features
    units = (["fc2.weight", "fc2.bias"], Source("fc3.weight", axis=1))
    return geometry.add(
        ReLUUnits(h1 + 1), *units, heads=h2 if per_head else 1, label="layer 2", **kw
    )


def chain(model, per_head=False):
    """Both groups: layer 2 declared with ``product=True`` joins layer 1."""
    geometry = layer1(ParameterGeometry(model), per_head)
    return layer2(geometry, per_head, product=True)


def only_layer1(model):
    return layer1(ParameterGeometry(model))


def only_layer2(model):
    return layer2(ParameterGeometry(model))


class HandChain(QuotientManifold):
    """The union ``[vec W1; b1; vec W2; b2; vec W3]`` (one column) by hand: the group
    ``(R>0)^{h1} × (R>0)^{h2}``, ``(a, b)`` acting by ``W1 / a, b1 / a, W2 ⊙ a / b, b2 / b,
    W3 ⊙ b``, and the element-wise metric ``Σ η²/x²``: the primitives, ``M⁻¹`` and the action;
    projection, Christoffel symbols (autodiff) and geodesics (RK4) are the base class's."""

    def __init__(self, d_in, h1, h2, d_out, **kw):
        super().__init__(**kw)
        self.dims = d_in, h1, h2, d_out

    def split(self, x):
        d_in, h1, h2, d_out = self.dims
        sizes = [h1 * d_in, h1, h2 * h1, h2, d_out * h2]
        w1, b1, w2, b2, w3 = torch.split(x[..., 0], sizes, dim=-1)
        lead = x.shape[:-2]
        return (
            w1.reshape(*lead, h1, d_in),
            b1,
            w2.reshape(*lead, h2, h1),
            b2,
            w3.reshape(*lead, d_out, h2),
        )

    @staticmethod
    def join(w1, b1, w2, b2, w3):
        parts = [w1.flatten(-2), b1, w2.flatten(-2), b2, w3.flatten(-2)]
        lead = torch.broadcast_shapes(*(t.shape[:-1] for t in parts))
        return torch.cat([t.expand(*lead, t.shape[-1]) for t in parts], dim=-1)[..., None]

    def lie_shape(self, p):
        return (self.dims[1] + self.dims[2],)

    def vertical(self, p, omega):
        h1 = self.dims[1]
        a, b = omega[..., :h1], omega[..., h1:]
        w1, b1, w2, b2, w3 = self.split(p.x)
        return self.join(
            -a[..., :, None] * w1,
            -a * b1,
            (a[..., None, :] - b[..., :, None]) * w2,
            -b * b2,
            b[..., None, :] * w3,
        )

    def metric(self, p, u):
        return u / p.x.square()

    def metric_inv(self, p, v):
        return v * p.x.square()

    def act(self, x, g):
        h1 = self.dims[1]
        a, b = g[..., :h1], g[..., h1:]
        w1, b1, w2, b2, w3 = self.split(x)
        return self.join(
            w1 / a[..., :, None],
            b1 / a,
            w2 * a[..., None, :] / b[..., :, None],
            b2 / b,
            w3 * b[..., None, :],
        )


def hand(model):
    d_in, h1 = model.fc1.in_features, model.fc1.out_features
    h2, d_out = model.fc2.out_features, model.fc3.out_features
    return ParameterGeometry(model).add(
        HandChain(d_in, h1, h2, d_out, exp_steps=32),
        Source("fc1.weight", axis=1, view=(h1 * d_in, 1)),
        Source("fc1.bias", axis=1),
        Source("fc2.weight", axis=1, view=(h2 * h1, 1)),
        Source("fc2.bias", axis=1),
        Source("fc3.weight", axis=1, view=(d_out * h2, 1)),
        label="hand",
    )


def make_model(seed=0, **dims):
    torch.manual_seed(seed)
    return MLP(**dims).to(DT)


def inputs(seed=1, d_in=4, n=32, d_out=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=gen, dtype=DT), torch.randn(
        n, d_out, generator=gen, dtype=DT
    )


def mse(model, batch):
    x, y = batch
    return (model(x) - y).square().mean()


# ---------------------------------------------------------------------- the model
@pytest.mark.parametrize("per_head", [False, True])
def test_the_output_is_invariant_along_each_group_and_both(per_head):
    model = make_model()
    x, _ = inputs()
    geometries = {
        "layer 1": only_layer1,
        "layer 2": only_layer2,
        "both": lambda m: chain(m, per_head),
    }
    for name, symmetries in geometries.items():
        for seed, scale in enumerate((0.2, 1.0, 5.0)):
            moved = moved_along_orbits(model, scale=scale, seed=seed, symmetries=symmetries)
            torch.testing.assert_close(moved(x), model(x), rtol=1e-12, atol=1e-13)
            changed = {
                n
                for n, p in moved.named_parameters()
                if not torch.equal(p, dict(model.named_parameters())[n])
            }
            expected = {
                "layer 1": {"fc1.weight", "fc1.bias", "fc2.weight"},
                "layer 2": {"fc2.weight", "fc2.bias", "fc3.weight"},
                "both": {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight"},
            }[name]
            assert changed == expected, (name, changed)
        # negative scales are outside the groups: the function changes
        outside = moved_along_orbits(model, scale=-1.0, symmetries=symmetries)
        assert (outside(x) - model(x)).abs().max() > 1e-3, name


def test_the_product_action_moves_along_one_group_when_the_other_is_the_identity():
    model = make_model()
    geometry, single = chain(model), only_layer1(model)
    m, s = geometry.manifolds()[0], single.manifolds()[0]
    (x,), _ = geometry.gather()
    (x1,), _ = single.gather()
    a = s.random_group(x1, generator=torch.Generator().manual_seed(3), scale=2.0)
    ones = torch.ones(1, model.fc2.out_features, dtype=DT)
    by_product = geometry.scatter([m.act(x, (a, ones))])
    by_part = single.scatter([s.act(x1, a)])
    assert by_product.keys() == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight"}
    for name, value in by_product.items():
        expected = by_part.get(name, dict(model.named_parameters())[name])
        torch.testing.assert_close(value, expected, rtol=1e-14, atol=0)


# ---------------------------------------------------------------------- the manifold
@st.composite
def product_cases(draw):
    dims = dict(
        d_in=draw(st.integers(1, 4)),
        h1=draw(st.integers(1, 5)),
        h2=draw(st.integers(1, 5)),
        d_out=draw(st.integers(1, 3)),
    )
    per_head = draw(st.booleans())
    seed = draw(st.integers(0, 2**31))
    model = make_model(seed, **dims)
    geometry = chain(model, per_head)
    (x,), _ = geometry.gather()
    gen = torch.Generator().manual_seed(seed)
    u, v = (torch.randn(x.shape, generator=gen, dtype=DT) for _ in range(2))
    return geometry, x, u, v, gen


@SETTINGS
@given(product_cases())
def test_projection_is_horizontal_and_idempotent(case):
    geometry, x, u, _, gen = case
    m = geometry.manifolds()[0]
    assert isinstance(m, ProductQuotient) and len(geometry.kinds) == 1
    p = m.at(x)
    k = m.lie_shape(p)[0]
    assert k == geometry.model.fc1.out_features + geometry.model.fc2.out_features
    hor = m.proju(p, u)
    assert rel(m.proju(p, hor), hor) < RTOL
    # M-orthogonal to every vertical vector: <hor, V e_i> = 0 for the basis of the algebra
    basis = torch.eye(k, dtype=DT).unsqueeze(1)  # (k, 1, k)
    vertical = torch.stack([m.vertical(p, w) for w in basis])
    scale = m.norm(p, hor) * m.norm(p, vertical).max()
    assert (m.inner(p, hor.expand_as(vertical), vertical).abs() <= 1e-12 * scale).all()
    # each part's own vertical vectors, embedded in the union, project to 0
    for j, (part, _) in enumerate(m.parts):
        q = part.at(m.part(x, j))
        omega = torch.randn(
            *q.x.shape[: q.x.dim() - 2], *part.lie_shape(q), generator=gen, dtype=DT
        )
        v_j = m.embed(part.vertical(q, omega), j)
        assert m.norm(p, v_j) > 0
        assert (m.norm(p, m.proju(p, v_j)) <= 1e-12 * m.norm(p, v_j)).all()
    # the iterative path (conjugate gradients on the normal equations) gives the same projection
    iterative = ProductQuotient(m.parts, size=m.size, labels=m.labels, dense_max=0)
    assert rel(iterative.proju(x, u), hor) < 1e-10
    # the Riemannian gradient is horizontal, and M-dual to the Euclidean gradient on it
    grad = m.egrad2rgrad(p, u)
    assert rel(m.proju(p, grad), grad) < RTOL
    torch.testing.assert_close(m.inner(p, grad, hor), (u * hor).sum(-1), rtol=1e-10, atol=0)


@SETTINGS
@given(product_cases())
def test_metric_and_projection_are_invariant_under_the_product_action(case):
    geometry, x, u, v, gen = case
    m = geometry.manifolds()[0]
    g = m.random_group(x, generator=gen, scale=1.5)
    y = m.act(x, g)
    gu, gv = m.push(x, u, g), m.push(x, v, g)
    torch.testing.assert_close(m.inner(y, gu, gv), m.inner(x, u, v), rtol=1e-10, atol=0)
    # the action maps horizontal vectors to horizontal vectors: push ∘ proj = proj ∘ push
    assert rel(m.push(x, m.proju(x, u), g), m.proju(y, gu)) < 1e-9
    # the action's derivative along exp(t ω) is the vertical vector V ω (central difference)
    t = 1e-5
    omega = [s.log() for s in m.random_group(x, generator=gen)]
    flat = torch.cat([w.flatten(1) for w in omega], dim=-1)
    ahead, behind = (m.act(x, tuple(torch.exp(s * w) for w in omega)) for s in (t, -t))
    assert rel((ahead - behind) / (2 * t), m.vertical(m.at(x), flat)) < 1e-8


@SETTINGS
@given(product_cases())
def test_closed_forms_match_the_generic_path(case):
    geometry, x, u, v, _ = case
    m = geometry.manifolds()[0]
    p = m.at(x)
    # the generic path with the closed-form M⁻¹: Γ and expmap2 by autodiff of the metric,
    # the isotropic map from the dense Cholesky factor of M
    generic = m.generic(metric_inv=True)
    torch.testing.assert_close(m.metric(p, m.metric_inv(p, u)), u, rtol=1e-14, atol=0)
    assert rel(m.christoffel(x, u, v), generic.christoffel(x, u, v)) < RTOL
    assert rel(m.christoffel(x, u), generic.christoffel(x, u)) < RTOL
    assert rel(m.isotropic(p, u), generic.isotropic(generic.at(x), u)) < RTOL
    # ‖hor‖_x = 0.3, so |u_e / x_e| ≤ 0.3 on every entry: a mild geodesic
    hor = 0.3 * m.proju(p, u) / m.norm(p, m.proju(p, u), keepdim=True)
    assert rel(m.expmap2(x, hor), generic.expmap2(x, hor)) < RTOL
    # exact geodesic against RK4 on the autodiff Christoffel symbols: 20 steps leave ~1e-11
    # (fourth order: 10 steps leave ~1e-10)
    end, velocity = m.geodesic(x, hor)
    g_end, g_velocity = generic.geodesic(x, hor, steps=20)
    assert rel(end - x, g_end - x) < 1e-9
    assert rel(velocity, g_velocity) < 1e-9
    torch.testing.assert_close(m.expmap(x, hor), end, rtol=0, atol=0)
    # a horizontal geodesic stays horizontal (the group acts by isometries)
    assert rel(m.proju(end, velocity), velocity) < 1e-9


def test_a_product_checks_its_parts():
    units = ReLUUnits(1)
    with pytest.raises(ValueError, match="part 0: a part must read every position at most once"):
        ProductQuotient([(units, torch.tensor([[[0], [0]]]))])
    with pytest.raises(ValueError, match="1 of the 3 entries belong to no part"):
        ProductQuotient([(units, torch.tensor([[[0], [1]]]))], size=3)
    with pytest.raises(TypeError, match="part 0: the index must be an integer tensor"):
        ProductQuotient([(units, torch.zeros(1, 2, 1))])
    m = ProductQuotient(
        [(units, torch.tensor([[[0], [1]]])), (units, torch.tensor([[[1], [2]]]))],
        labels=["a", "b"],
    )
    x = torch.tensor([[1.0, 2.0, 3.0]], dtype=DT)
    with pytest.raises(ValueError, match="1 entries of the point are 0"):
        m.at(torch.tensor([[1.0, 0.0, 3.0]], dtype=DT))
    with pytest.raises(ValueError, match="a tuple of one element per part"):
        m.act(x, torch.ones(1, 1, 1, dtype=DT))
    # a = 2 on part a's unit (in 0, out 1), b = 4 on part b's unit (in 1, out 2)
    g = (torch.full((1, 1, 1), 2.0, dtype=DT), torch.full((1, 1, 1), 4.0, dtype=DT))
    torch.testing.assert_close(m.act(x, g), torch.tensor([[0.5, 2.0 * 2.0 / 4.0, 12.0]], dtype=DT))
    assert m.lie_shape(m.at(x)) == (2,)
    torch.testing.assert_close(
        m.vertical(m.at(x), torch.tensor([[1.0, 10.0]], dtype=DT)),
        torch.tensor([[-1.0, 2.0 - 20.0, 30.0]], dtype=DT),
    )


# ---------------------------------------------------------------------- a hand-built block
@pytest.mark.parametrize("per_head", [False, True])
def test_the_product_equals_a_hand_built_block_on_the_union(per_head):
    model = make_model(4)
    product, single = chain(model, per_head), hand(model)
    assert product.n_symmetric == single.n_symmetric == 6 * 4 + 6 + 5 * 6 + 5 + 3 * 5
    gen = torch.Generator().manual_seed(5)
    tangent = {
        n: torch.randn(p.shape, generator=gen, dtype=DT) for n, p in model.named_parameters()
    }
    results = []
    for geometry in (product, single):
        m = geometry.manifolds()[0]
        (x,), _ = geometry.gather()
        (u,), _ = geometry.gather(tangent)
        p = m.at(x)
        hor = m.proju(p, u)
        results.append(
            {
                "proju": geometry.scatter([hor]),
                "egrad2rgrad": geometry.scatter([m.egrad2rgrad(p, u)]),
                "norm": m.norm(p, hor),
            }
        )
    for key in ("proju", "egrad2rgrad"):
        assert results[0][key].keys() == results[1][key].keys()
        for name, value in results[0][key].items():
            assert rel(value, results[1][key][name]) < RTOL, (key, name)
    assert rel(results[0]["norm"], results[1]["norm"]) < RTOL


@pytest.mark.parametrize(
    ("perturbation", "norm"),
    [("second_order", "riemannian"), ("first_order", "adaptive"), ("exact", "riemannian")],
)
def test_sharpness_on_the_product_equals_the_hand_built_block(perturbation, norm):
    model = make_model(4)
    batches = [inputs(6)]
    kw = dict(rho=0.2, n_iter=6, restarts=2, perturbation=perturbation, norm=norm, progress=False)
    values = [
        geodesic_sharpness(model, mse, batches, symmetries=g(model), **kw).value
        for g in (chain, hand)
    ]
    assert values[1] > 0
    # the hand-built block integrates geodesics by RK4 (32 steps: ~1e-13 here), the product
    # in closed form
    assert values[0] == pytest.approx(values[1], rel=1e-10)


def test_sharpness_is_invariant_along_the_product_orbits():
    model = make_model(7)
    batches = [inputs(8)]
    kw = dict(rho=0.2, n_iter=8, progress=False)
    reference = geodesic_sharpness(model, mse, batches, symmetries=chain(model), **kw).value
    partial_reference = geodesic_sharpness(
        model, mse, batches, symmetries=only_layer1(model), **kw
    ).value
    partial_changes = []
    for seed, scale in enumerate((0.1, 0.5, 4.0, 20.0)):
        moved = moved_along_orbits(model, scale=scale, seed=seed, symmetries=chain)
        value = geodesic_sharpness(moved, mse, batches, symmetries=chain(moved), **kw).value
        assert value == pytest.approx(reference, rel=1e-9), scale
        partial = geodesic_sharpness(moved, mse, batches, symmetries=only_layer1(moved), **kw)
        partial_changes.append(abs(partial.value - partial_reference) / partial_reference)
    # the check can fail: declaring only layer 1's group (its column-norm metric), the
    # re-scalings of layer 2 change the measure
    assert max(partial_changes) > 0.05, partial_changes


# ---------------------------------------------------------------------- gather / scatter
class Wide(nn.Module):
    """The MLP and two side layers of equal shapes (for batched ordinary blocks)."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP(4, 6, 5, 3)
        self.side1, self.side2 = nn.Linear(3, 4), nn.Linear(3, 4)

    def forward(self, x):
        return self.mlp(x)


def declare_wide(model, stacked):
    """A product over layers 1-2 of the MLP beside ordinary blocks (``stacked``: batched)."""
    g = ParameterGeometry(model)
    # layer 1 units 0..2 only: the other rows of fc1 stay adaptive or go to a scale block
    g.add(
        ReLUUnits(5),
        [Source("mlp.fc1.weight", rows=(0, 3)), Source("mlp.fc1.bias", rows=(0, 3))],
        Source("mlp.fc2.weight", axis=1, cols=(0, 3)),
        label="layer 1 (3 units)",
    )
    g.add(
        ReLUUnits(7),
        ["mlp.fc2.weight", "mlp.fc2.bias"],
        Source("mlp.fc3.weight", axis=1),
        label="layer 2",
        product=True,
    )
    if not stacked:
        g.add(ScaleQuotient(2), Source("mlp.fc1.weight", rows=(3, 5)), label="rows 3-4")
    g.add(ScaleQuotient(2), "side1.weight", label="side 1")
    g.add(ScaleQuotient(2), "side2.weight", label="side 2")
    return g


def test_gather_and_scatter_reproduce_the_parameters():
    torch.manual_seed(0)
    model = Wide().to(DT)
    params = dict(model.named_parameters())

    for stacked in (True, False):
        geometry = declare_wide(model, stacked)
        assert (geometry.plan.stacks is not None) == stacked
        assert [k.batch for k in geometry.kinds] == [1] + [1] * (not stacked) + [2]
        product = geometry.kinds[0]
        assert product.product is not None and product.blocks == (0, 1)
        # fc2.weight is shared; fc1's rows 3.. are not in the product
        assert product.shape == (3 * 4 + 3 + 5 * 6 + 5 + 3 * 5,)
        points, w = geometry.gather()
        out = geometry.scatter(points, w)
        assert out.keys() == params.keys()
        for name, p in params.items():
            assert torch.equal(out[name], p), name
            assert out[name].data_ptr() != p.data_ptr()
        # gathered points share no memory with the parameters, and scatter is differentiable
        leaves = [t.clone().requires_grad_() for t in points]
        loss = sum(v.square().sum() for v in geometry.scatter(leaves).values())
        grads = torch.autograd.grad(loss, leaves)
        for leaf, grad in zip(leaves, grads, strict=True):
            torch.testing.assert_close(grad, 2 * leaf.detach(), rtol=0, atol=0)
        # a perturbation of the product point reaches exactly the product's entries
        moved = geometry.scatter([points[0] + 1.0, *points[1:]], w)
        diff = {n: (moved[n] - params[n]).ne(0) for n in params}
        assert bool(diff["mlp.fc2.weight"].all()) and bool(diff["mlp.fc3.weight"].all())
        assert bool(diff["mlp.fc1.weight"][:3].all()) and not bool(diff["mlp.fc1.weight"][3:].any())
        assert not bool(diff["mlp.fc3.bias"].any()) and not bool(diff["side1.weight"].any())


def test_a_block_that_joins_two_products_merges_them():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 4),
        nn.ReLU(),
        nn.Linear(4, 5),
        nn.ReLU(),
        nn.Linear(5, 4),
        nn.ReLU(),
        nn.Linear(4, 2),
    ).to(DT)

    def units(g, i, n_in, **kw):
        return g.add(
            ReLUUnits(n_in + 1),
            [f"{i}.weight", f"{i}.bias"],
            Source(f"{i + 2}.weight", axis=1),
            label=f"units {i}",
            **kw,
        )

    def declare(m):
        g = ParameterGeometry(m)
        units(g, 0, 3)
        units(g, 4, 5)  # disjoint from units 0: two ordinary blocks
        assert len(g.kinds) == 2 and not g.products
        return units(g, 2, 4, product=True)  # overlaps both

    geometry = declare(model)
    assert len(geometry.products) == 1 and geometry.products[0].parts == (0, 1, 2)
    assert len(geometry.kinds) == 1 and geometry.kinds[0].blocks == (0, 1, 2)
    assert "units 0, units 4, units 2" in geometry.summary()
    x = torch.randn(16, 3, dtype=DT)
    moved = moved_along_orbits(model, scale=2.0, symmetries=declare)
    torch.testing.assert_close(moved(x), model(x), rtol=1e-12, atol=1e-13)
    assert all(
        not torch.equal(a, b)
        for (n, a), b in zip(moved.named_parameters(), model.parameters(), strict=True)
        if n != "6.bias"
    )


# ---------------------------------------------------------------------- refusals
def state(geometry):
    return (
        geometry.summary(),
        [b.label for b in geometry.blocks],
        [p.parts for p in geometry.products],
        dict(geometry.layout.regions),
        dict(geometry.layout.views),
    )


def assert_same_state(a, b):
    assert a == b


class NoAction(ReLUUnits):
    def act(self, x, a):
        return QuotientManifold.act(self, x, a)


@pytest.mark.parametrize(
    ("first", "second", "message"),
    [
        # GL(h1) mixing of layer 1's units against their re-scaling: they do not commute
        (
            lambda g: g.add(
                GLQuotient(5), ["fc1.weight", "fc1.bias"], Source("fc2.weight", axis=1), label="gl"
            ),
            lambda g: layer1(g, product=True),
            r"layer 1: the actions of 'layer 1' and 'gl' do not commute on their shared "
            r"parameters \(‖a·\(b·x\) − b·\(a·x\)‖ / ‖a·\(b·x\)‖ = \d\.\d+e[+-]\d+ > 1\.5e-08",
        ),
        (
            layer1,
            lambda g: g.add(
                GLQuotient(5),
                ["fc1.weight", "fc1.bias"],
                Source("fc2.weight", axis=1),
                label="gl",
                product=True,
            ),
            r"gl: the actions of 'gl' and 'layer 1' do not commute",
        ),
        # refused while extending a product: the product stays as it was
        (
            lambda g: layer2(layer1(g), product=True),
            lambda g: g.add(
                GLQuotient(5),
                ["fc1.weight", "fc1.bias"],
                Source("fc2.weight", axis=1),
                label="gl",
                product=True,
            ),
            r"gl: the actions of 'gl' and 'layer 1' do not commute",
        ),
        # a scaling of W2 commutes with GL(h1) on its columns, but GL does not preserve Σ η²/x²
        (
            lambda g: g.add(
                GLQuotient(5), ["fc1.weight", "fc1.bias"], Source("fc2.weight", axis=1), label="gl"
            ),
            lambda g: g.add(ScaleQuotient(2), "fc2.weight", label="scale", product=True),
            r"scale: the action of 'gl' does not preserve the element-wise metric Σ η²/x²",
        ),
        # the same group twice: the vertical spaces coincide
        (
            layer1,
            lambda g: g.add(
                ReLUUnits(5),
                ["fc1.weight", "fc1.bias"],
                Source("fc2.weight", axis=1),
                label="again",
                product=True,
            ),
            r"again: the vertical spaces of 'layer 1', 'again' are not independent here",
        ),
        (
            layer1,
            lambda g: g.add(NoAction(5), "fc2.weight", label="no act", product=True),
            r"no act: a product needs the finite action act\(x, g\) of every part.*NoAction "
            r"defines no finite action",
        ),
        # without product=True an overlap is refused as before, with the way out
        (
            layer1,
            layer2,
            r"layer 2: rows \(0, 5\), cols \(0, 4\) of 'fc2.weight' already belong to another "
            r"block \(declare it with product=True",
        ),
    ],
)
def test_refused_products_name_the_blocks_and_change_nothing(first, second, message):
    model = make_model(d_in=4, h1=4, h2=5, d_out=3)
    geometry = first(ParameterGeometry(model))
    before = state(geometry)
    with pytest.raises(ValueError, match=message):
        second(geometry)
    assert_same_state(state(geometry), before)
    # the geometry still accepts a valid declaration, and measures
    geometry.add(ScaleQuotient(1), "fc3.bias", label="valid")
    points, w = geometry.gather()
    out = geometry.scatter(points, w)
    for name, p in model.named_parameters():
        assert torch.equal(out[name], p), name


def test_zero_entries_are_refused_with_their_parameter():
    model = make_model()
    with torch.no_grad():
        model.fc2.bias[1] = 0.0
    geometry = layer1(ParameterGeometry(model))
    before = state(geometry)
    with pytest.raises(ValueError, match=r"layer 2: .* some entries are 0 \(1 of 'fc2.bias'\)"):
        layer2(geometry, product=True)
    assert_same_state(state(geometry), before)


def test_a_product_block_that_overlaps_nothing_is_an_ordinary_block():
    model = make_model()
    geometry = layer1(ParameterGeometry(model), product=True)
    assert not geometry.products and not isinstance(geometry.manifolds()[0], ProductQuotient)
    plain = layer1(ParameterGeometry(model))
    assert geometry.summary() == plain.summary()


def test_a_block_may_not_cover_an_entry_twice():
    model = make_model()
    geometry = layer1(ParameterGeometry(model))
    before = state(geometry)
    with pytest.raises(ValueError, match=r"twice: .* of 'fc2.weight' are covered twice by this"):
        geometry.add(ScaleQuotient(2), ["fc2.weight", "fc2.weight"], label="twice", product=True)
    assert_same_state(state(geometry), before)


# ---------------------------------------------------------------------- the docs
def test_the_docs_code_blocks_run():
    """Every python block of docs/defining-a-symmetry.md, in order, in one namespace (they
    continue each other), including the 3-layer ReLU product."""
    text = DOCS.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert any("product=True" in b for b in blocks)
    namespace: dict = {"__name__": "docs"}
    for block in blocks:
        exec(compile(block, str(DOCS), "exec"), namespace)


def test_parts_read_and_write_products_like_the_geometry():
    """The parts the measures work on read and write product points and partly covered
    parameters as ``gather`` and ``scatter`` do, stacked or not (the other layouts:
    tests/geometry/test_geometry.py)."""
    torch.manual_seed(0)
    model = Wide().to(DT)
    for stacked in (True, False):
        assert_parts_read_and_write_like_the_geometry(declare_wide(model, stacked))
