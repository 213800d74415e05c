"""Any QuotientManifold declared on a model with ``ParameterGeometry.add`` reaches sharpness.

- a user-defined GL(1) quotient with the inv metric, written through the generic base, gives
  the sharpness of the built-in ``add_gl_pair`` geometry with ``metric="inv"`` for every
  perturbation, both norms, worst-case (with restarts) and average measures;
- the same user block is invariant along its own orbits, while adaptive sharpness is not;
- ``ScaleQuotient`` blocks of weights feeding a LayerNorm are measured and invariant;
- declarations are validated, naming the block, and a refused one changes nothing; factors of
  different head widths name the parameter that would fit if read along its other axis, and
  that fix is accepted.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn

from quotientgeo import (
    GLQuotient,
    ParameterGeometry,
    QuotientManifold,
    ScaleQuotient,
    Source,
    average_sharpness,
    geodesic_sharpness,
)
from quotientgeo.testing import moved_along_orbits
from quotientgeo.testing.assertions import SHARPNESS_RTOL
from quotientgeo.testing.numerics import relative_change

DT = torch.float64


class UnitRescale(QuotientManifold):
    """GL(1) pairs ``x = [g; h]`` (``(n+m, 1)``), ``(g, h) ~ (g / a, h a)``, inv metric
    ``|η_g|² / |g|² + |η_h|² / |h|²``: only the three primitives and the action."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def lie_shape(self, p):
        return (1,)

    def vertical(self, p, omega):
        sign = torch.ones(p.x.shape[-2], 1, dtype=p.x.dtype, device=p.x.device)
        sign[: self.n] = -1
        return sign * p.x * omega[..., None, :]

    def metric(self, p, u):
        g, h = p.x[..., : self.n, :], p.x[..., self.n :, :]
        sq = lambda f: f.square().sum(-2, keepdim=True).expand_as(f)  # noqa: E731
        return u / torch.cat([sq(g), sq(h)], dim=-2)

    def act(self, x, a):
        a = a[..., None, :]
        return torch.cat([x[..., : self.n, :] / a, x[..., self.n :, :] * a], dim=-2)


class MLP(nn.Module):
    def __init__(self, d_in=4, hidden=6, d_out=3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


UNITS = (["fc1.weight", "fc1.bias"], Source("fc2.weight", axis=1))


def user_geometry(model):
    """Every hidden unit a GL(1) pair on the user's manifold (ReLU: a > 0 keeps outputs)."""
    return ParameterGeometry(model).add(UnitRescale(5), *UNITS, heads=6, label="units")


def builtin_geometry(model):
    return ParameterGeometry(model).add_gl_pair(*UNITS, heads=6, label="units", metric="inv")


def mse(model, batch):
    x, y = batch
    return (model(x) - y).square().mean()


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(0)
    model = MLP().to(DT)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(32, 4, generator=gen, dtype=DT), torch.randn(32, 3, generator=gen, dtype=DT))
    ]
    return model, batches


@pytest.mark.parametrize(
    ("perturbation", "norm"),
    list(itertools.product(("second_order", "first_order", "exact"), ("riemannian", "adaptive"))),
)
def test_user_block_matches_the_builtin_geometry(problem, perturbation, norm):
    model, batches = problem
    tol = 1e-4 if perturbation == "exact" else 1e-6
    kw = dict(rho=0.2, perturbation=perturbation, norm=norm, progress=False)
    geometries = [user_geometry(model), builtin_geometry(model)]
    worst = [
        geodesic_sharpness(model, mse, batches, symmetries=g, n_iter=6, restarts=2, **kw)
        for g in geometries
    ]
    assert worst[1].value > 0
    assert worst[0].value == pytest.approx(worst[1].value, rel=tol)
    average = [
        average_sharpness(model, mse, batches, symmetries=g, n_samples=6, **kw) for g in geometries
    ]
    assert average[1].value != 0
    assert average[0].value == pytest.approx(average[1].value, rel=tol)


class FlatUnitRescale(UnitRescale):
    """The same action with the Euclidean metric, which the action does not preserve."""

    def metric(self, p, u):
        return u


