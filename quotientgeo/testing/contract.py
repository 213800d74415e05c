r"""The contract of a quotient manifold, checked on random vectors and group elements.

:func:`check_quotient` is the test a symmetry must pass, shipped or user-defined: the metric is
invariant under the action, the projection is the metric-orthogonal projection onto the
horizontal space, every map commutes with the action, the isotropic map whitens the metric, and
the closed forms agree with the generic (autodiff) derivation of the base class.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ..manifolds.base import QuotientManifold
from ..manifolds.quotient import GenericPath

Tensor = torch.Tensor

__all__ = ["PROPERTIES", "QuotientReport", "check_quotient"]

#: Every property :func:`check_quotient` knows, in the order it checks them.
PROPERTIES = (
    "metric_inv",
    "isotropic",
    "proju_horizontal",
    "proju_vertical",
    "proju_idempotent",
    "random_tangent",
    "egrad2rgrad",
    "action_affine",
    "metric_invariance",
    "proju_equivariance",
    "egrad2rgrad_equivariance",
    "christoffel_equivariance",
    "expmap2_equivariance",
    "expmap_equivariance",
    "generic.inner",
    "generic.metric_inv",
    "generic.proju",
    "generic.egrad2rgrad",
    "generic.christoffel",
    "generic.christoffel_uv",
    "generic.expmap2",
    "generic.expmap",
)

_DEFAULT_RTOL = {torch.float64: 1e-8, torch.float32: 1e-3}


@dataclass(frozen=True)
class QuotientReport:
    """What :func:`check_quotient` checked and found.

    Attributes:
        manifold: ``repr`` of the manifold.
        errors: property name → largest relative error observed (every checked property).
        rtol: property name → the tolerance it was held to.
        skipped: property name → why it was not checked.
    """

    manifold: str
    errors: Mapping[str, float] = field(default_factory=dict)
    rtol: Mapping[str, float] = field(default_factory=dict)
    skipped: Mapping[str, str] = field(default_factory=dict)

    @property
    def checked(self) -> tuple[str, ...]:
        """The names of the checked properties."""
        return tuple(self.errors)

    def __str__(self) -> str:
        lines = [f"contract of {self.manifold}:"]
        lines += [f"  {k:<26} {v:.2e} (rtol {self.rtol[k]:.1e})" for k, v in self.errors.items()]
        lines += [f"  {k:<26} skipped: {reason}" for k, reason in self.skipped.items()]
        return "\n".join(lines)


class _Skip(Exception):
    """A property that cannot be checked on this manifold (the message says why)."""


def check_quotient(
    manifold: QuotientManifold,
    x: Tensor,
    *,
    generator: torch.Generator | None = None,
    samples: int = 2,
    rtol: float | None = None,
    rtols: Mapping[str, float] | None = None,
    group: Any = None,
    radius: float | None = 0.3,
    generic: bool = True,
    generic_expmap: bool = False,
    skip: Iterable[str] = (),
) -> QuotientReport:
    r"""Check the contract of ``manifold`` at the points ``x`` on random vectors and elements.

    Each of ``samples`` rounds draws ``e₁, e₂, e₃ ~ N(0, I)`` of the shape of ``x``, tangent
    vectors ``u = T e₁``, ``v = T e₂`` (``T`` the isotropic map), a Lie-algebra element
    ``ω ~ N(0, I)`` of shape ``(*batch, *lie_shape)``, a Euclidean gradient ``∇ = e₃`` and a
    group element ``g = manifold.random_group(x)`` (or ``group``). ``w = r u / ‖u‖_x`` is
    ``u`` at metric length ``r = radius`` (``u`` itself for ``radius=None``). With ``V`` the
    vertical map, ``M`` the metric, ``Π = proju``, ``g·`` the action and ``g_*`` its
    differential (``push``; forward-mode autodiff of ``act`` where ``push`` is not defined):

    ========================== ==========================================================
    property                   holds when
    ========================== ==========================================================
    ``metric_inv``             ``M(M⁻¹ u) = u``
    ``isotropic``              ``<T e₁, T e₂>_x = e₁ · e₂`` (``Tᵀ M T = I``)
    ``proju_horizontal``       ``<Π u, V ω>_x = 0``
    ``proju_vertical``         ``Π(V ω) = 0``
    ``proju_idempotent``       ``Π(Π u) = Π u``
    ``random_tangent``         ``Π r = r`` for ``r = random_tangent(x)``
    ``egrad2rgrad``            ``ρ = egrad2rgrad(∇)`` is horizontal and
                               ``<ρ, Π v>_x = ∇ · Π v``
    ``action_affine``          ``g·(x + u) = g·x + g_* u`` (an affine action, as every
                               shipped one; the Christoffel and ``expmap2`` equivariances
                               below assume it; where it does not hold, it and they are
                               skipped, not failed)
    ``metric_invariance``      ``<g_* u, g_* v>_{g·x} = <u, v>_x``
    ``proju_equivariance``     ``Π_{g·x}(g_* u) = g_* Π_x u``
    ``egrad2rgrad_equivariance`` ``egrad2rgrad_{g·x}(∇') = g_* egrad2rgrad_x(∇)`` with the
                               transformed gradient ``∇' = M(g·x) g_* M(x)⁻¹ ∇``
    ``christoffel_equivariance`` ``Γ_{g·x}(g_* u, g_* v) = g_* Γ_x(u, v)``
    ``expmap2_equivariance``   ``expmap2(g·x, g_* w) - g·x = g·expmap2(x, w) - g·x``
    ``expmap_equivariance``    the same for ``expmap``
    ``generic.<method>``       ``manifold.<method>`` equals ``manifold.generic().<method>``
                               (``inner(x, u, v)``, ``metric_inv(u)``, ``proju(w)``,
                               ``egrad2rgrad(w)``, ``christoffel(w)``,
                               ``christoffel(w, v)``, ``expmap2(w)``, ``expmap(w)``)
    ========================== ==========================================================

    Errors are relative, the largest over the batch and the samples. Scalars:
    ``|a - b| / (‖u‖_x ‖v‖_x)`` (the Cauchy–Schwarz scale; ``‖e₁‖ ‖e₂‖`` for ``isotropic``).
    Vectors and displacements: ``max(‖a - b‖_y / ‖s‖_y, ‖a - b‖₂ / ‖s‖₂)``, both the metric
    at the point ``y`` where they live and the Euclidean norm, against the expected value
    ``s = b``, except ``‖u‖`` for ``proju_idempotent``, ``‖V ω‖`` for ``proju_vertical`` and
    ``‖u‖ ‖V ω‖`` for ``proju_horizontal``. Norms are taken in float64.

    A property is skipped (reported with the reason) where the manifold lacks what it needs:
    no ``act`` (every equivariance and the invariance), a trivial group (``k = 0``: the
    projection properties), an action that is not affine (the Christoffel and ``expmap2``
    equivariances), ``manifold`` a :class:`~quotientgeo.manifolds.GenericPath` itself or
    ``generic=False`` (the ``generic.*`` comparisons), ``generic_expmap=False`` (the default:
    ``generic.expmap`` integrates by RK4 through autodiff Christoffel symbols, slow), or
    ``skip`` names it.

    Args:
        manifold: the quotient.
        x: points ``(*batch, *event)``; dtype and device of everything follow ``x``.
        generator: random source (default: torch's global one).
        samples: rounds of random draws.
        rtol: tolerance of every property; default ``1e-8`` for float64, ``1e-3`` for
            float32, ``5e-2`` otherwise.
        rtols: per-property tolerances that override ``rtol``.
        group: a group element to use instead of ``random_group`` draws.
        radius: metric length of the vectors given to the exponential maps and to the
            ``generic.*`` comparisons (``None``: as drawn).
        generic: compare the closed forms with ``manifold.generic()``.
        generic_expmap: include ``generic.expmap``.
        skip: properties not to check.

    Returns:
        A :class:`QuotientReport` of the largest error of every checked property.

    Raises:
        AssertionError: one or more properties fail; the message names each with its error
            and tolerance (the first line names the first failure).
        ValueError: an unknown property in ``skip`` or ``rtols``.
    """
    skip = set(skip)
    unknown = (skip | set(rtols or {})) - set(PROPERTIES)
    if unknown:
        raise ValueError(f"unknown properties {sorted(unknown)}; known: {PROPERTIES}")
    if samples < 1:
        raise ValueError(f"samples must be a positive integer, got {samples!r}")
    base_rtol = _DEFAULT_RTOL.get(x.dtype, 5e-2) if rtol is None else float(rtol)
    tolerances = {name: float((rtols or {}).get(name, base_rtol)) for name in PROPERTIES}
    run = _Run(manifold, x, generator, group, radius, tolerances["action_affine"])
    errors: dict[str, float] = {}
    skipped: dict[str, str] = {}
    checks = run.checks(generic=generic, generic_expmap=generic_expmap)
    for _ in range(samples):
        run.draw()
        for name in PROPERTIES:
            if name in skipped:
                continue
            if name in skip:
                skipped[name] = "skipped by the caller"
                continue
            try:
                value = checks[name]()
            except _Skip as reason:
                skipped[name] = str(reason)
                continue
            previous = errors.get(name, 0.0)
            errors[name] = value if math.isnan(value) or value > previous else previous
    failures = [
        f"{name}: relative error {errors[name]:.3e} > rtol {tolerances[name]:.1e}"
        for name in PROPERTIES
        if name in errors and not errors[name] <= tolerances[name]
    ]
    if failures:
        raise AssertionError(
            f"{manifold!r} breaks the quotient contract at points {tuple(x.shape)} "
            f"({x.dtype}): " + "; ".join(failures)
        )
    return QuotientReport(
        repr(manifold),
        MappingProxyType(errors),
        MappingProxyType({k: tolerances[k] for k in errors}),
        MappingProxyType(skipped),
    )


class _Run:
    """The state of one :func:`check_quotient` call: the point, the draws, the checks."""

    def __init__(self, m: QuotientManifold, x: Tensor, generator, group, radius, linear_rtol):
        self.m, self.x, self.generator, self.group, self.radius = m, x, generator, group, radius
        self.linear_rtol = linear_rtol
        self._generic: QuotientManifold | None = None
        self.p = m.at(x)
        self.batch = x.shape[: x.dim() - m.ndim]
        self.lie = tuple(m.lie_shape(self.p))
        self.k = math.prod(self.lie)
        self._action: str | None = None  # why the action cannot be checked, once known

    # ------------------------------------------------------------------ draws
    def randn(self, *shape: int) -> Tensor:
        return torch.randn(
            shape, generator=self.generator, dtype=self.x.dtype, device=self.x.device
        )

    def draw(self) -> None:
        m, p = self.m, self.p
        self.e1, self.e2, self.grad = (self.randn(*self.x.shape) for _ in range(3))
        self.u, self.v = m.isotropic(p, self.e1), m.isotropic(p, self.e2)
        self.omega = self.randn(*self.batch, *self.lie)
        self.w = self.u
        if self.radius is not None:
            self.w = self.radius * self.u / m.norm(p, self.u, keepdim=True)
        self.g = None
        self.cache: dict[str, Any] = {}

    def element(self) -> Any:
        """The group element of this round (``_Skip`` without an action)."""
        if self._action is not None:
            raise _Skip(self._action)
        if self.g is None:
            try:
                g = self.group
                if g is None:
                    g = self.m.random_group(self.x, generator=self.generator)
                self.gx = self.m.act(self.x, g)
            except NotImplementedError as err:
                self._action = str(err)
                raise _Skip(self._action) from None
            self.g = g
        return self.g

    def push(self, u: Tensor) -> Tensor:
        g = self.element()
        try:
            return self.m.push(self.x, u, g)
        except NotImplementedError:
            shape = torch.broadcast_shapes(self.x.shape, u.shape)
            x, u = self.x.expand(shape).contiguous(), u.expand(shape).contiguous()
            return torch.func.jvp(lambda y: self.m.act(y, g), (x,), (u,))[1]

    def nontrivial(self) -> None:
        if self.k == 0:
            raise _Skip("the group is trivial (a Lie algebra of dimension 0)")

    # ------------------------------------------------------------------ errors
    def scalar(self, a: Tensor, b: Tensor, scale: Tensor) -> float:
        d = (a.double() - b.double()).abs() / scale.double().clamp_min(_TINY)
        return float(d.max()) if d.numel() else 0.0

    def vector(self, y: Tensor, a: Tensor, b: Tensor, scale: Tensor | None = None) -> float:
        """``max(‖a - b‖_y / ‖s‖_y, ‖a - b‖₂ / ‖s‖₂)`` in float64, ``s = b`` unless given."""
        m = self.m
        y64, d = y.double(), a.double() - b.double()
        s = (b if scale is None else scale).double()
        d, s = (t.expand(torch.broadcast_shapes(t.shape, y64.shape)) for t in (d, s))
        metric = m.norm(y64, d) / m.norm(y64, s).clamp_min(_TINY)
        dims = tuple(range(-m.ndim, 0))
        euclid = torch.linalg.vector_norm(d, dim=dims) / torch.linalg.vector_norm(
            s, dim=dims
        ).clamp_min(_TINY)
        err = torch.maximum(metric, euclid)
        if bool(torch.isnan(err).any()):
            return math.nan
        return float(err.max()) if err.numel() else 0.0

    # ------------------------------------------------------------------ properties
    def checks(self, *, generic: bool, generic_expmap: bool) -> dict[str, Callable[[], float]]:
        m, x, p = self.m, self.x, self.p

        def metric_inv() -> float:
            return self.vector(x, m.metric(p, m.metric_inv(p, self.u)), self.u)

        def isotropic() -> float:
            value = m.inner(p, self.u, self.v)
            exact = m._reduce(self.e1 * self.e2, keepdim=False)
            norms = m._reduce(self.e1.square(), False) * m._reduce(self.e2.square(), False)
            return self.scalar(value, exact, norms.sqrt())

        def vertical() -> Tensor:
            return m.vertical(p, self.omega)

        def proju_horizontal() -> float:
            self.nontrivial()
            vert = vertical()
            value = m.inner(p, m.proju(p, self.u), vert)
            return self.scalar(value, torch.zeros_like(value), m.norm(p, self.u) * m.norm(p, vert))

        def proju_vertical() -> float:
            self.nontrivial()
            vert = vertical()
            return self.vector(x, m.proju(p, vert), torch.zeros_like(vert), vert)

        def proju_idempotent() -> float:
            self.nontrivial()
            pu = m.proju(p, self.u)
            return self.vector(x, m.proju(p, pu), pu, self.u)

        def random_tangent() -> float:
            r = m.random_tangent(p, generator=self.generator)
            return self.vector(x, m.proju(p, r), r)

        def egrad2rgrad() -> float:
            rho = m.egrad2rgrad(p, self.grad)
            horizontal = self.vector(x, m.proju(p, rho), rho)
            h = m.proju(p, self.v)
            value = m.inner(p, rho, h)
            exact = m._reduce(self.grad * h, keepdim=False)
            pairing = self.scalar(value, exact, m.norm(p, rho) * m.norm(p, h))
            return max(horizontal, pairing)

        def action_affine() -> float:
            if "linear" not in self.cache:
                g = self.element()
                moved = m.act(x + self.u, g)
                self.cache["linear"] = self.vector(self.gx, moved - self.gx, self.push(self.u))
            error = self.cache["linear"]
            if not error <= self.linear_rtol:
                raise _Skip(
                    f"the action is not affine in x (relative error {error:.2e}): the "
                    "Christoffel and expmap2 equivariances do not apply"
                )
            return error

        def linear() -> None:
            try:
                action_affine()
            except _Skip:
                raise _Skip("the action is not affine in x") from None

        def metric_invariance() -> float:
            self.element()
            value = m.inner(self.gx, self.push(self.u), self.push(self.v))
            return self.scalar(
                value, m.inner(p, self.u, self.v), m.norm(p, self.u) * m.norm(p, self.v)
            )

        def proju_equivariance() -> float:
            self.nontrivial()
            self.element()
            acted = m.proju(self.gx, self.push(self.u))
            return self.vector(self.gx, acted, self.push(m.proju(p, self.u)))

        def egrad2rgrad_equivariance() -> float:
            self.element()
            gy = m.at(self.gx)
            moved_grad = m.metric(gy, self.push(m.metric_inv(p, self.grad)))
            acted = m.egrad2rgrad(gy, moved_grad)
            return self.vector(self.gx, acted, self.push(m.egrad2rgrad(p, self.grad)))

        def christoffel_equivariance() -> float:
            self.element()
            linear()
            acted = m.christoffel(self.gx, self.push(self.u), self.push(self.v))
            return self.vector(self.gx, acted, self.push(m.christoffel(p, self.u, self.v)))

        def exp_equivariance(method: str) -> float:
            g = self.element()
            if method == "expmap2":
                linear()
            f = getattr(m, method)
            acted = f(self.gx, self.push(self.w)) - self.gx
            expected = m.act(f(p, self.w), g) - self.gx
            return self.vector(self.gx, acted, expected)

        def against_generic(method: str) -> Callable[[], float]:
            def compare() -> float:
                if not generic:
                    raise _Skip("generic=False")
                if isinstance(m, GenericPath):
                    raise _Skip("the manifold is the generic path itself")
                if method == "expmap" and not generic_expmap:
                    raise _Skip("generic_expmap=False (RK4 through autodiff Christoffel symbols)")
                if self._generic is None:
                    self._generic = m.generic()
                gm = self._generic
                if method == "inner":
                    scale = m.norm(p, self.u) * m.norm(p, self.v)
                    return self.scalar(
                        gm.inner(x, self.u, self.v), m.inner(p, self.u, self.v), scale
                    )
                if method == "metric_inv":
                    gp = gm.at(x)
                    return self.vector(x, gm.metric_inv(gp, self.u), m.metric_inv(p, self.u))
                if method == "christoffel_uv":
                    return self.vector(
                        x, gm.christoffel(x, self.w, self.v), m.christoffel(p, self.w, self.v)
                    )
                a, b = getattr(gm, method)(x, self.w), getattr(m, method)(p, self.w)
                if method.startswith("expmap"):
                    a, b = a - x, b - x
                return self.vector(x, a, b)

            return compare

        checks: dict[str, Callable[[], float]] = {
            "metric_inv": metric_inv,
            "isotropic": isotropic,
            "proju_horizontal": proju_horizontal,
            "proju_vertical": proju_vertical,
            "proju_idempotent": proju_idempotent,
            "random_tangent": random_tangent,
            "egrad2rgrad": egrad2rgrad,
            "action_affine": action_affine,
            "metric_invariance": metric_invariance,
            "proju_equivariance": proju_equivariance,
            "egrad2rgrad_equivariance": egrad2rgrad_equivariance,
            "christoffel_equivariance": christoffel_equivariance,
            "expmap2_equivariance": lambda: exp_equivariance("expmap2"),
            "expmap_equivariance": lambda: exp_equivariance("expmap"),
        }
        for name in PROPERTIES:
            if name.startswith("generic."):
                checks[name] = against_generic(name.removeprefix("generic."))
        return checks


_TINY = torch.finfo(torch.float64).tiny
