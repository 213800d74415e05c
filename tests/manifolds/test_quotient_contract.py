"""Every shipped quotient manifold (and a user-defined one) satisfies the quotient contract of
:func:`quotientgeo.testing.check_quotient`, over random shapes, batch dimensions, seeds and
dtypes; and the contract fails, naming the property, for manifolds that break it.

Points are well-conditioned (GL factors with condition number at most 4, re-scaled entries with
magnitudes in ``[0.5, 2]``), so the default tolerances (``1e-8`` relative in float64, ``1e-3``
in float32) hold for every property.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quotientgeo import (
    AdaptiveGeometry,
    EuclideanGeometry,
    FrameDamping,
    GLQuotient,
    ProductQuotient,
    QuotientManifold,
    RescaleQuotient,
    RotaryGLQuotient,
    ScaleQuotient,
)
from quotientgeo.linalg import conditioned_matrix, haar_orthogonal
from quotientgeo.manifolds import GLMixQuotient, GLTotalSpace
from quotientgeo.testing import QuotientReport, check_quotient
from quotientgeo.testing.numerics import rel
from quotientgeo.testing.strategies import interpolated_cases, scale_cases

DTYPES = (torch.float32, torch.float64)
BATCHES = ((), (2,), (2, 3))


class ReLURescale(QuotientManifold):
    """The user-defined symmetry of ``docs/defining-a-symmetry.md``: hidden units of a ReLU layer,
    ``x = [W1ᵀ; W2]``, re-scaled by ``(W1ᵀ / a, W2 a)``, column-norm metric."""

    def __init__(self, d_in):
        super().__init__()
        self.d_in = d_in

    def lie_shape(self, p):
        return (p.x.shape[-1],)

    def vertical(self, p, omega):
        w1, w2 = p.x[..., : self.d_in, :], p.x[..., self.d_in :, :]
        return omega[..., None, :] * torch.cat([-w1, w2], dim=-2)

    def metric(self, p, u):
        return u / self.sq_norms(p.x)

    def act(self, x, a):
        a = a[..., None, :]
        return torch.cat([x[..., : self.d_in, :] / a, x[..., self.d_in :, :] * a], dim=-2)

    def sq_norms(self, x):
        w1, w2 = x[..., : self.d_in, :], x[..., self.d_in :, :]
        sq = lambda t: t.square().sum(-2, keepdim=True).expand_as(t)  # noqa: E731
        return torch.cat([sq(w1), sq(w2)], dim=-2)


# --------------------------------------------------------------------------- points
def factor(batch, rows, h, g) -> torch.Tensor:
    """``rows × h`` factors ``U diag(σ) Vᵀ`` with orthonormal ``U``, ``σ ∈ [½, 2]`` log-uniform."""
    U = haar_orthogonal(*batch, rows, rows, generator=g, dtype=torch.float64)[..., :h]
    return U @ conditioned_matrix(*batch, h, h, condition=4.0, generator=g, dtype=torch.float64)


def gl_point(batch, n, m, h, g) -> torch.Tensor:
    return torch.cat([factor(batch, n, h, g), factor(batch, m, h, g)], dim=-2)


def entries(shape, g) -> torch.Tensor:
    """Magnitudes in ``[0.5, 2]``, random signs."""
    mag = 0.5 + 1.5 * torch.rand(*shape, generator=g, dtype=torch.float64)
    return torch.where(torch.rand(*shape, generator=g) < 0.5, -mag, mag)


@st.composite
def gl_shapes(draw, min_h=1, even=False):
    h = draw(st.integers(min_h, 4))
    if even:
        h += h % 2
    return h, h + draw(st.integers(0, 3)), h + draw(st.integers(0, 3))


def gl(metric, eps=0.0):
    def build(draw, batch, g):
        h, n, m = draw(gl_shapes())
        return GLQuotient(n, metric, eps), gl_point(batch, n, m, h, g)

    return build


def framed(metric, zero_g=False):
    """A GL pair damped in ``H``'s frame; ``zero_g``: at ``G = 0`` (a LoRA adapter's start)."""

    def build(draw, batch, g):
        h, n, m = draw(gl_shapes())
        x = gl_point(batch, n, m, h, g)
        if zero_g:
            x[..., :n, :] = 0
        return GLQuotient(n, metric, FrameDamping(0.2)), x

    return build


def rotary(metric, pairing, partial):
    def build(draw, batch, g):
        h, n, m = draw(gl_shapes(min_h=3 if partial else 2, even=True))
        dims = 2 if partial else None
        return RotaryGLQuotient(n, metric, rotary_dims=dims, pairing=pairing), gl_point(
            batch, n, m, h, g
        )

    return build


def rescale(metric):
    def build(draw, batch, g):
        d = draw(st.integers(1, 5))
        return RescaleQuotient(metric), entries((*batch, 2, d), g)

    return build


def scale(draw, batch, g):
    ndim = draw(st.integers(1, 2))
    block = (draw(st.integers(2, 4)),) + ((draw(st.integers(1, 3)),) if ndim == 2 else ())
    return ScaleQuotient(ndim), entries((*batch, *block), g)


def product(draw, batch, g):
    """A scaling of entries ``0..3`` and a re-scaling pair on entries ``(2, 3; 4, 5)``: commuting
    actions on shared entries."""
    parts = [
        (ScaleQuotient(1), torch.tensor([[0, 1, 2, 3]])),
        (RescaleQuotient(draw(st.sampled_from(["inv", "mix"]))), torch.tensor([[2, 3], [4, 5]])),
    ]
    return ProductQuotient(parts), entries((*batch, 6), g)


def adaptive(draw, batch, g):
    return AdaptiveGeometry(), entries((*batch, draw(st.integers(1, 6))), g)


def euclidean(draw, batch, g):
    return EuclideanGeometry(), torch.randn(*batch, draw(st.integers(1, 6)), generator=g)


def total_space(draw, batch, g):
    h, n, m = draw(gl_shapes())
    return GLTotalSpace(n, draw(st.sampled_from(["inv", "mix"]))), gl_point(batch, n, m, h, g)


def user(draw, batch, g):
    d_in, hidden = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    return ReLURescale(d_in), entries((*batch, d_in + 1, hidden), g)


def generic_of(build):
    def generic(draw, batch, g):
        m, x = build(draw, batch, g)
        return m.generic(), x

    return generic


KINDS = {
    "gl-inv": gl("inv"),
    "gl-mix": gl("mix"),
    "gl-interpolated": gl(0.3),
    "gl-interpolated-random-s": None,  # s drawn below
    "gl-framed-mix": framed("mix"),
    "gl-framed-inv": framed("inv"),
    "gl-framed-mix-zero-g": framed("mix", zero_g=True),
    "gl-framed-inv-zero-g": framed("inv", zero_g=True),
    "rotary-half-inv": rotary("inv", "half", False),
    "rotary-half-mix": rotary("mix", "half", False),
    "rotary-interleaved-inv": rotary("inv", "interleaved", False),
    "rotary-interleaved-mix": rotary("mix", "interleaved", True),
    "rotary-half-partial-inv": rotary("inv", "half", True),
    "rescale-inv": rescale("inv"),
    "rescale-mix": rescale("mix"),
    "scale": scale,
    "product": product,
    "adaptive": adaptive,
    "euclidean": euclidean,
    "gl-total-space": total_space,
    "user-relu-rescale": user,
}
GENERIC_KINDS = {
    "generic-gl-mix": generic_of(gl("mix")),
    "generic-scale": generic_of(scale),
    "generic-user": generic_of(user),
}


def interpolated_random_s(draw, batch, g):
    return gl(draw(st.floats(0.0, 1.0)))(draw, batch, g)


KINDS["gl-interpolated-random-s"] = interpolated_random_s


def check_kind(build, data) -> None:
    batch = data.draw(st.sampled_from(BATCHES), label="batch")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    g = torch.Generator().manual_seed(seed)
    manifold, x = build(data.draw, batch, g)
    report = check_quotient(manifold, x.to(dtype), generator=g)
    assert isinstance(report, QuotientReport)
    if manifold.lie_shape(manifold.at(x)) != (0,):
        for name in ("metric_invariance", "proju_horizontal", "proju_equivariance"):
            assert name in report.checked, (name, report.skipped)


@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=6)
@given(data=st.data())
def test_every_shipped_manifold_satisfies_the_contract(kind, data):
    check_kind(KINDS[kind], data)


@pytest.mark.parametrize("kind", sorted(GENERIC_KINDS))
@settings(max_examples=3)
@given(data=st.data())
def test_the_generic_path_satisfies_the_contract(kind, data):
    """``m.generic()`` (every derived method from the base class) is a quotient manifold too."""
    check_kind(GENERIC_KINDS[kind], data)


@pytest.mark.parametrize("metric", ["inv", "mix"])
@settings(max_examples=6)
@given(data=st.data())
def test_relaxed_gl_satisfies_the_contract_of_the_orthogonal_group(metric, data):
    """With ``eps > 0`` only ``O(h)`` preserves the relaxed metric (``P + eps·I`` transforms by
    congruence only for orthogonal ``A``), and the closed-form projection is the ``eps = 0``
    one (not idempotent for the relaxed metric): the contract holds for orthogonal elements,
    minus the projection's own properties."""
    batch = data.draw(st.sampled_from(BATCHES))
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    manifold, x = gl(metric, eps=data.draw(st.floats(0.01, 1.0)))(data.draw, batch, g)
    h = x.shape[-1]
    A = haar_orthogonal(*batch, h, h, generator=g, dtype=torch.float64)
    projection = (
        "proju_horizontal",
        "proju_vertical",
        "proju_idempotent",
        "random_tangent",
        "egrad2rgrad",
        "generic.proju",
        "generic.egrad2rgrad",
    )
    report = check_quotient(manifold, x, generator=g, group=A, skip=projection)
    assert "metric_invariance" in report.checked and "generic.christoffel" in report.checked