def test_user_block_is_invariant_along_its_orbits(problem):
    model, batches = problem
    x = batches[0][0]
    kw = dict(rho=0.2, n_iter=8, progress=False)

    def flat_geometry(m):
        return ParameterGeometry(m).add(FlatUnitRescale(5), *UNITS, heads=6)

    reference = geodesic_sharpness(model, mse, batches, symmetries=user_geometry(model), **kw)
    flat_reference = geodesic_sharpness(model, mse, batches, symmetries=flat_geometry(model), **kw)
    flat_changes = []
    for seed, scale in enumerate((0.05, 0.5, 3.0, 40.0)):
        moved = moved_along_orbits(model, scale=scale, seed=seed, symmetries=user_geometry)
        torch.testing.assert_close(moved(x), model(x), rtol=1e-10, atol=1e-12)
        value = geodesic_sharpness(moved, mse, batches, symmetries=user_geometry(moved), **kw)
        change = relative_change(value.value, reference.value)
        assert change <= SHARPNESS_RTOL, (scale, change)
        flat = geodesic_sharpness(moved, mse, batches, symmetries=flat_geometry(moved), **kw)
        flat_changes.append(abs(flat.value - flat_reference.value) / flat_reference.value)
    # the check can fail: a metric the action does not preserve gives another value
    assert max(flat_changes) > 0.1, flat_changes
    # and the group is the claimed one: negative scales (outside it) change the function
    outside = moved_along_orbits(model, scale=-1.0, seed=0, symmetries=user_geometry)
    assert (outside(x) - model(x)).abs().max() > 1e-3


class Normalized(nn.Module):
    """Two ``Linear → LayerNorm`` stages (``eps=0``: exactly scale-invariant) and a head."""

    def __init__(self, d_in=6, d=6, classes=3):
        super().__init__()
        self.l1, self.n1 = nn.Linear(d_in, d), nn.LayerNorm(d, eps=0.0)
        self.l2, self.n2 = nn.Linear(d, d), nn.LayerNorm(d, eps=0.0)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = torch.relu(self.n1(self.l1(x)))
        return self.head(torch.relu(self.n2(self.l2(x))))


def scale_geometry(model):
    """Weights and bias of each layer in front of a LayerNorm: one block scaled as a whole."""
    geometry = ParameterGeometry(model)
    for layer in ("l1", "l2"):
        geometry.add(ScaleQuotient(2), [f"{layer}.weight", f"{layer}.bias"], label=layer)
    return geometry


@pytest.mark.parametrize("perturbation", ["second_order", "exact"])
def test_scale_blocks_feeding_a_norm_are_measured_and_invariant(perturbation):
    torch.manual_seed(0)
    model = Normalized().to(DT)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(24, 6, generator=gen, dtype=DT)
    batches = [(x, torch.randn(24, 3, generator=gen, dtype=DT))]
    geometry = scale_geometry(model)
    assert len(geometry.kinds) == 1 and geometry.kinds[0].batch == 2  # points (7, 6), batched
    kw = dict(rho=0.3, n_iter=8, perturbation=perturbation, progress=False)
    reference = geodesic_sharpness(model, mse, batches, symmetries=geometry, **kw).value
    assert reference > 0
    for seed, scale in enumerate((0.01, 0.3, 7.0, 100.0)):
        moved = moved_along_orbits(model, scale=scale, seed=seed, symmetries=scale_geometry)
        torch.testing.assert_close(moved(x), model(x), rtol=1e-9, atol=1e-10)
        moved_params = dict(moved.named_parameters())
        assert not torch.allclose(moved_params["l1.weight"], model.l1.weight)
        value = geodesic_sharpness(moved, mse, batches, symmetries=scale_geometry(moved), **kw)
        assert relative_change(value.value, reference) <= SHARPNESS_RTOL, (scale, value.value)
    outside = moved_along_orbits(model, scale=-1.0, symmetries=scale_geometry)  # a < 0
    assert (outside(x) - model(x)).abs().max() > 1e-3


def test_blocks_batch_by_manifold_and_shape():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(5, 6)).to(DT)
    geometry = ParameterGeometry(model)
    geometry.add(ScaleQuotient(2), "0.weight")  # point (5, 6)
    geometry.add(ScaleQuotient(2), "2.weight")  # same manifold and shape: same kind
    geometry.add(ScaleQuotient(1), "1.weight")  # (6, 6)
    geometry.add(ScaleQuotient(2), "0.bias")  # (1, 6)
    geometry.add(ScaleQuotient(2, exp_steps=3), "2.bias")  # (1, 6), other parameters
    geometry.add(ScaleQuotient(2), "1.bias")  # joins 0.bias
    assert [k.batch for k in geometry.kinds] == [2, 1, 2, 1]
    assert [k.shape for k in geometry.kinds] == [(5, 6), (6, 6), (1, 6), (1, 6)]
    assert [k.blocks for k in geometry.kinds] == [(0, 1), (2,), (3, 5), (4,)]


