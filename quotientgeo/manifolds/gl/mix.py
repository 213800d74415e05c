r"""GL(h) quotient with the ``mix`` metric ``tr(Q η_Gᵀ ζ_G) + tr(P η_Hᵀ ζ_H)``."""

from __future__ import annotations

import torch

from ...linalg import mT, sym
from ..base import AtPoint
from .base import GLQuotient

Tensor = torch.Tensor

__all__ = ["GLMixQuotient"]


class GLMixQuotient(GLQuotient):
    r"""``GLQuotient(n, "mix")``: weights ``(W_G, W_H) = (Q, P)``.

    - horizontal space ``Gᵀ ξ_G Q = P ξ_Hᵀ H``; projection ``(ξ_G + G Λ, ξ_H - H Λᵀ)`` with
      ``Λ = ½ (ξ_Hᵀ H Q⁻¹ - P⁻¹ Gᵀ ξ_G)``;
    - ``M⁻¹ v = (v_G Q⁻¹, v_H P⁻¹)``, Riemannian gradient ``proj(∇_G Q⁻¹, ∇_H P⁻¹)``;
    - isotropic map ``(e_G L_Q⁻¹, e_H L_P⁻¹)``;
    - Christoffel contraction, G part (H part: ``(G, P) ↔ (H, Q)``):
      ``Γ_G(ξ, ξ) = ξ_G (ξ_Hᵀ H + Hᵀ ξ_H) Q⁻¹ - G ξ_Hᵀ ξ_H Q⁻¹``.
    """

    name = "GLQuotient"
    metric_name = "mix"

    def extra_repr(self) -> str:
        return f"n={self.n}, metric='mix', eps={self.eps}"

    def weights(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        """``(Q, P)``."""
        P, Q = self.grams(p)
        return Q, P

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        """``(v_G Q⁻¹, v_H P⁻¹)``."""
        P_inv, Q_inv = self.inverses(p)
        return self._blockwise(v, Q_inv, P_inv)

    def isotropic(self, p: AtPoint, e: Tensor) -> Tensor:
        """``(e_G L_Q⁻¹, e_H L_P⁻¹)``: ``tr(Q ξ_Gᵀ ξ_G) = tr(e_Gᵀ e_G)``."""
        LP, LQ = self.cholesky_factors(p)
        eG, eH = self.split(e)
        solve = torch.linalg.solve_triangular
        return self.join(
            solve(LQ, eG, upper=False, left=False), solve(LP, eH, upper=False, left=False)
        )

    def precondition(self, p: AtPoint, r: Tensor) -> Tensor:
        """``½ P⁻¹ r Q⁻¹``, the exact inverse of ``V* M V: Ω ↦ 2 P Ω Q`` (at ``eps = 0``)."""
        P_inv, Q_inv = self.inverses(p)
        return 0.5 * P_inv @ r @ Q_inv

    def proju(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        """``(ξ_G + G Λ, ξ_H - H Λᵀ)``, ``Λ = ½ (ξ_Hᵀ H Q⁻¹ - P⁻¹ Gᵀ ξ_G)``."""
        p = self.at(x)
        self._check_vector(p, u)
        G, H = self.split(p)
        uG, uH = self.split(u)
        P_inv, Q_inv = self.inverses(p)
        Lam = 0.5 * ((mT(uH) @ H) @ Q_inv - P_inv @ (mT(G) @ uG))
        return self._blockwise(p.x, Lam, -mT(Lam), add=u)

    def christoffel(self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None) -> Tensor:
        """Symmetric bilinear ``Γ(u, v)``: per factor ``F C_F + u C_u + v C_v`` (:func:`_gamma`)."""

        def coefficients(G, H, P_inv, Q_inv, uG, uH, vG, vH):
            return _gamma(Q_inv, uG, vG, H, uH, vH), _gamma(P_inv, uH, vH, G, uG, vG)

        return self._christoffel(x, u, v, coefficients)


def _gamma(
    W_inv: Tensor, uF: Tensor, vF: Tensor, K: Tensor, uK: Tensor, vK: Tensor
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Factor part ``[u_F sym(v_Kᵀ K) + v_F sym(u_Kᵀ K) - F sym(u_Kᵀ v_K)] W⁻¹`` as
    ``(C_F, C_u, C_v)``.

    ``W`` is the Gram matrix of the other factor ``K``; for ``vF is uF`` the first two terms are
    one (``C_v`` is then unused).
    """
    SuK = sym(mT(uK) @ K) @ W_inv
    if vF is uF:
        return -(mT(uK) @ uK) @ W_inv, 2 * SuK, None
    SvK = sym(mT(vK) @ K) @ W_inv
    return -sym(mT(uK) @ vK) @ W_inv, SvK, SuK
