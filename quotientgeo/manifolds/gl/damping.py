r"""Dampings of the GL(h) metrics scaled to a ball: pairs with a zero factor (LoRA at ``B = 0``).

A LoRA adapter ``W + s·B A`` is the GL(r) pair ``G = B``, ``H = Aᵀ``, and PEFT starts it at
``B = 0``. The group still acts freely there (``A`` has full rank), but ``W = B A = 0`` is the
singular point of the rank-``≤ r`` matrices and both metrics degenerate:

- **mix**, ``‖ξ‖² = ‖ξ_G Hᵀ‖² + ‖G ξ_Hᵀ‖²`` for horizontal ``ξ``: at ``G = 0`` moving ``H`` costs
  nothing;
- **inv**, ``‖ξ‖² = tr(P⁻¹ ξ_Gᵀξ_G) + tr(Q⁻¹ ξ_Hᵀξ_H)``: ``G = 0`` is infinitely far away.

Two dampings, both of which take their radius ``ρ`` from the ball the pair is perturbed in:

- :class:`FrameDamping` (the default of LoRA pairs): ``P = GᵀG`` becomes
  ``P_δ = GᵀG + δ Q⁻¹``, ``δ = (ρ/κ)²``: ``G``'s Gram is damped in ``H``'s own frame. ``P_δ``
  transforms as ``GᵀG`` does, so every metric stays exactly GL(h)-invariant wherever ``H`` has
  full rank, also at ``G = 0`` (:mod:`.framed`).
- :class:`BallDamping`: ``P + εI``, ``Q + εI`` with ``ε = (ρ/σ̄)²``,
  ``σ̄² = (‖G‖² + ‖H‖²) / (2h)``. It is not GL(h)-invariant (``σ̄`` and ``I`` change along an
  orbit), at a relative size that shrinks like ``ρ²``; kept for comparison and for pairs
  in which either factor may vanish.

A relaxation ``εI`` that resolves ``G = 0`` cannot be invariant (the orbit of ``(0, H)`` holds
``(0, H Aᵀ)`` at every scale); ``δ Q⁻¹`` is, because it borrows its scale from ``H``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ...validation import positive_real

if TYPE_CHECKING:
    from ..base import QuotientManifold

Tensor = torch.Tensor

__all__ = [
    "BallDamping",
    "FrameDamping",
    "relaxation",
    "waiting",
    "with_ball_filled",
    "without_ball",
]


@dataclasses.dataclass(frozen=True)
class BallDamping:
    r"""The Gram relaxation ``ε(x) = (ρ / σ̄(x))²`` of a GL pair, ``σ̄² = (‖G‖² + ‖H‖²) / (2h)``.

    Pass it as the ``eps`` of a GL manifold. ``radius=None`` (what discovery declares for LoRA
    adapters) takes ``ρ`` from the ball the pair is perturbed in: the sharpness measures and
    :class:`~quotientgeo.optim.GeodesicSAM` fill in their radius. Outside a ball, give the
    radius.

    Args:
        radius: ``ρ > 0``, or ``None`` for the radius of the ball.
    """

    radius: float | None = None

    def __post_init__(self):
        if self.radius is not None:
            object.__setattr__(self, "radius", positive_real("radius", self.radius))

    def of(self, G: Tensor, H: Tensor) -> Tensor:
        """``ε`` of each pair, shape ``(..., 1, 1)``: ``ρ² · 2h / (‖G‖² + ‖H‖²)``."""
        if self.radius is None:
            raise ValueError(
                "BallDamping() takes its radius from the ball it is measured in; outside a "
                "sharpness measure or GeodesicSAM, give it: BallDamping(radius=rho)"
            )
        h = G.shape[-1]
        square = G.pow(2).sum((-2, -1), keepdim=True) + H.pow(2).sum((-2, -1), keepdim=True)
        if not bool((square > 0).all()):
            raise ValueError("BallDamping needs a pair with a nonzero factor (G = H = 0 given)")
        return (2 * h * self.radius**2) / square


@dataclasses.dataclass(frozen=True)
class FrameDamping:
    r"""The frame damping ``P_δ = GᵀG + δ Q⁻¹`` of a GL pair, ``δ = (ρ/κ)²``, ``Q = HᵀH``.

    Pass it as the ``eps`` of :class:`~quotientgeo.GLQuotient`; the geometry is
    :class:`~quotientgeo.manifolds.gl.framed.FramedGLQuotient`. ``G`` may be zero or rank
    deficient, ``H`` must have full column rank. For a LoRA pair (``G = B``, ``H = Aᵀ``) the mix
    metric gains ``(ρ/κ)² ‖A⁺ξ_A‖²``, the inv metric's term for ``A``, so the mix ball moves ``A``
    at most ``κ`` in its own frame (``‖A⁺ξ_A‖ ≤ κ``). ``δ Q⁻¹`` transforms as ``GᵀG`` under
    ``(G, H) ↦ (G M⁻¹, H Mᵀ)``, so the damped metrics are exactly GL(h)-invariant.

    Args:
        radius: ``ρ > 0``, or ``None`` (what discovery declares) for the radius of the ball:
            the sharpness measures and :class:`~quotientgeo.optim.GeodesicSAM` fill in theirs.
        reach: ``κ > 0``, the largest move of ``H`` in its own frame that the mix ball allows
            (default ``½``). At ``G = 0`` the gradient of ``H`` vanishes and the second-order
            map turns ``H`` by its Christoffel term, up to ``κ²/2`` of ``H`` in its frame:
            ``½`` keeps that turn to an eighth and PEFT's first GeodesicSAM steps as they
            were with ``BallDamping()``; larger ``κ`` is closer to the undamped quotient, in
            which ``H`` turns freely at ``G = 0``.
    """

    radius: float | None = None
    reach: float = 0.5

    def __post_init__(self):
        if self.radius is not None:
            object.__setattr__(self, "radius", positive_real("radius", self.radius))
        object.__setattr__(self, "reach", positive_real("reach", self.reach))

    @property
    def delta(self) -> float:
        """``δ = (ρ/κ)²``."""
        if self.radius is None:
            raise ValueError(
                "FrameDamping() takes its radius from the ball it is measured in; outside a "
                "sharpness measure or GeodesicSAM, give it: FrameDamping(radius=rho)"
            )
        return (self.radius / self.reach) ** 2


def relaxation(eps: float | BallDamping, G: Tensor, H: Tensor) -> float | Tensor:
    """The Gram relaxation of the pairs ``(G, H)``: ``eps`` itself, or a :class:`BallDamping`'s
    ``ε`` per pair."""
    return eps.of(G, H) if isinstance(eps, BallDamping) else eps


def waiting(eps: object) -> bool:
    """Whether ``eps`` is a damping still waiting for a ball's radius (``radius=None``)."""
    return isinstance(eps, (BallDamping, FrameDamping)) and eps.radius is None


def with_ball_filled(manifold: QuotientManifold, radius: float) -> QuotientManifold:
    """``manifold`` with its declared damping given the ball's ``radius`` where that damping
    still waits for it (what discovery declares for LoRA adapters); any other manifold
    unchanged."""
    declared, metric = getattr(manifold, "eps", None), manifold.metric_name
    if not isinstance(declared, (BallDamping, FrameDamping)) or not waiting(declared):
        return manifold
    if metric is None:
        return manifold
    return manifold.with_metric(metric, eps=dataclasses.replace(declared, radius=radius))


def without_ball(manifold: QuotientManifold, eps: float) -> QuotientManifold:
    """``manifold`` relaxed by the number ``eps`` in place of a damping still waiting for a
    ball's radius (an optimizer has no ball); any other manifold unchanged."""
    declared, metric = getattr(manifold, "eps", None), manifold.metric_name
    if not waiting(declared) or metric is None:
        return manifold
    return manifold.with_metric(metric, eps=eps)