def test_add_validates_and_names_the_block():
    model = MLP().to(DT)
    geometry = ParameterGeometry(model).add(UnitRescale(5), *UNITS, heads=6, label="units")
    before = geometry.summary()
    with pytest.raises(ValueError, match="bad: a block is measured on a QuotientManifold"):
        geometry.add("gl", "fc2.bias", label="bad")
    with pytest.raises(ValueError, match=r"widths: the factors give different head widths \[3, 4]"):
        geometry.add(
            ScaleQuotient(2), Source("fc2.bias"), Source("fc1.weight", axis=1), label="widths"
        )
    with pytest.raises(ValueError, match=r"overlap: .* already belong to another block"):
        geometry.add(ScaleQuotient(2), "fc1.bias", label="overlap")
    with pytest.raises(ValueError, match=r"shape: GLMixQuotient rejects its points: .*h <= m"):
        ParameterGeometry(model).add(
            GLQuotient(4), "fc1.weight", Source("fc2.weight", axis=1), label="shape"
        )
    with pytest.raises(ValueError, match="heads: heads must be a positive integer"):
        geometry.add(ScaleQuotient(2), "fc2.bias", heads=0, label="heads")
    assert geometry.summary() == before and [b.label for b in geometry.blocks] == ["units"]
    geometry.add(ScaleQuotient(1), "fc2.bias")  # still accepts a valid block
    assert len(geometry.blocks) == 2


class LoRA(nn.Module):
    """A LoRA adapter ``B A``: ``lora_A.weight`` ``(r, d_in)``, ``lora_B.weight`` ``(d_out, r)``;
    its GL(r) pair is ``add_gl_pair(Source("lora_B.weight", axis=1), "lora_A.weight")``."""

    def __init__(self, d_in: int, d_out: int, r: int, bias: bool = False):
        super().__init__()
        self.lora_A = nn.Linear(d_in, r, bias=bias)
        self.lora_B = nn.Linear(r, d_out, bias=False)


@given(r=st.integers(1, 4), d_in=st.integers(5, 9), d_out=st.integers(5, 9), bias=st.booleans())
def test_a_factor_given_along_the_wrong_axis_is_named_with_its_fix(r, d_in, d_out, bias):
    """LoRA's ``B`` given as a plain name: the error names it, its shape and the fix, and only
    it; the fixed declaration is accepted."""
    assume(d_in != d_out)  # else A read along axis 1 would fit too (next test)
    geometry = ParameterGeometry(LoRA(d_in, d_out, r, bias).to(DT))
    h = ["lora_A.weight", "lora_A.bias"] if bias else "lora_A.weight"
    message = (
        f"GL pair 0: the factors give different head widths {[r, d_out]}; parameter "
        f"'lora_B.weight' (shape ({d_out}, {r})) read along axis 0 gives head width {d_out}, "
        f"along axis 1 (its columns as the heads' features) {r} like the other factors: "
        "give Source('lora_B.weight', axis=1) instead of 'lora_B.weight'"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        geometry.add_gl_pair("lora_B.weight", h)
    assert not geometry.blocks
    geometry.add_gl_pair(Source("lora_B.weight", axis=1), h)
    assert [k.shape for k in geometry.kinds] == [(d_out + d_in + bias, r)]


@pytest.mark.parametrize(
    "model, g, h, tail",
    [
        (  # given along axis 1, read along axis 0: the plain name is the fix
            LoRA(6, 8, 2),
            Source("lora_B.weight", axis=1),
            Source("lora_A.weight", axis=1),
            "give 'lora_A.weight' instead of Source('lora_A.weight', axis=1)",
        ),
        (  # the source's other fields are kept
            LoRA(6, 8, 2),
            Source("lora_B.weight", rows=(0, 4)),
            "lora_A.weight",
            "give Source('lora_B.weight', axis=1, rows=(0, 4)) instead of "
            "Source('lora_B.weight', rows=(0, 4))",
        ),
        (  # d_in == d_out: either factor read along its other axis fits, both are named
            LoRA(8, 8, 2),
            "lora_B.weight",
            "lora_A.weight",
            "give Source('lora_B.weight', axis=1) instead of 'lora_B.weight'; or parameter "
            "'lora_A.weight' (shape (2, 8)) read along axis 0 gives head width 2, along axis 1 "
            "(its columns as the heads' features) 8 like the other factors: give "
            "Source('lora_A.weight', axis=1) instead of 'lora_A.weight'",
        ),
        (  # no factor fits along its other axis: the widths only
            nn.Sequential(nn.Linear(5, 6), nn.Linear(3, 7)),
            "0.weight",
            "1.weight",
            "the factors give different head widths [6, 7]",
        ),
    ],
)
def test_the_width_error_names_every_factor_that_fits_along_its_other_axis(model, g, h, tail):
    with pytest.raises(ValueError, match=f"{re.escape(tail)}$"):
        ParameterGeometry(model.to(DT)).add_gl_pair(g, h)
