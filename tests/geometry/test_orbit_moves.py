"""Moves along orbits by well-conditioned group elements: ``random_group(condition=c)`` has
``cond(g) ≤ c`` for every shipped group, ``moved_along_orbits`` keeps a model's outputs and
multiplies the Gram condition numbers of its GL pairs by at most ``c²``, and refuses moves that
leave what the dtype resolves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quotientgeo import (
    GLQuotient,
    ProductQuotient,
    RescaleQuotient,
    RotaryGLQuotient,
    ScaleQuotient,
    find_symmetries,
)
from quotientgeo.linalg import conditioned_matrix, haar_orthogonal, mT
from quotientgeo.testing import TinyTransformerClassifier, move_along_orbits_, moved_along_orbits

DT = torch.float64
conditions = st.floats(1.0, 1e3)


def cond(A: torch.Tensor) -> torch.Tensor:
    s = torch.linalg.svdvals(A)
    return s[..., 0] / s[..., -1]


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 6), c=conditions)
def test_haar_orthogonal_and_conditioned_matrix(seed, k, c):
    g = torch.Generator().manual_seed(seed)
    Q = haar_orthogonal(3, k, k, generator=g, dtype=DT)
    torch.testing.assert_close(mT(Q) @ Q, torch.eye(k, dtype=DT).expand(3, k, k))
    A = conditioned_matrix(3, k, k, condition=c, generator=g, dtype=DT)
    s = torch.linalg.svdvals(A)
    assert bool((s <= c**0.5 * (1 + 1e-12)).all() and (s >= c**-0.5 * (1 - 1e-12)).all())


def point(m, batch, g):
    if isinstance(m, (RescaleQuotient, ScaleQuotient)):
        return torch.randn(*batch, 2, 5, generator=g, dtype=DT)
    if isinstance(m, ProductQuotient):
        return torch.randn(*batch, 6, generator=g, dtype=DT)
    return torch.randn(*batch, 9, 4, generator=g, dtype=DT)


def conditions_of(m, element) -> list[torch.Tensor]:
    """Condition numbers of a group element: of each matrix (GL, rotary), else the ratio of the
    largest to the smallest factor |a| over the whole draw (scalings; products: per part)."""
    if isinstance(m, ProductQuotient):
        return [
            c for (part, _), e in zip(m.parts, element, strict=True) for c in conditions_of(part, e)
        ]
    if isinstance(m, (GLQuotient, RotaryGLQuotient)):
        return [cond(element)]
    a = element.abs()
    return [a.max() / a.min()]


MANIFOLDS = {
    "gl-inv": GLQuotient(5, "inv"),
    "gl-mix": GLQuotient(5),
    "rotary-half": RotaryGLQuotient(5, "mix"),
    "rotary-partial": RotaryGLQuotient(5, "inv", rotary_dims=2, pairing="interleaved"),
    "rescale": RescaleQuotient(),
    "scale": ScaleQuotient(2),
    "product": ProductQuotient(
        [
            (ScaleQuotient(1), torch.tensor([[0, 1, 2, 3]])),
            (RescaleQuotient(), torch.tensor([[2, 3], [4, 5]])),
        ]
    ),
}


@pytest.mark.parametrize("kind", sorted(MANIFOLDS))
@settings(max_examples=8)
@given(seed=st.integers(0, 2**31 - 1), c=conditions, batch=st.sampled_from([(), (3,), (2, 2)]))
def test_random_group_is_conditioned_by_condition(kind, seed, c, batch):
    """``cond(g) ≤ condition`` (scalings: largest over smallest factor), for ``scale`` of
    either sign; ``condition = 1`` gives ``scale`` times an orthogonal matrix (scalings:
    ``scale``)."""
    m = MANIFOLDS[kind]
    g = torch.Generator().manual_seed(seed)
    x = point(m, batch, g)
    for scale in (1.0, -2.5):
        element = m.random_group(x, generator=g, scale=scale, condition=c)
        for k in conditions_of(m, element):
            assert bool((k <= c * (1 + 1e-10)).all()), (kind, k.max(), c)
    element = m.random_group(x, generator=g, scale=3.0, condition=1.0)
    if isinstance(m, (GLQuotient, RotaryGLQuotient)):
        sizes = torch.linalg.svdvals(element)
    else:
        parts = element if isinstance(element, tuple) else (element,)
        sizes = torch.cat([part.flatten() for part in parts])
    torch.testing.assert_close(sizes, torch.full_like(sizes, 3.0))
    with pytest.raises(ValueError, match="condition"):
        m.random_group(x, condition=0.5)


def gram_conditions(model) -> list[torch.Tensor]:
    geometry = find_symmetries(model, warn=False)
    points, _ = geometry.gather()
    out = []
    for m, x in zip(geometry.manifolds(), points, strict=True):
        for F in m.split(x.detach().double()):
            out.append(torch.linalg.cond(mT(F) @ F))
    return out


@settings(max_examples=6)
@given(seed=st.integers(0, 2**31 - 1), c=st.floats(1.0, 30.0), scale=st.floats(0.05, 20.0))
def test_moved_model_keeps_outputs_and_gram_conditioning_grows_by_at_most_c_squared(seed, c, scale):
    torch.manual_seed(seed % 1000)
    model = TinyTransformerClassifier(d=16, heads=2, layers=1).double().eval()
    x = torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(seed), dtype=DT)
    moved = moved_along_orbits(model, scale=scale, seed=seed, condition=c)
    torch.testing.assert_close(moved(x), model(x), rtol=1e-9, atol=1e-10)
    assert any(
        not torch.equal(a, b) for a, b in zip(moved.parameters(), model.parameters(), strict=True)
    )
    for before, after in zip(gram_conditions(model), gram_conditions(moved), strict=True):
        assert bool((after <= before * c**2 * (1 + 1e-6)).all()), (after / before).max()


def test_a_move_beyond_the_dtype_raises_and_leaves_the_model_unchanged():
    torch.manual_seed(0)
    model = TinyTransformerClassifier(d=16, heads=2, layers=1).eval()  # float32
    geometry = find_symmetries(model, warn=False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"condition=1e\+06.*float64"):
        move_along_orbits_(geometry, generator=torch.Generator().manual_seed(0), condition=1e6)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    moved = moved_along_orbits(model.double(), condition=1e6)  # float64 resolves it
    assert all(bool(torch.isfinite(p).all()) for p in moved.parameters())


def test_a_user_random_group_without_condition_still_moves():
    """A ``random_group`` override with the old signature is called without ``condition``."""

    class OldStyle(ScaleQuotient):
        def random_group(self, x, *, generator=None, scale=1.0):
            return torch.full(x.shape[: x.dim() - self.ndim], 2.0 * scale, dtype=x.dtype)

    from quotientgeo import ParameterGeometry

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4, eps=0.0)).double()
    geometry = ParameterGeometry(model).add(OldStyle(2), ["0.weight", "0.bias"], label="ln")
    weight = model[0].weight.detach().clone()
    (a,) = move_along_orbits_(geometry, condition=7.0)
    torch.testing.assert_close(model[0].weight.detach(), 2.0 * weight)
    assert float(a) == 2.0