@pytest.mark.parametrize("cases", [scale_cases, interpolated_cases], ids=["scale", "interpolated"])
@settings(max_examples=12, deadline=None, derandomize=True)
@given(data=st.data())
def test_the_contract_with_given_elements_on_the_manifold_and_its_generic_path(cases, data):
    """``ScaleQuotient`` (``g = exp(N(0, 1))`` per block, points ``N(0.1, 1)``) and
    ``InterpolatedGLQuotient`` (random ``s``, factors and ``A`` of condition ≤ 4): the contract
    at ``1e-9`` with the case's group element and vectors at full length (the exact ``expmap``
    is left to the test above, at length 0.3), on ``m`` and on ``m.generic()``; metric
    invariance also relative to the inner product itself."""
    m, x, u, v, g, _ = data.draw(cases())
    for path in (m, m.generic()):
        check_quotient(
            path,
            x,
            group=g,
            rtol=1e-9,
            radius=None,
            generator=torch.Generator(),
            skip=["expmap_equivariance"],  # at full length: checked at radius 0.3 above
        )
        gx, gu, gv = m.act(x, g), m.push(x, u, g), m.push(x, v, g)
        assert rel(path.inner(gx, gu, gv), path.inner(x, u, v)) < 1e-9


# --------------------------------------------------------------------------- it can fail
class OffProjection(GLMixQuotient):
    def proju(self, x, u):
        return 0.99 * super().proju(x, u) + 0.01 * u


