r"""Element-wise GL(1) re-scaling quotient of diagonal networks ``y = xᵀ(u ⊙ v)``.

``RescaleQuotient(metric)`` is ``total / group``: the metric's total space
(:class:`RescaleInvTotalSpace`, :class:`RescaleMixTotalSpace`) by :class:`RescaleGroup`.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import torch

from .base import AtPoint, metric_variant
from .gl.damping import BallDamping, FrameDamping
from .groups import DEFAULT_CONDITION, random_exp
from .quotient import Quotient, TotalSpace

Tensor = torch.Tensor
T = TypeVar("T")

__all__ = [
    "RescaleGroup",
    "RescaleInvQuotient",
    "RescaleInvTotalSpace",
    "RescaleMixQuotient",
    "RescaleMixTotalSpace",
    "RescaleQuotient",
    "RescaleTotalSpace",
]


class RescaleTotalSpace(TotalSpace):
    r"""Pairs ``x = [u; v]`` of shape ``(..., 2, d)`` with non-zero entries and a diagonal metric
    ``M(x) u = u ⊙ m(x)`` (each metric's class gives ``m``), so the isotropic map is
    ``e / √m(x)``; the total space of :class:`RescaleQuotient`."""

    closed_form_geodesic = True

    name = "RescaleTotalSpace"
    ndim = 2

    def __init__(self, *, exp_steps: int | None = None):
        super().__init__(exp_steps=exp_steps)

    def extra_repr(self) -> str:
        return f"metric={self.metric_name!r}"

    def split(self, x: Tensor | AtPoint) -> tuple[Tensor, Tensor]:
        """``[u; v] ↦ (u, v)``."""
        x = x.x if isinstance(x, AtPoint) else x
        return x[..., 0, :], x[..., 1, :]

    def join(self, u: Tensor, v: Tensor) -> Tensor:
        """``(u, v) ↦ [u; v]``."""
        return torch.stack((u, v), dim=-2)

    def _check_shape(self, shape, name):
        if len(shape) < 2 or shape[-2] != 2:
            return False, f"{name} must have shape (..., 2, d) holding [u; v], got {tuple(shape)}"
        return True, None

    def isotropic(self, p: AtPoint, e: Tensor) -> Tensor:
        """``e / √m(x)`` for the diagonal metric ``M(x) u = u ⊙ m(x)``."""
        return e * self.metric_inv(p, torch.ones_like(p.x)).sqrt()

    def _check_free(self, x: Tensor) -> None:
        if not bool((x != 0).all()):
            raise ValueError(
                "the point has zero entries: the re-scaling action is not free there and the "
                "projection b = ½ (ξ_u / u + ξ_v / v) is undefined"
            )

    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        """Entries finite and non-zero (the action is free only there)."""
        x = x.x if isinstance(x, AtPoint) else x
        if not bool(torch.isfinite(x).all()):
            return False, "the point has non-finite entries"
        if x.numel() == 0:
            return True, None
        smallest = x.abs().min().item()
        if smallest == 0:
            return False, "the point has zero entries; the re-scaling action is not free there"
        return True, f"smallest |entry| = {smallest:.3e}"


class RescaleInvTotalSpace(RescaleTotalSpace):
    r"""The ``"inv"`` metric ``<η, ζ> = Σ η_u ζ_u / u² + η_v ζ_v / v²``.

    Each entry is a one-dimensional metric ``dw² / w²``: ``Γ(ξ, η) = -ξ ⊙ η / x`` and the exact
    geodesic is ``x ⊙ exp(t ξ / x)``.
    """

    name = "RescaleInvTotalSpace"
    metric_name = "inv"

    def metric(self, p: AtPoint, u: Tensor) -> Tensor:
        """``u / x²``."""
        return u / p.x.square()

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        """``v ⊙ x²``."""
        return v * p.x.square()

    def christoffel(self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None) -> Tensor:
        """``-u ⊙ v / x``."""
        p = self.at(x)
        self._check_vector(p, u)
        return -u * (u if v is None else v) / p.x

    def expmap(self, x: Tensor | AtPoint, u: Tensor, *, steps: int | None = None) -> Tensor:
        """Exact geodesic ``x ⊙ exp(ξ / x)`` (``steps`` unused)."""
        p = self.at(x)
        self._check_vector(p, u)
        return p.x * torch.exp(u / p.x)


class RescaleMixTotalSpace(RescaleTotalSpace):
    r"""The ``"mix"`` metric ``<η, ζ> = Σ η_u ζ_u v² + η_v ζ_v u²``.

    ``Γ_u(ξ, η) = (ξ_u η_v + η_u ξ_v) / v - ξ_v η_v u / v²`` (``Γ_v``: swap u and v).
    In the coordinates ``p = u v``, ``r = log|u / v|`` the metric is ``½ (dp² + p² dr²)``,
    polar coordinates of a flat plane, so geodesics are straight lines there: with
    ``a = ξ / x`` and ``c = 1 + t (a_u + a_v) + i t (a_u - a_v)``,
    ``γ(t) = (u √|c| e^{arg(c)/2}, v √|c| e^{-arg(c)/2})``, which for horizontal ``ξ`` is
    ``x √(1 + 2 b t)`` (defined while the line avoids ``p = 0``, i.e. ``1 + 2bt > 0``).
    Lines through ``p = 0`` (``a_u = a_v``, ``1 + 2 a_u ≤ 0``) have no unique continuation:
    :meth:`expmap` returns there the limit of the lines that pass it with ``a_u > a_v``
    (``arg c = π``), and ``0`` if ``c = 0``.
    """

    name = "RescaleMixTotalSpace"
    metric_name = "mix"

    def metric(self, p: AtPoint, u: Tensor) -> Tensor:
        """``(u_u v², u_v u²)``."""
        return u * p.x.flip(-2).square()

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        """``(v_u / v², v_v / u²)``."""
        return v / p.x.flip(-2).square()

    def christoffel(self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None) -> Tensor:
        """``(u_u v_v + v_u u_v) / x̃ - (u ⊙ v)~ ⊙ x / x̃²`` (``~``: swap the rows)."""
        p = self.at(x)
        self._check_vector(p, u)
        v = u if v is None else v
        X_swap = p.x.flip(-2)
        cross = (u * v.flip(-2)).sum(dim=-2, keepdim=True)
        return cross / X_swap - (u * v).flip(-2) * p.x / X_swap.square()

    def expmap(self, x: Tensor | AtPoint, u: Tensor, *, steps: int | None = None) -> Tensor:
        """Exact geodesic at ``t = 1`` (class docstring; ``steps`` unused)."""
        p = self.at(x)
        self._check_vector(p, u)
        a = u / p.x
        a_u, a_v = a[..., :1, :], a[..., 1:, :]
        re, im = 1 + a_u + a_v, a_u - a_v
        angle = torch.atan2(im, re)
        return p.x * torch.hypot(re, im).sqrt() * torch.exp(0.5 * torch.cat((angle, -angle), -2))


class RescaleGroup:
    """``GL(1)^d`` acting on pairs ``x = [u; v]`` by ``(u, v) ↦ (α u, v / α)``, ``α ≠ 0``.

    Lie algebra ``R^d`` (``ω`` of shape ``(d,)``), vertical vectors ``(-u ω, v ω)``; the
    differential of the action is the same map on tangent vectors.
    """

    def __repr__(self) -> str:
        return "RescaleGroup()"

    def lie_shape(self, p: AtPoint) -> tuple[int]:
        return (p.x.shape[-1],)

    def vertical(self, p: AtPoint, omega: Tensor) -> Tensor:
        """``(-u ω, v ω)``."""
        return p.x * torch.stack((-omega, omega), dim=-2)

    def precondition(self, p: AtPoint, r: Tensor) -> Tensor:
        return r

    def act(self, x: Tensor, alpha: Tensor) -> Tensor:
        """``(u, v) ↦ (α u, v / α)`` for ``α`` of shape ``(..., d)``."""
        return x * torch.stack((alpha, alpha.reciprocal()), dim=-2)

    def push(self, x: Tensor, u: Tensor, alpha: Tensor) -> Tensor:
        """Differential of the action: ``(ξ_u, ξ_v) ↦ (α ξ_u, ξ_v / α)``."""
        return self.act(u, alpha)

    def random_group(
        self,
        x: Tensor | AtPoint,
        *,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        condition: float = DEFAULT_CONDITION,
    ) -> Tensor:
        """``α = scale · exp(ω)``, ``ω`` uniform in ``[-½ log c, ½ log c]`` per entry
        (``quotientgeo.manifolds.groups.random_exp``)."""
        x = x.x if isinstance(x, AtPoint) else x
        kw = {"generator": generator, "dtype": x.dtype, "device": x.device}
        return random_exp((x.shape[-1],), x.shape[:-2], scale=scale, condition=condition, **kw)

    def group_name(self, shape: tuple[int, ...]) -> str:
        return f"GL(1)^{shape[-1]}"


class RescaleQuotient(Quotient):
    r"""Quotient of pairs ``(u, v)`` by element-wise re-scaling ``(α u, v / α)``, ``α ≠ 0``.

    A point is ``x = [u; v]`` of shape ``(..., 2, d)`` with non-zero entries; the network
    only uses ``β = u ⊙ v``. Vertical vectors ``(-u ω, v ω)`` (:class:`RescaleGroup`); both
    metrics (the total spaces :class:`RescaleInvTotalSpace`, :class:`RescaleMixTotalSpace`) share
    the horizontal space ``η_u / u = η_v / v``, so the projection is the same for both:
    :math:`\operatorname{proj}(ξ) = (u b, v b)` with :math:`b = \tfrac12 (ξ_u / u + ξ_v / v)`.
    ``RescaleQuotient(metric)`` returns :class:`RescaleMixQuotient` (``"mix"``, default) or
    :class:`RescaleInvQuotient` (``"inv"``), chosen in ``__new__``.
    """

    name = "RescaleQuotient"
    ndim = 2
    #: The total space of each metric's class.
    total_class: ClassVar[type[RescaleTotalSpace]]
    _parts: tuple[RescaleTotalSpace, RescaleGroup]  # pyright: ignore[reportIncompatibleVariableOverride]

    def __new__(cls: type[T], metric: str | float | None = None, *a: Any, **k: Any) -> T:
        variants = {"inv": RescaleInvQuotient, "mix": RescaleMixQuotient}
        return super().__new__(metric_variant(cls, RescaleQuotient, metric, variants))  # type: ignore[misc]

    def __init__(self, metric: str | float | None = None, *, exp_steps: int | None = None):
        super().__init__(self.total_class(exp_steps=exp_steps), RescaleGroup(), exp_steps=exp_steps)

    def extra_repr(self) -> str:
        return self._parts[0].extra_repr()

    def with_metric(
        self, metric: str | float, *, eps: float | BallDamping | FrameDamping | None = None
    ) -> RescaleQuotient:
        """``RescaleQuotient(metric)`` (``eps`` does not apply)."""
        return RescaleQuotient(metric, exp_steps=self.exp_steps)

    def split(self, x: Tensor | AtPoint) -> tuple[Tensor, Tensor]:
        """``[u; v] ↦ (u, v)``."""
        return self._parts[0].split(x)

    def join(self, u: Tensor, v: Tensor) -> Tensor:
        """``(u, v) ↦ [u; v]``."""
        return self._parts[0].join(u, v)

    def proju(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        """``(u b, v b)`` with ``b = ½ (ξ_u / u + ξ_v / v)``."""
        p = self.at(x)
        self._check_vector(p, u)
        return p.x * (u / p.x).mean(dim=-2, keepdim=True)


class RescaleInvQuotient(RescaleQuotient):
    """``RescaleQuotient("inv")``: :class:`RescaleInvTotalSpace` by :class:`RescaleGroup`."""

    total_class = RescaleInvTotalSpace


class RescaleMixQuotient(RescaleQuotient):
    """``RescaleQuotient("mix")``: :class:`RescaleMixTotalSpace` by :class:`RescaleGroup`."""

    total_class = RescaleMixTotalSpace
