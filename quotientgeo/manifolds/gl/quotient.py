r"""GL(h) two-factor quotient: pairs ``(G, H)`` that enter a network only through ``G Hᵀ``."""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import torch

from ..base import AtPoint, metric_variant
from ..quotient import Quotient
from .damping import BallDamping, FrameDamping
from .group import GLGroup
from .total import GLTotalSpace

Tensor = torch.Tensor
T = TypeVar("T")

__all__ = ["GLQuotient"]


class GLQuotient(Quotient):
    r"""Quotient of full-rank factor pairs by ``GL(h)``: ``(G, H) ~ (G A⁻¹, H Aᵀ)``.

    A point is one tensor ``x = [G; H]`` of shape ``(..., n+m, h)``, ``G`` its first ``n`` rows;
    leading dimensions are batch dimensions (heads, layers). The quotient is
    ``total / group``: :attr:`total` is the metric's :class:`GLTotalSpace` (layout, metric,
    Christoffel symbols, geodesics), :attr:`group` a :class:`GLGroup` (vertical vectors
    ``(-G Ω, H Ωᵀ)``, the action, random elements). Every metric here is a right
    multiplication ``M(x) u = (u_G W_G, u_H W_H)`` by ``h × h`` SPD weights that transform as
    ``W_G ↦ A W_G Aᵀ``, ``W_H ↦ A⁻ᵀ W_H A⁻¹``, hence invariant. With ``P = GᵀG + eps·I`` and
    ``Q = HᵀH + eps·I``:

    ==================  ======================================  ===========================
    ``metric``          ``(W_G, W_H)``                          class
    ==================  ======================================  ===========================
    ``"inv"``           ``(P⁻¹, Q⁻¹)``                          :class:`GLInvQuotient`
    ``"mix"``           ``(Q, P)``                              :class:`GLMixQuotient`
    ``s ∈ [0, 1]``      ``(1-s)·inv + s·mix``                   :class:`InterpolatedGLQuotient`
    ==================  ======================================  ===========================

    ``GLQuotient(n, metric)`` returns an instance of the class of ``metric`` (in ``__new__``, as
    geoopt's ``Stiefel(canonical=...)`` does); each class adds its closed-form projection.
    ``<η, ζ> = tr(W_G η_Gᵀ ζ_G) + tr(W_H η_Hᵀ ζ_H)``.

    ``eps > 0`` is the relaxation of the paper's Appendix H.2 for (nearly) rank-deficient
    factors: ``P``, ``Q`` are replaced by their relaxed versions in every formula, so the
    action is then only approximately an isometry and the projection only approximately
    idempotent. Use :meth:`at` to reuse the factorizations of a fixed base point.

    Accuracy: the formulas factorize ``P`` and ``Q``, whose condition numbers are ``cond(G)²``
    and ``cond(H)²``, so results carry relative errors of order ``cond² · eps`` of the dtype.
    In float32 that is already 1 % at ``cond ≈ 300``; :meth:`check_point_on_manifold` refuses
    points with ``cond² ≥ 1 / eps``. Compute in float64 or relax with ``eps > 0`` there.

    Args:
        n: number of rows of ``G`` (``m`` follows from the point's shape).
        metric: ``"mix"`` (default), ``"inv"`` or the interpolation weight ``s``.
        eps: Gram relaxation ``≥ 0``; a :class:`~.damping.BallDamping`; or a
            :class:`~.damping.FrameDamping` (``GᵀG + δ(HᵀH)⁻¹``, exactly invariant; the class
            is then :class:`~.framed.FramedGLQuotient`, for every metric).
        exp_steps: RK4 steps of :meth:`geodesic` where it integrates; ``None`` (default)
            chooses them from the velocity for a stated accuracy.
        dense_max: largest ``h²`` for which the generic projection (interpolated metric)
            forms the normal equations densely.
    """

    name = "GLQuotient"
    ndim = 2
    #: The total space of each metric's class.
    total_class: ClassVar[type[GLTotalSpace]] = GLTotalSpace
    _parts: tuple[GLTotalSpace, GLGroup]  # pyright: ignore[reportIncompatibleVariableOverride]

    def __new__(
        cls: type[T], n: int = 1, metric: str | float | None = None, *a: Any, **k: Any
    ) -> T:
        from . import framed, interpolated, inv, mix  # the metrics' classes, which subclass this

        if isinstance(k.get("eps", a[0] if a else None), FrameDamping):
            if cls is not GLQuotient and not issubclass(cls, framed.FramedGLQuotient):
                raise ValueError(f"{cls.__name__} takes no FrameDamping (GLQuotient does)")
            return super().__new__(framed.FramedGLQuotient)  # type: ignore[misc]
        variants = {
            "inv": inv.GLInvQuotient,
            "mix": mix.GLMixQuotient,
            float: interpolated.InterpolatedGLQuotient,
        }
        return super().__new__(metric_variant(cls, GLQuotient, metric, variants))  # type: ignore[misc]

    def __init__(
        self,
        n: int,
        metric: str | float | None = None,
        eps: float | BallDamping | FrameDamping = 0.0,
        *,
        exp_steps: int | None = None,
        dense_max: int = 64,
    ):
        named: dict[str, Any] = {} if metric is None else {"metric": metric}
        total = self.total_class(n, eps=eps, exp_steps=exp_steps, dense_max=dense_max, **named)
        super().__init__(total, GLGroup(total.n), exp_steps=exp_steps, dense_max=dense_max)

    def extra_repr(self) -> str:
        return self._parts[0].extra_repr()

    def with_metric(
        self, metric: str | float, *, eps: float | BallDamping | FrameDamping | None = None
    ) -> GLQuotient:
        """``GLQuotient(n, metric)`` with this one's ``n``, steps and (unless given) ``eps``."""
        return GLQuotient(
            self.n,
            metric,
            self.eps if eps is None else eps,
            exp_steps=self.exp_steps,
            dense_max=self.dense_max,
        )

    # ------------------------------------------------------------------ the total space's layout
    @property
    def total(self) -> GLTotalSpace:
        """The metric's total space."""
        return self._parts[0]

    @property
    def n(self) -> int:
        """Rows of ``G``."""
        return self._parts[0].n

    @property
    def eps(self) -> float | BallDamping | FrameDamping:
        """The Gram relaxation."""
        return self._parts[0].eps

    def split(self, x: Tensor | AtPoint) -> tuple[Tensor, Tensor]:
        """``x = [G; H] ↦ (G, H)`` (:meth:`GLTotalSpace.split`)."""
        return self._parts[0].split(x)

    def join(self, G: Tensor, H: Tensor) -> Tensor:
        """``(G, H) ↦ [G; H]`` (:meth:`GLTotalSpace.join`)."""
        return self._parts[0].join(G, H)

    def grams(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        """``(P, Q)``, cached on ``p`` (:meth:`GLTotalSpace.grams`)."""
        return self._parts[0].grams(p)

    def cholesky_factors(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        """``(L_P, L_Q)``, cached on ``p`` (:meth:`GLTotalSpace.cholesky_factors`)."""
        return self._parts[0].cholesky_factors(p)

    def inverses(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        """``(P⁻¹, Q⁻¹)``, cached on ``p`` (:meth:`GLTotalSpace.inverses`)."""
        return self._parts[0].inverses(p)

    def weights(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        """The metric weights ``(W_G, W_H)`` at ``p`` (:meth:`GLTotalSpace.weights`)."""
        return self._parts[0].weights(p)

    def _blockwise(
        self, u: Tensor, W_G: Tensor, W_H: Tensor, add: Tensor | None = None, *, into: bool = False
    ) -> Tensor:
        return self._parts[0]._blockwise(u, W_G, W_H, add, into=into)
