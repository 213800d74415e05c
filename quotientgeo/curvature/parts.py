r"""The geometry of each part of the coordinates at the base point, as the Hessian needs it.

A part is one kind of symmetry blocks (its points ``x``, on a quotient manifold), or the
adaptive rest ``w``. Each gives, through the manifold API only:

- ``tangent(z) = P^h T z``: whitened coordinates ``z`` to a horizontal tangent vector, with
  ``T`` the manifold's isotropic map (``Tᵀ G T = I``; for the GL kinds a triangular solve with
  the cached Cholesky factor of each head's ``h × h`` metric weight) and ``P^h`` the horizontal
  projection. Its Euclidean adjoint ``Tᵀ (P^h)ᵀ`` is a vector-Jacobian product of this map;
- ``connection(ξ, ∇f)``: the covector ``c`` with ``⟨c, η⟩ = ∇f · Γ(η, ξ)`` for every ``η``,
  from the Christoffel contraction: ``c = ½ ∇_u (∇f · Γ(u, u))`` at ``u = ξ`` (``Γ`` is
  symmetric bilinear; ``∇f`` the part's gradient, the caller's);
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

    #: Whether ``tangent`` is a symmetric (diagonal) map, its own Euclidean adjoint: then
    #: ``Tᵀ (P^h)ᵀ c = tangent(c)``, no vector-Jacobian product needed.
    symmetric = True

    def tangent(self, z: Tensor) -> Tensor:
        return z

    def tangent_into(self, z: Tensor, out: Tensor) -> Tensor:
        """``tangent(z)`` written into ``out`` (of ``z``'s shape)."""
        return out.copy_(self.tangent(z))

    def displaced(self, x: Tensor, z: Tensor, s: Tensor) -> Tensor:
        """``x + s · tangent(z)``, a new tensor (``s`` a scalar tensor); for an element-wise
        ``tangent``, ``x`` and ``z`` may be matching slices of the part's point and vector."""
        return torch.addcmul(x, self.tangent(z), s)

    def displaced_into_(
        self, out: list[Tensor], x: list[Tensor], z: list[Tensor], s: Tensor
    ) -> None:
        """``out[i] = x[i] + s · tangent(z[i])`` in place, for an element-wise ``tangent``
        (``x[i]``, ``z[i]`` matching slices of the point and the vector): fused operations
        over the list, no temporary."""
        torch._foreach_copy_(out, z)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_mul_(out, s)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_add_(out, x)  # pyright: ignore[reportPrivateImportUsage]

    def addmv_(
        self,
        out: list[Tensor],
        x: list[Tensor],
        c: list[Tensor],
        s: Tensor,
        beta: float,
        scratch: Tensor,
    ) -> None:
        """``out[i] ← β · out[i] + s · tangent(c[i])`` in place, for an element-wise
        ``tangent`` (``x[i]`` the matching slices of the point, ``c[i]`` of any floating dtype,
        widened to ``out``'s before it is scaled). ``β = 0`` forms the image in ``out`` itself
        (its values never read); otherwise in ``scratch``, a flat buffer of ``out``'s dtype
        with at least ``Σ numel`` entries."""
        tmp = out if beta == 0 else _views(scratch, out)
        torch._foreach_copy_(tmp, c)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_mul_(tmp, s)  # pyright: ignore[reportPrivateImportUsage]
        _combine_(out, tmp, beta)

    def project(self, xi: Tensor) -> Tensor:
        """The horizontal part of ``ξ`` (``P^h ξ``)."""
        return xi

    def release(self) -> None:
        """Forget what the part has computed from its base point (the symmetry blocks' ``h × h``
        factors), to be computed again when next needed; nothing for the element-wise parts."""

    def connection(self, xi: Tensor, gradient: Tensor | None) -> Tensor | None:
        """``c`` with ``⟨c, η⟩ = ∇f · Γ(η, ξ)`` (``gradient`` the part's ``∇f``); ``None``
        where ``Γ = 0``."""
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
    """The adaptive rest: metric ``diag(1/ŵ²)`` at the base point, straight lines.

    ``ŵ = max(|w|, floor)`` is not kept (it is the size of ``w``): each method forms it anew,
    in ``dtype`` (``w`` may be kept narrower, in the parameters' own dtype, where that holds
    it exactly). :meth:`tangent_into` and :meth:`displaced` form ``T z = ŵ ⊙ z`` in the tensor
    they return, with no other temporary (for :class:`~quotientgeo.AdaptiveGeometry` itself; a
    subclass that redefines the scale goes through its methods)."""

    def __init__(self, w: Tensor, manifold: AdaptiveGeometry, dtype: torch.dtype | None = None):
        self.manifold = manifold
        self.w = w
        self.dtype = dtype or w.dtype
        self._fused = type(manifold).scale is AdaptiveGeometry.scale

    @property
    def point(self):
        return self.manifold.at(self.w.to(self.dtype))

    def tangent(self, z: Tensor) -> Tensor:
        return self.manifold.isotropic(self.point, z)

    def tangent_into(self, z: Tensor, out: Tensor) -> Tensor:
        if not self._fused:
            return super().tangent_into(z, out)
        if self.w.dtype == out.dtype:
            torch.abs(self.w, out=out)
        else:
            out.copy_(self.w).abs_()
        return out.clamp_min_(self.manifold.floor).mul_(z)

    def addmv_(
        self,
        out: list[Tensor],
        x: list[Tensor],
        c: list[Tensor],
        s: Tensor,
        beta: float,
        scratch: Tensor,
    ) -> None:
        if not self._fused:
            at = self.manifold.at
            scales = [self.manifold.scale(at(a.to(o.dtype))) for o, a in zip(out, x, strict=True)]
            tmp = list(torch._foreach_mul(scales, c))  # pyright: ignore[reportPrivateImportUsage]
        else:  # max(|x|, floor) ⊙ c · s, the scale formed in out's dtype
            tmp = out if beta == 0 else _views(scratch, out)
            torch._foreach_copy_(tmp, x)  # pyright: ignore[reportPrivateImportUsage]
            torch._foreach_abs_(tmp)  # pyright: ignore[reportPrivateImportUsage]
            torch._foreach_clamp_min_(tmp, self.manifold.floor)  # pyright: ignore[reportPrivateImportUsage]
            torch._foreach_mul_(tmp, c)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_mul_(tmp, s)  # pyright: ignore[reportPrivateImportUsage]
        _combine_(out, tmp, beta)

    def displaced(self, x: Tensor, z: Tensor, s: Tensor) -> Tensor:
        if not self._fused:
            return torch.addcmul(x, self.manifold.isotropic(self.manifold.at(x), z), s)
        return x.abs().clamp_min_(self.manifold.floor).mul_(z).mul_(s).add_(x)

    def displaced_into_(
        self, out: list[Tensor], x: list[Tensor], z: list[Tensor], s: Tensor
    ) -> None:
        if not self._fused:
            torch._foreach_copy_(out, [self.displaced(a, b, s) for a, b in zip(x, z, strict=True)])  # pyright: ignore[reportPrivateImportUsage]
            return
        # out = max(|x|, floor) ⊙ z · s + x
        torch._foreach_copy_(out, x)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_abs_(out)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_clamp_min_(out, self.manifold.floor)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_mul_(out, z)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_mul_(out, s)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_add_(out, x)  # pyright: ignore[reportPrivateImportUsage]

    def riemannian(self, c: Tensor) -> Tensor:
        return self.manifold.metric_inv(self.point, c)

    def metric(self, xi: Tensor) -> Tensor:
        return self.manifold.metric(self.point, xi)

    def whiten(self, xi: Tensor) -> Tensor:
        return xi / self.manifold.scale(self.point)


class QuotientPart(Part):
    """A kind of symmetry blocks at its points ``x``."""

    symmetric = False

    def __init__(self, x: Tensor, manifold: QuotientManifold):
        self.manifold = manifold
        self.point = manifold.at(x)
        self._half = x.new_tensor(0.5)  # the connection's ½, made once
        # the point's h × h factors (Grams, their Cholesky factors and inverses), which the
        # point caches, computed here once rather than by the first product
        with torch.no_grad():
            zero = torch.zeros_like(x)
            self.tangent(zero)
            manifold.christoffel(self.point, zero)

    def tangent(self, z: Tensor) -> Tensor:
        return self.manifold.proju(self.point, self.manifold.isotropic(self.point, z))

    def project(self, xi: Tensor) -> Tensor:
        return self.manifold.proju(self.point, xi)

    def release(self) -> None:
        self.point.cache.clear()

    def connection(self, xi: Tensor, gradient: Tensor | None) -> Tensor:
        assert gradient is not None  # Γ ≠ 0: the connection needs ∇f
        with torch.enable_grad():
            u = xi.detach().requires_grad_(True)
            form = (gradient * self.manifold.christoffel(self.point, u)).sum()
            # the ½ as the form's cotangent: exact (a power of two), no operator of its own
            (c,) = torch.autograd.grad(form, u, self._half)
        return c

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


def _views(scratch: Tensor, like: list[Tensor]) -> list[Tensor]:
    """Views of ``scratch``'s leading entries in the shapes of ``like``, one after another."""
    sizes = [t.numel() for t in like]
    pieces = scratch[: sum(sizes)].split(sizes)
    return [p.view(t.shape) for p, t in zip(pieces, like, strict=True)]


def _combine_(out: list[Tensor], image: list[Tensor], beta: float) -> None:
    """``out ← β · out + image`` (``image`` is ``out`` itself where ``β = 0``)."""
    if image is out:
        return
    if beta == 0:
        torch._foreach_copy_(out, image)  # pyright: ignore[reportPrivateImportUsage]
        return
    torch._foreach_mul_(out, beta)  # pyright: ignore[reportPrivateImportUsage]
    torch._foreach_add_(out, image)  # pyright: ignore[reportPrivateImportUsage]
