r"""The flat geometry of parameters measured in plain Euclidean terms (SAM's perturbation)."""

from __future__ import annotations

import torch

from .base import AtPoint, QuotientManifold

Tensor = torch.Tensor

__all__ = ["EuclideanGeometry"]


class EuclideanGeometry(QuotientManifold):
    r"""Weights ``w`` (shape ``(..., d)``) with the flat metric ``<η, ζ> = Σ η ζ``.

    No group acts (every vector is horizontal), the Riemannian gradient is the Euclidean one,
    ``Γ = 0`` and geodesics are straight lines ``w + ξ``. It is the geometry in which SAM
    (Foret et al. 2021) measures its perturbation ``ρ ∇ / ||∇||``.
    """

    closed_form_geodesic = True

    name = "EuclideanGeometry"
    ndim = 1

    def lie_shape(self, p: AtPoint) -> tuple[int]:
        return (0,)

    def vertical(self, p: AtPoint, omega: Tensor) -> Tensor:
        return torch.zeros_like(p.x)

    def metric(self, p: AtPoint, u: Tensor) -> Tensor:
        return u

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        return v

    def isotropic(self, p: AtPoint, e: Tensor) -> Tensor:
        return e

    def group_name(self, shape: tuple[int, ...]) -> str:
        return "trivial"

    def inner(
        self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False
    ) -> Tensor:
        """``Σ u v`` (for ``v = u`` the square 2-norm)."""
        _, v = self._pair_at(x, u, v)
        if v is u:
            return torch.linalg.vector_norm(u, dim=-1, keepdim=keepdim).square()
        return self._reduce(u * v, keepdim)

    def proju(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        return u

    def egrad2rgrad(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        return u

    def christoffel(self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None) -> Tensor:
        return torch.zeros_like(u)

    def expmap(self, x: Tensor | AtPoint, u: Tensor, *, steps: int | None = None) -> Tensor:
        """``w + ξ``."""
        return self.at(x).x + u

    def expmap2(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        return self.at(x).x + u
