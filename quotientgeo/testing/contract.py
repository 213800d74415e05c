r"""The contract of a quotient manifold, checked on random vectors and group elements.

:func:`check_quotient` is the test a symmetry must pass, shipped or user-defined: the metric is
invariant under the action, the projection is the metric-orthogonal projection onto the
horizontal space, every map commutes with the action, the isotropic map whitens the metric, and
the closed forms agree with the generic (autodiff) derivation of the base class.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ..manifolds.base import QuotientManifold
from .properties import PROPERTIES, ContractRun, Skipped

Tensor = torch.Tensor

__all__ = ["QuotientReport", "check_quotient"]

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
    run = ContractRun(manifold, x, generator, group, radius, tolerances["action_affine"])
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
            except Skipped as reason:
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
