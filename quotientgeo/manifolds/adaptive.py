r"""Element-wise adaptive geometry (Andriushchenko et al., 2023) for parameters without symmetry."""

from __future__ import annotations

import torch

from .base import QuotientManifold, as_tensor

Tensor = torch.Tensor

__all__ = ["AdaptiveGeometry"]


class AdaptiveGeometry(QuotientManifold):
    r"""Weights ``w`` (shape ``(..., d)``) with the metric ``<η, ζ>_w = Σ η ζ / ŵ²``.

    ``ŵ = max(|w|, floor)``: the norm ``||ξ ⊙ ŵ⁻¹||₂`` is the adaptive norm of adaptive
    sharpness, the Riemannian gradient is ``∇ ⊙ ŵ²`` and the trivial group acts, so every vector
    is horizontal. The floor keeps the metric finite at zero weights: a zero weight can move by
    at most ``ρ · floor`` inside a ball of radius ``ρ`` (Andriushchenko et al. do not move it at
    all). The default ``1e-12`` is far below any weight that matters in float32 or float64.

    The metric is a product of one-dimensional metrics ``dw² / w²``, so
    ``Γ(ξ, η) = -ξ ⊙ η / w`` and the exact geodesic is ``w ⊙ exp(ξ / w)`` (away from the floor).
    Adaptive sharpness itself perturbs along straight lines (:meth:`retr`).
    """

    name = "AdaptiveGeometry"
    ndim = 1

    def __init__(self, floor: float = 1e-12):
        if not floor > 0:
            raise ValueError(f"floor must be > 0, got {floor!r}")
        super().__init__()
        self.floor = float(floor)

    def extra_repr(self) -> str:
        return f"floor={self.floor}"

    def _scale(self, x) -> Tensor:
        return as_tensor(x).abs().clamp_min(self.floor)

    def lie_shape(self, x) -> tuple[int]:
        return (0,)

    def vertical(self, x, omega: Tensor) -> Tensor:
        return torch.zeros_like(as_tensor(x))

    def metric(self, x, u: Tensor) -> Tensor:
        """``u / ŵ²``."""
        return u / self._scale(x).square()

    def metric_inv(self, x, v: Tensor) -> Tensor:
        """``v ⊙ ŵ²``."""
        return v * self._scale(x).square()

    def proju(self, x, u: Tensor) -> Tensor:
        """Every vector is horizontal: the identity."""
        self._check_vector(self.at(x), u)
        return u

    def egrad2rgrad(self, x, u: Tensor) -> Tensor:
        """``∇ ⊙ ŵ²``."""
        return self.metric_inv(x, u)

    def christoffel(self, x, u: Tensor, v: Tensor | None = None) -> Tensor:
        """``-u ⊙ v / w`` (with ``|w|`` floored, sign kept)."""
        x = as_tensor(x)
        v = u if v is None else v
        return -u * v * torch.sign(x) / self._scale(x)

    def expmap(self, x, u: Tensor, *, steps: int | None = None) -> Tensor:
        """``w ⊙ exp(ξ / w)`` (``|w|`` floored, sign kept)."""
        x = as_tensor(x)
        w = torch.where(x < 0, -self._scale(x), self._scale(x))
        return w * torch.exp(u / w)