class EuclideanReLU(ReLURescale):
    def metric(self, p, u):
        return u


class WrongIsotropic(ScaleQuotient):
    def isotropic(self, p, e):
        return e


class WrongChristoffel(ScaleQuotient):
    def christoffel(self, x, u, v=None):
        return 1.01 * super().christoffel(x, u, v)


class SlowAction(ScaleQuotient):
    """Pushes vectors by ``a²`` instead of ``a``: the metric is then not invariant."""

    def push(self, x, u, a):
        return self._expand(a) ** 2 * u


@pytest.mark.parametrize(
    ("broken", "point", "violated"),
    [
        (OffProjection(4), lambda g: gl_point((2,), 4, 3, 2, g), "proju_horizontal"),
        (EuclideanReLU(3), lambda g: entries((2, 4, 5), g), "metric_invariance"),
        (WrongIsotropic(1), lambda g: entries((3, 4), g), "isotropic"),
        (WrongChristoffel(1), lambda g: entries((3, 4), g), "generic.christoffel"),
        (SlowAction(1), lambda g: entries((3, 4), g), "metric_invariance"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, QuotientManifold) else None,
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_broken_manifold_fails_naming_the_property(broken, point, violated, dtype):
    g = torch.Generator().manual_seed(0)
    x = point(g).to(dtype)
    with pytest.raises(AssertionError, match=rf"{violated}: relative error \S+ > rtol") as err:
        check_quotient(broken, x, generator=g)
    assert repr(broken) in str(err.value)


def test_a_manifold_that_breaks_one_property_passes_when_it_is_skipped():
    g = torch.Generator().manual_seed(1)
    report = check_quotient(WrongIsotropic(1), entries((3, 4), g), generator=g, skip=["isotropic"])
    assert report.skipped["isotropic"] == "skipped by the caller"
    assert "isotropic" not in report.checked


def test_report_lists_checked_and_skipped_properties():
    g = torch.Generator().manual_seed(2)
    report = check_quotient(AdaptiveGeometry(), entries((2, 5), g), generator=g, samples=3)
    assert set(report.checked) >= {"metric_inv", "isotropic", "egrad2rgrad", "generic.christoffel"}
    assert "defines no finite action" in report.skipped["metric_invariance"]
    assert "trivial" in report.skipped["proju_horizontal"]
    assert "generic_expmap=False" in report.skipped["generic.expmap"]
    assert all(report.errors[k] <= report.rtol[k] for k in report.checked)
    assert report.rtol["isotropic"] == 1e-8
    assert "metric_invariance" in str(report) and "skipped" in str(report)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.manifold = "other"  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(TypeError):
        report.errors["isotropic"] = 1.0  # pyright: ignore[reportIndexIssue]


def test_tolerances_follow_the_dtype_and_the_arguments():
    g = torch.Generator().manual_seed(3)
    x = entries((2, 2, 3), g)
    assert (
        check_quotient(RescaleQuotient(), x.float(), generator=g).rtol["proju_idempotent"] == 1e-3
    )
    report = check_quotient(RescaleQuotient(), x, rtol=1e-9, rtols={"isotropic": 1e-12})
    assert report.rtol["proju_idempotent"] == 1e-9 and report.rtol["isotropic"] == 1e-12
    with pytest.raises(AssertionError, match=r"isotropic: relative error \S+ > rtol 0\.0e\+00"):
        check_quotient(WrongIsotropic(1), entries((3, 4), g), rtols={"isotropic": 0.0})
    with pytest.raises(ValueError, match="unknown properties"):
        check_quotient(RescaleQuotient(), x, skip=["no_such_property"])
    with pytest.raises(ValueError, match="samples"):
        check_quotient(RescaleQuotient(), x, samples=0)


def test_generic_expmap_on_request():
    g = torch.Generator().manual_seed(4)
    report = check_quotient(
        ScaleQuotient(2), entries((2, 3, 2), g), generator=g, generic_expmap=True
    )
    assert "generic.expmap" in report.checked


def test_an_action_that_is_not_affine_skips_the_equivariances_that_assume_it():
    """``x ↦ x + c x²`` is not affine: the Christoffel and expmap2 equivariances do not apply
    and are skipped (the flat metric is not invariant under it either: skipped by the caller)."""

    class Bending(EuclideanGeometry):
        def act(self, x, c):
            return x + c * x.square()

        def random_group(self, x, *, generator=None, scale=1.0):
            return 0.1 * scale * torch.rand(x.shape, generator=generator, dtype=x.dtype)

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, dtype=torch.float64)
    invariance = ["metric_invariance", "egrad2rgrad_equivariance", "expmap_equivariance"]
    report = check_quotient(Bending(), x, generator=g, skip=invariance)
    assert "not affine" in report.skipped["action_affine"]
    assert "not affine" in report.skipped["christoffel_equivariance"]
    assert "not affine" in report.skipped["expmap2_equivariance"]


def test_an_affine_action_is_checked():
    """Translations ``x ↦ x + c`` of the flat metric: affine, an isometry, every check runs."""

    class Translations(EuclideanGeometry):
        def act(self, x, c):
            return x + c

        def push(self, x, u, c):
            return u

        def random_group(self, x, *, generator=None, scale=1.0):
            return scale * torch.randn(x.shape, generator=generator, dtype=x.dtype)

    g = torch.Generator().manual_seed(6)
    report = check_quotient(Translations(), torch.randn(3, 4, dtype=torch.float64), generator=g)
    for name in ("action_affine", "metric_invariance", "christoffel_equivariance"):
        assert name in report.checked
