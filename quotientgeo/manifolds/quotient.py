"""Quotients composed from parts: a total space with a metric, a group acting on it.

- :class:`TotalSpace`: a space with a metric and no group (the trivial group acts);
- :class:`Quotient`: ``total / group``, the metric and geodesics of a total space and the
  Lie-algebra primitives of a :class:`~quotientgeo.manifolds.Group` (as geomstats' fiber
  bundles compose them). Every shipped quotient is one;
- :class:`GenericPath`: a quotient recomputed through the derivations of
  :class:`~quotientgeo.QuotientManifold` (what :meth:`~quotientgeo.QuotientManifold.generic`
  returns), to test closed forms against.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import AtPoint, QuotientManifold
from .groups import DEFAULT_CONDITION, Group, random_element

Tensor = torch.Tensor

__all__ = ["GenericPath", "Quotient", "TotalSpace"]


class TotalSpace(QuotientManifold):
    """A space with a metric on which no group acts: the total space of a :class:`Quotient`.

    A subclass gives the metric (``metric`` and whatever closed forms it has); the Lie algebra
    is empty, so every vector is horizontal and the space is its own (trivial) quotient.
    """

    def lie_shape(self, p: AtPoint) -> tuple[int, ...]:
        """``(0,)``: the trivial group."""
        return (0,)

    def vertical(self, p: AtPoint, omega: Tensor) -> Tensor:
        """The only vertical vector of the trivial group, zero."""
        event = p.x.shape[p.x.dim() - self.ndim :]
        batch = torch.broadcast_shapes(p.x.shape[: p.x.dim() - self.ndim], omega.shape[:-1])
        return p.x.new_zeros(*batch, *event)


class Quotient(QuotientManifold):
    """The quotient of a total space by a group: ``total / group``.

    The total space (a :class:`QuotientManifold`, used only for what does not involve the
    group) gives the metric, its inverse, the isotropic map, ``inner``, the Christoffel symbols,
    the exponential maps and geodesics (with :attr:`closed_form_geodesic`), the metric's name,
    the points (shape, rank and freeness checks, ``random``, ``origin``) and the point cache:
    :meth:`at` returns the total space's :class:`AtPoint`, so a quotient and its total space
    (and every quotient of the same total space object) fill one cache per point. The
    :class:`Group` gives ``lie_shape``, ``vertical``, ``precondition``, ``act``, ``push``,
    ``random_group`` and ``group_name``. The projection, the Riemannian gradient, random
    tangents and the transport are derived by the base class from the two (normal equations of
    the group's vertical space in the total space's metric), unless a subclass has a closed
    form. Geodesics of the total space that start horizontal stay horizontal, so they are the
    quotient's geodesics. Both parts are held outside the module tree (:attr:`total`,
    :attr:`group`).

    Args:
        total: the total space.
        group: the group acting on it.
        exp_steps: as for :class:`QuotientManifold`.
        dense_max: as for :class:`QuotientManifold`.
    """

    def __init__(
        self,
        total: QuotientManifold,
        group: Group,
        *,
        exp_steps: int | None = None,
        dense_max: int = 64,
    ):
        super().__init__(exp_steps=exp_steps, dense_max=dense_max)
        self._parts: tuple[QuotientManifold, Group] = (total, group)
        if total.ndim != self.ndim:
            self.ndim = total.ndim

    @property
    def total(self) -> QuotientManifold:
        """The total space."""
        return self._parts[0]

    @property
    def group(self) -> Group:
        """The group acting on the total space."""
        return self._parts[1]

    @property
    def closed_form_geodesic(self) -> bool:  # type: ignore[override]
        """The total space's."""
        return self._parts[0].closed_form_geodesic

    @property
    def metric_name(self) -> str | float | None:  # pyright: ignore[reportIncompatibleVariableOverride]
        """The total space's."""
        return self._parts[0].metric_name

    # ------------------------------------------------------------------ the group
    def lie_shape(self, p: AtPoint) -> tuple[int, ...]:
        return self._parts[1].lie_shape(p)

    def vertical(self, p: AtPoint, omega: Tensor) -> Tensor:
        return self._parts[1].vertical(p, omega)

    def precondition(self, p: AtPoint, r: Tensor) -> Tensor:
        return self._parts[1].precondition(p, r)

    def act(self, x: Tensor, g: Any) -> Tensor:
        return self._parts[1].act(x, g)

    def push(self, x: Tensor, u: Tensor, g: Any) -> Tensor:
        return self._parts[1].push(x, u, g)

    def random_group(
        self,
        x: Tensor | AtPoint,
        *,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        condition: float = DEFAULT_CONDITION,
    ) -> Any:
        x = x.x if isinstance(x, AtPoint) else x
        return random_element(
            self._parts[1], x, generator=generator, scale=scale, condition=condition
        )

    def group_name(self, shape: tuple[int, ...]) -> str:
        return self._parts[1].group_name(shape)

    # ------------------------------------------------------------------ points
    def at(self, x: Tensor | AtPoint) -> AtPoint:
        """The total space's cached point (its checks), after this quotient's shape check."""
        p = self._parts[0].at(x)
        ok, reason = self._check_shape(p.x.shape, "x")
        if not ok:
            raise ValueError(reason)
        return p

    def _check_shape(self, shape, name):
        return self._parts[0]._check_shape(shape, name)

    def _check_free(self, x: Tensor) -> None:
        self._parts[0]._check_free(x)

    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        return self._parts[0]._check_point_on_manifold(x, atol=atol, rtol=rtol)

    def random(
        self,
        *size: int | tuple[int, ...],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> Tensor:
        return self._parts[0].random(*size, dtype=dtype, device=device, **kwargs)

    def origin(
        self,
        *size: int | tuple[int, ...],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        seed: int = 42,
    ) -> Tensor:
        return self._parts[0].origin(*size, dtype=dtype, device=device, seed=seed)

    # ------------------------------------------------------------------ the total space
    def metric(self, p: AtPoint, u: Tensor) -> Tensor:
        return self._parts[0].metric(p, u)

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        return self._parts[0].metric_inv(p, v)

    def isotropic(self, p: AtPoint, e: Tensor) -> Tensor:
        return self._parts[0].isotropic(p, e)

    def inner(
        self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False
    ) -> Tensor:
        return self._parts[0].inner(self.at(x), u, v, keepdim=keepdim)

    def christoffel(self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None) -> Tensor:
        return self._parts[0].christoffel(self.at(x), u, v)

    def expmap2(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        return self._parts[0].expmap2(self.at(x), u)

    def expmap2_vjp(self, x: Tensor | AtPoint, u: Tensor, d: Tensor) -> Tensor:
        if type(self).expmap2 is not Quotient.expmap2:  # a subclass's own map: autodiff
            return super().expmap2_vjp(x, u, d)
        return self._parts[0].expmap2_vjp(self.at(x), u, d)

    def geodesic(
        self, x: Tensor | AtPoint, u: Tensor, t: float | Tensor = 1.0, *, steps: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """The total space's geodesic (closed form where the total space has one)."""
        return self._parts[0].geodesic(self.at(x), u, t, steps=steps)

    def expmap(self, x: Tensor | AtPoint, u: Tensor, *, steps: int | None = None) -> Tensor:
        return self._parts[0].expmap(self.at(x), u, steps=steps)

    def expmap_vjp(self, x: Tensor | AtPoint, u: Tensor, d: Tensor) -> Tensor:
        if type(self).expmap is not Quotient.expmap:  # a subclass's own map: autodiff
            return super().expmap_vjp(x, u, d)
        return self._parts[0].expmap_vjp(self.at(x), u, d)


class GenericPath(Quotient):
    """The quotient of ``manifold`` with every derived method taken from the base class.

    The composition ``manifold / manifold`` (:class:`Quotient`: ``manifold`` as the total space
    and as the group) with the total space's closed forms switched back to the base class's
    derivations: only the primitives of ``manifold`` (``lie_shape``, ``vertical``, ``metric``,
    ``precondition``, the action and the point checks; ``metric_inv`` too with
    ``metric_inv=True``) are used, and points get their own cache. Comparing
    ``m.generic().proju(x, u)`` with ``m.proju(x, u)`` checks a closed form against an
    independent computation.
    """

    closed_form_geodesic = False  # type: ignore[assignment]  # integrated by RK4

    def __init__(self, manifold: QuotientManifold, *, metric_inv: bool = False):
        super().__init__(
            manifold, manifold, exp_steps=manifold.exp_steps, dense_max=manifold.dense_max
        )
        self.manifold: QuotientManifold = manifold
        self.ndim: int = manifold.ndim
        self.name: str = f"generic {manifold.name}"
        self.own_metric_inv: bool = bool(metric_inv)

    # the base class's derivations, not the total space's closed forms
    at = QuotientManifold.at
    isotropic = QuotientManifold.isotropic
    inner = QuotientManifold.inner
    christoffel = QuotientManifold.christoffel
    expmap2 = QuotientManifold.expmap2
    expmap2_vjp = QuotientManifold.expmap2_vjp
    geodesic = QuotientManifold.geodesic
    expmap = QuotientManifold.expmap
    expmap_vjp = QuotientManifold.expmap_vjp

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        if self.own_metric_inv:
            return self.manifold.metric_inv(p, v)
        return QuotientManifold.metric_inv(self, p, v)
