r"""Damping of the GL(h) metrics scaled to a ball: the relaxation of a pair with a zero factor.

A LoRA adapter ``W + s·B A`` is the GL(r) pair ``G = B``, ``H = Aᵀ``, and PEFT starts it at
``B = 0``. The group still acts freely there (``A`` has full rank), but ``W = B A = 0`` is the
singular point of the rank-``≤ r`` matrices and both metrics degenerate:

- **mix**, ``‖ξ‖² = ‖ξ_G Hᵀ‖² + ‖G ξ_Hᵀ‖²`` for horizontal ``ξ``: at ``G = 0`` moving ``H`` costs
  nothing. Relaxed by ``ε`` (``P = GᵀG + εI``), a ball of radius ``ρ`` reaches ``‖ξ_H‖ = ρ/√ε``
  and the Christoffel term ``-H ξ_Gᵀξ_G P⁻¹`` of the second-order map grows like ``1/ε``: the
  value of a fixed ball has no limit as ``ε → 0``.
- **inv**, ``‖ξ‖² = tr(P⁻¹ ξ_Gᵀξ_G) + tr(Q⁻¹ ξ_Hᵀξ_H)``: ``G = 0`` is infinitely far away, a
  ball reaches ``‖ξ_G‖ = ρ√ε`` and the adapter's contribution vanishes as ``ε → 0``.

:class:`BallDamping` ties the relaxation to the ball: ``ε(x) = (ρ / σ̄(x))²`` with
``σ̄² = (‖G‖² + ‖H‖²) / (2h)``, the mean square singular value of the two factors, computed at
the base point, one ``ε`` per pair. The relaxed mix metric is at least ``ε`` times the
Euclidean one, so its ball moves no factor farther than ``ρ / √ε = σ̄``, whatever ``ρ``; the
relaxed inv ball moves a factor ``F`` at most ``ρ √(‖F‖₂² + ε)``. The relaxation vanishes like
``ρ²`` as the ball shrinks, and at ``B = 0`` mix sharpness over ``ρ`` and inv sharpness over
``ρ²`` then converge. It is not GL(h)-invariant (no relaxation that resolves ``G = 0`` can be:
the orbit of ``(0, H)`` holds ``(0, H Aᵀ)`` at every scale), so measure full-rank pairs with
``eps = 0`` where invariance matters.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ...validation import positive_real

if TYPE_CHECKING:
    from ..base import QuotientManifold

Tensor = torch.Tensor

__all__ = ["BallDamping", "relaxation", "with_ball_filled"]


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


def relaxation(eps: float | BallDamping, G: Tensor, H: Tensor) -> float | Tensor:
    """The Gram relaxation of the pairs ``(G, H)``: ``eps`` itself, or a :class:`BallDamping`'s
    ``ε`` per pair."""
    return eps.of(G, H) if isinstance(eps, BallDamping) else eps


def with_ball_filled(manifold: QuotientManifold, eps: float | BallDamping) -> QuotientManifold:
    """``manifold`` with ``eps`` in place of a ``BallDamping()`` still waiting for its radius
    (what discovery declares for LoRA adapters); any other manifold unchanged. A sharpness ball
    fills in ``BallDamping(ρ)``, an optimizer, which has no ball, a number."""
    declared, metric = getattr(manifold, "eps", None), manifold.metric_name
    if not isinstance(declared, BallDamping) or declared.radius is not None or metric is None:
        return manifold
    return manifold.with_metric(metric, eps=eps)
