r"""GL(h) two-factor quotient with the interpolated metric ``(1-s)·inv + s·mix``."""

from __future__ import annotations

import math

import torch

from ..linalg import cholesky, cholesky_inverse, gram
from .base import AtPoint, QuotientManifold, positive_int
from .gl import GLQuotient

Tensor = torch.Tensor

__all__ = ["InterpolatedGLQuotient"]


class InterpolatedGLQuotient(QuotientManifold):
    r"""GL(h) quotient ``(G, H) ~ (G A⁻¹, H Aᵀ)`` with the metric ``(1-s)·inv + s·mix``.

    The metric-spectrum ablation: ``s = 0`` is :class:`GLQuotient`'s ``"inv"`` metric,
    ``s = 1`` its ``"mix"`` metric. Point layout, action and vertical space are those of
    :class:`GLQuotient` (``x = [G; H]`` of shape ``(..., n+m, h)``, vertical ``(-G Ω, H Ωᵀ)``).
    With ``P = GᵀG + eps·I``, ``Q = HᵀH + eps·I`` the metric is a right multiplication

    ``M(x) u = (u_G W_G, u_H W_H)``, ``W_G = (1-s) P⁻¹ + s Q``, ``W_H = (1-s) Q⁻¹ + s P``,

    so ``<η, ζ> = tr(W_G η_Gᵀ ζ_G) + tr(W_H η_Hᵀ ζ_H)`` and ``M(x)⁻¹ v = (v_G W_G⁻¹, v_H W_H⁻¹)``
    (``W`` is SPD; ``W⁻¹`` by Cholesky). Under the action ``W_G ↦ A W_G Aᵀ`` and
    ``W_H ↦ A⁻ᵀ W_H A⁻¹`` while tangent vectors map by ``ξ_G A⁻¹``, ``ξ_H Aᵀ``, so every ``s``
    gives an invariant metric. Only these primitives are defined here: projection, Riemannian
    gradient, Christoffel symbols and exponential maps all come from the generic base
    (normal equations of the ``h²``-dimensional vertical space, solved by conjugate gradients
    when ``h² > dense_max``; ``Γ`` by autodiff of ``M(x)``).

    Args:
        n: number of rows of ``G``.
        s: interpolation weight in ``[0, 1]``.
        eps: Gram relaxation ``≥ 0`` (as in :class:`GLQuotient`).
        exp_steps: RK4 steps of :meth:`expmap`.
        dense_max: largest ``h²`` for which the projection forms the normal equations densely.
    """

    name = "InterpolatedGLQuotient"
    ndim = 2

    # layout, group action and point checks are GLQuotient's; no metric geometry is inherited
    split = GLQuotient.split
    join = GLQuotient.join
    _blockwise = GLQuotient._blockwise
    _check_shape = GLQuotient._check_shape
    _check_point_on_manifold = GLQuotient._check_point_on_manifold
    random = GLQuotient.random
    origin = GLQuotient.origin
    lie_shape = GLQuotient.lie_shape
    vertical = GLQuotient.vertical
    act = GLQuotient.act
    push = GLQuotient.push

    point_aware = True

    def __init__(
        self,
        n: int,
        s: float = 0.5,
        eps: float = 0.0,
        *,
        exp_steps: int = 10,
        dense_max: int = 64,
    ):
        n = positive_int(n, "n", "rows of G")
        if not 0.0 <= s <= 1.0:
            raise ValueError(f"s must lie in [0, 1], got {s!r}")
        if not 0 <= eps < math.inf:
            raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
        super().__init__(exp_steps=exp_steps, dense_max=dense_max)
        self.n = n
        self.s = float(s)
        self.eps = float(eps)

    def extra_repr(self) -> str:
        return f"n={self.n}, s={self.s}, eps={self.eps}"

    # ------------------------------------------------------------------ metric
    def weights(self, x) -> tuple[Tensor, Tensor]:
        """``(W_G, W_H) = ((1-s) P⁻¹ + s Q, (1-s) Q⁻¹ + s P)``; terms with weight 0 are skipped."""
        if isinstance(x, AtPoint):  # computed once per cached point
            return x.cached("weights", lambda: self.weights(x.x))
        G, H = self.split(x)
        P, Q = gram(G, self.eps), gram(H, self.eps)
        if self.s == 1.0:
            return Q, P
        P_inv = cholesky_inverse(cholesky(P, "GᵀG"))
        Q_inv = cholesky_inverse(cholesky(Q, "HᵀH"))
        if self.s == 0.0:
            return P_inv, Q_inv
        s = self.s
        return (1 - s) * P_inv + s * Q, (1 - s) * Q_inv + s * P

    def metric(self, x, u: Tensor) -> Tensor:
        """``(u_G W_G, u_H W_H)``."""
        return self._blockwise(u, *self.weights(x))

    def metric_inv(self, x, v: Tensor) -> Tensor:
        """``(v_G W_G⁻¹, v_H W_H⁻¹)``; ``W⁻¹`` is ``P``, ``Q`` at ``s = 0`` (no inversion)."""
        if self.s == 0.0:
            G, H = self.split(x)
            return self._blockwise(v, gram(G, self.eps), gram(H, self.eps))
        W_G, W_H = self.weights(x)
        W_G_inv = cholesky_inverse(cholesky(W_G, "the metric weight W_G"))
        W_H_inv = cholesky_inverse(cholesky(W_H, "the metric weight W_H"))
        return self._blockwise(v, W_G_inv, W_H_inv)
