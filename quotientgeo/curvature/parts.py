r"""The geometry of each part of the coordinates at the base point, as the Hessian needs it.

A part is one kind of symmetry blocks (its points ``x``, on a quotient manifold), or the
adaptive rest ``w``. Each gives, through the manifold API only:

- ``tangent(z) = P^h T z``: whitened coordinates ``z`` to a horizontal tangent vector, with
  ``T`` the manifold's isotropic map (``Tᵀ G T = I``; for the GL kinds a triangular solve with
  the cached Cholesky factor of each head's ``h × h`` metric weight) and ``P^h`` the horizontal
  projection. Its Euclidean adjoint ``Tᵀ (P^h)ᵀ`` is a vector-Jacobian product of this map;
- ``connection(ξ)``: the covector ``c`` with ``⟨c, η⟩ = ∇f · Γ(η, ξ)`` for every ``η``, from
  the Christoffel contraction: ``c = ½ ∇_u (∇f · Γ(u, u))`` at ``u = ξ`` (``Γ`` is symmetric
  bilinear);
- ``riemannian(c) = P^h G⁻¹ c``: a covector to the horizontal tangent vector it represents
  (the manifold's ``egrad2rgrad``).

Three kinds of part: :class:`QuotientPart` (a kind of symmetry blocks in its metric),
:class:`FrozenPart` (the adaptive rest: the element-wise metric ``1/ŵ²`` frozen at the base
point and straight lines, ``Γ = 0``, as the sharpness measures move it) and :class:`FlatPart`
(the Euclidean metric, ``Γ = 0``).
"""

from __future__ import annotations

import torch

from ..manifolds import AdaptiveGeometry, QuotientManifold

Tensor = torch.Tensor

__all__ = ["FlatPart", "FrozenPart", "Part", "QuotientPart"]


class Part:
    """The Euclidean default of every method (``G = I``, ``Γ = 0``, no projection)."""

    def tangent(self, z: Tensor) -> Tensor:
        return z

    def project(self, xi: Tensor) -> Tensor:
        """The horizontal part of ``ξ`` (``P^h ξ``)."""
        return xi

    def connection(self, xi: Tensor) -> Tensor | None:
        """``c`` with ``⟨c, η⟩ = ∇f · Γ(η, ξ)``; ``None`` where ``Γ = 0``."""
        return None

    def riemannian(self, c: Tensor) -> Tensor:
        return c

    def metric(self, xi: Tensor) -> Tensor:
        """``G ξ``."""
        return xi

    def whiten(self, xi: Tensor) -> Tensor:
        """``Tᵀ G ξ``: the whitened coordinates of ``ξ`` (``tangent(whiten(ξ)) = ξ`` for a
        horizontal ``ξ``)."""
        return xi


class FlatPart(Part):
    """Euclidean coordinates: the plain Hessian."""


class FrozenPart(Part):
    """The adaptive rest: metric ``diag(1/ŵ²)`` at the base point, straight lines."""

    def __init__(self, w: Tensor, manifold: AdaptiveGeometry):
        self.manifold = manifold
        self.point = manifold.at(w)

    def tangent(self, z: Tensor) -> Tensor:
        return self.manifold.isotropic(self.point, z)

    def riemannian(self, c: Tensor) -> Tensor:
        return self.manifold.metric_inv(self.point, c)

    def metric(self, xi: Tensor) -> Tensor:
        return self.manifold.metric(self.point, xi)

    def whiten(self, xi: Tensor) -> Tensor:
        return xi / self.manifold.scale(self.point)


class QuotientPart(Part):
    """A kind of symmetry blocks at its points ``x``, with the loss gradient ``∇f`` there."""

    def __init__(self, x: Tensor, manifold: QuotientManifold, gradient: Tensor):
        self.manifold = manifold
        self.point = manifold.at(x)
        self.gradient = gradient

    def tangent(self, z: Tensor) -> Tensor:
        return self.manifold.proju(self.point, self.manifold.isotropic(self.point, z))

    def project(self, xi: Tensor) -> Tensor:
        return self.manifold.proju(self.point, xi)

    def connection(self, xi: Tensor) -> Tensor:
        with torch.enable_grad():
            u = xi.detach().requires_grad_(True)
            form = (self.gradient * self.manifold.christoffel(self.point, u)).sum()
            (c,) = torch.autograd.grad(form, u)
        return 0.5 * c

    def riemannian(self, c: Tensor) -> Tensor:
        return self.manifold.egrad2rgrad(self.point, c)

    def metric(self, xi: Tensor) -> Tensor:
        return self.manifold.metric(self.point, xi)

    def whiten(self, xi: Tensor) -> Tensor:
        with torch.enable_grad():
            e = torch.zeros_like(xi).requires_grad_(True)
            image = self.manifold.isotropic(self.point, e)
            (out,) = torch.autograd.grad(image, e, self.metric(xi))
        return out
