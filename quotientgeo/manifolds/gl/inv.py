r"""GL(h) quotient with the ``inv`` metric ``tr(P⁻¹ η_Gᵀ ζ_G) + tr(Q⁻¹ η_Hᵀ ζ_H)``."""

from __future__ import annotations

import torch

from ...linalg import mT, solve_sylvester, sylvester_basis, sym
from ..base import AtPoint
from .base import GLQuotient

Tensor = torch.Tensor

__all__ = ["GLInvQuotient"]


class GLInvQuotient(GLQuotient):
    r"""``GLQuotient(n, "inv")``: weights ``(W_G, W_H) = (P⁻¹, Q⁻¹)``.

    - horizontal space ``ξ_Gᵀ G Q = P Hᵀ ξ_H``; projection ``(ξ_G + G Λ, ξ_H - H Λᵀ)`` with
      ``Λ = Xᵀ``, ``A X + X A = B``, ``A = P Q``, ``B = P Hᵀ ξ_H - ξ_Gᵀ G Q``, solved in the
      eigenbasis of ``A = V diag(d) V⁻¹`` (``P = L Lᵀ``, ``Lᵀ Q L = U diag(d) Uᵀ``, ``V = L U``);
    - ``M⁻¹ v = (v_G P, v_H Q)``, Riemannian gradient ``proj(∇_G P, ∇_H Q)``;
    - isotropic map ``(e_G L_Pᵀ, e_H L_Qᵀ)``;
    - Christoffel contraction, G part (H part: ``(G, P) ↔ (H, Q)``):
      ``Γ_G(ξ, ξ) = -ξ_G P⁻¹ (ξ_Gᵀ G + Gᵀ ξ_G) + G P⁻¹ ξ_Gᵀ ξ_G``.
    """

    name = "GLQuotient"
    metric_name = "inv"

    def extra_repr(self) -> str:
        return f"n={self.n}, metric='inv', eps={self.eps}"

    def weights(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        """``(P⁻¹, Q⁻¹)``."""
        return self.inverses(p)

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        """``(v_G P, v_H Q)``."""
        return self._blockwise(v, *self.grams(p))

    def isotropic(self, p: AtPoint, e: Tensor) -> Tensor:
        """``(e_G L_Pᵀ, e_H L_Qᵀ)``: ``tr(P⁻¹ ξ_Gᵀ ξ_G) = tr(e_Gᵀ e_G)``."""
        LP, LQ = self.cholesky_factors(p)
        return self._blockwise(e, mT(LP), mT(LQ))

    def proju(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        """``(ξ_G + G Λ, ξ_H - H Λᵀ)``, ``Λ`` from the Sylvester equation (class docstring)."""
        p = self.at(x)
        self._check_vector(p, u)
        G, H = self.split(p)
        uG, uH = self.split(u)
        P, Q = self.grams(p)
        # factorizing Q too costs little and is what detects a rank-deficient H
        basis = p.cached("sylvester", lambda: sylvester_basis(P, Q, self.cholesky_factors(p)[0]))
        B = P @ (mT(H) @ uH) - mT(mT(G) @ uG) @ Q
        Lam = mT(solve_sylvester(basis, B))
        return self._blockwise(p.x, Lam, -mT(Lam), add=u)

    def christoffel(self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None) -> Tensor:
        """Symmetric bilinear ``Γ(u, v)``: per factor ``F C_F + u C_u + v C_v`` (:func:`_gamma`)."""

        def coefficients(G, H, P_inv, Q_inv, uG, uH, vG, vH):
            return _gamma(G, P_inv, uG, vG), _gamma(H, Q_inv, uH, vH)

        return self._christoffel(x, u, v, coefficients)


def _gamma(F: Tensor, W_inv: Tensor, u: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """Factor part ``F W⁻¹ sym(uᵀv) - u W⁻¹ sym(vᵀF) - v W⁻¹ sym(uᵀF)`` as ``(C_F, C_u, C_v)``.

    ``W`` is the Gram matrix of ``F``; for ``v is u`` the two last terms are one (``C_v`` is
    then unused).
    """
    Su = W_inv @ sym(mT(u) @ F)
    if v is u:
        return W_inv @ (mT(u) @ u), -2 * Su, None
    Sv = W_inv @ sym(mT(v) @ F)
    return W_inv @ sym(mT(u) @ v), -Sv, -Su
