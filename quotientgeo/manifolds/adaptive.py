r"""Element-wise adaptive geometry (Andriushchenko et al., 2023) for parameters without symmetry."""

from __future__ import annotations

import torch

from ..validation import positive_real
from .base import AtPoint, QuotientManifold

Tensor = torch.Tensor

__all__ = ["AdaptiveGeometry"]


class AdaptiveGeometry(QuotientManifold):
    r"""Weights ``w`` (shape ``(..., d)``) with the adaptive metric of adaptive sharpness.

    The metric is :math:`\langle η, ζ \rangle_w = \sum η ζ / ŵ^2` with
    ``ŵ = max(|w|, floor)``. The norm ``||ξ ⊙ ŵ⁻¹||₂`` is the adaptive norm of adaptive
    sharpness, the Riemannian gradient is ``∇ ⊙ ŵ²``, the isotropic map ``e ↦ ŵ e``, and the
    trivial group acts, so every vector is horizontal. The floor keeps the metric finite at
    zero weights: a zero weight can move by at most ``ρ · floor`` inside a ball of radius
    ``ρ`` (Andriushchenko et al. do not move it at all). The default ``1e-12`` is far below
    any weight that matters in float32 or float64.

    The metric is a product of one-dimensional metrics :math:`dw^2 / w^2`, so
    :math:`Γ(ξ, η) = -ξ ⊙ η / w` and the exact geodesic is :math:`w ⊙ \exp(ξ / w)` (away from
    the floor). Adaptive sharpness itself perturbs along straight lines (:meth:`retr`).
    """

    closed_form_geodesic = True

    name = "AdaptiveGeometry"
    ndim = 1

    def __init__(self, floor: float = 1e-12):
        super().__init__()
        self.floor: float = positive_real("floor", floor)

    def extra_repr(self) -> str:
        return f"floor={self.floor}"

    def scale(self, p: AtPoint) -> Tensor:
        """``ŵ = max(|w|, floor)``, cached on ``p``."""
        return p.cached("scale", lambda: p.x.abs().clamp_min(self.floor))

    def scale_squared(self, p: AtPoint) -> Tensor:
        """``ŵ² = max(w², floor²)``, cached on ``p`` (two passes over ``w``, not three)."""
        return p.cached("scale_squared", lambda: p.x.square().clamp_min(self.floor**2))

    def inverse_scale(self, p: AtPoint) -> Tensor:
        """``1 / ŵ``, cached on ``p``."""
        return p.cached("inverse_scale", lambda: self.scale(p).reciprocal())

    # ------------------------------------------------------------------ lists of tensors
    # The element-wise passes of the sharpness-aware optimizer over parameters as they are:
    # one ``_foreach`` operator per formula over a list of tensors (the weights ``w`` of
    # several parameters, flattened or not), no concatenation, and ``ŵ`` in one form only.
    def whitened_gradients(self, w: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
        """``ŵ ⊙ ∇`` for each pair of ``w`` and ``∇`` (new tensors): the Riemannian gradient
        ``ŵ² ∇`` whitened, so that its square 2-norm is the gradient's square metric norm,
        ``||ŵ² ∇||²_w = Σ (ŵ ∇)²``. Three passes: ``|w|``, the floor, the product."""
        out = list(torch._foreach_abs(w))  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_clamp_min_(out, self.floor)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_mul_(out, grads)  # pyright: ignore[reportPrivateImportUsage]
        return out

    def add_scaled_rgrad_(self, w: list[Tensor], grads: list[Tensor], c: Tensor) -> None:
        """``w ← w + c ŵ² ∇`` in place, for each pair of ``w`` and ``∇`` (``c`` a 0-dim
        tensor): the straight step along the Riemannian gradient. Four passes: ``w²``, the
        floor ``max(w², floor²) = ŵ²``, the factor ``c``, and ``w + (c ŵ²) ⊙ ∇``."""
        s = torch._foreach_mul(w, w)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_clamp_min_(s, self.floor**2)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_mul_(s, c)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_addcmul_(w, s, grads)  # pyright: ignore[reportPrivateImportUsage]

    def lie_shape(self, p: AtPoint) -> tuple[int]:
        return (0,)

    def vertical(self, p: AtPoint, omega: Tensor) -> Tensor:
        return torch.zeros_like(p.x)

    def metric(self, p: AtPoint, u: Tensor) -> Tensor:
        """``u / ŵ²``."""
        return u / self.scale_squared(p)

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        """``v ⊙ ŵ²``."""
        return v * self.scale_squared(p)

    def isotropic(self, p: AtPoint, e: Tensor) -> Tensor:
        """``ŵ e``."""
        return e * self.scale(p)

    def inner(
        self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False
    ) -> Tensor:
        """``Σ u v / ŵ²``; for ``v = u`` the square norm of ``u / ŵ``, in two passes over ``u``
        (this is the ball norm of adaptive sharpness, on every iteration's hot path), with
        ``ŵ`` the one form of the scale that it needs."""
        p, v = self._pair_at(x, u, v)
        if v is u:
            whitened = u / self.scale(p)
            if whitened.dim() == 1 and not keepdim:  # a vector (a piece): one product
                return torch.dot(whitened, whitened)
            dims = tuple(range(-self.ndim, 0))
            return torch.linalg.vector_norm(whitened, dim=dims, keepdim=keepdim).square()
        return self._reduce(u * v / self.scale_squared(p), keepdim)

    def christoffel(self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None) -> Tensor:
        """``-u ⊙ v / w`` (with ``|w|`` floored, sign kept)."""
        p = self.at(x)
        v = u if v is None else v
        return -u * v * torch.sign(p.x) / self.scale(p)

    def expmap(self, x: Tensor | AtPoint, u: Tensor, *, steps: int | None = None) -> Tensor:
        """``w ⊙ exp(ξ / w)`` (``|w|`` floored, sign kept)."""
        p = self.at(x)
        w = torch.where(p.x < 0, -self.scale(p), self.scale(p))
        return w * torch.exp(u / w)
