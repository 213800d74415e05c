r"""The ``mix`` metric ``tr(Q η_Gᵀ ζ_G) + tr(P η_Hᵀ ζ_H)``: its total space and GL(h) quotient."""

from __future__ import annotations

import torch

from ...linalg import mT, sym
from ..base import AtPoint
from .blocks import Coefficients, Products
from .quotient import GLQuotient
from .total import GLTotalSpace

Tensor = torch.Tensor

__all__ = ["GLMixQuotient", "MixTotalSpace"]


class MixTotalSpace(GLTotalSpace):
    r"""``GLTotalSpace(n, "mix")``: weights ``(W_G, W_H) = (Q, P)``.

    - ``M⁻¹ v = (v_G Q⁻¹, v_H P⁻¹)``;
    - isotropic map ``(e_G L_Q⁻¹, e_H L_P⁻¹)``;
    - Christoffel contraction, G part (H part: ``(G, P) ↔ (H, Q)``):
      ``Γ_G(ξ, ξ) = ξ_G (ξ_Hᵀ H + Hᵀ ξ_H) Q⁻¹ - G ξ_Hᵀ ξ_H Q⁻¹``;
    - geodesics integrated in the span of ``[F, ξ_F]`` (:meth:`GLTotalSpace.geodesic`).
    """

    name = "MixTotalSpace"
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

    def gamma_coefficients(self, k: Products, same: bool) -> Coefficients:
        """:func:`mix_coefficients`."""
        return mix_coefficients(k, same)


class GLMixQuotient(GLQuotient):
    r"""``GLQuotient(n, "mix")``: :class:`MixTotalSpace` by ``GL(h)``.

    - horizontal space ``Gᵀ ξ_G Q = P ξ_Hᵀ H``; projection ``(ξ_G + G Λ, ξ_H - H Λᵀ)`` with
      ``Λ = ½ (ξ_Hᵀ H Q⁻¹ - P⁻¹ Gᵀ ξ_G)``;
    - Riemannian gradient ``proj(∇_G Q⁻¹, ∇_H P⁻¹)``;
    - metric, ``M⁻¹``, isotropic map and Christoffel symbols from :class:`MixTotalSpace`.
    """

    total_class = MixTotalSpace

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


def mix_coefficients(k: Products, same: bool) -> Coefficients:
    """Factor ``F`` with the other factor ``K`` and its Gram ``W`` (``(G; H, Q)``,
    ``(H; G, P)``):
    ``Γ_F(u, v) = [u_F sym(v_Kᵀ K) + v_F sym(u_Kᵀ K) - F sym(u_Kᵀ v_K)] W⁻¹``."""
    G = _gamma(k.Q_inv, k.uF[1], k.vF[1], k.uv[1], same)
    return G, _gamma(k.P_inv, k.uF[0], k.vF[0], k.uv[0], same)


def _gamma(
    W_inv: Tensor, uK: Tensor, vK: Tensor, uvK: Tensor, same: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(C_F, C_u, C_v)`` of factor ``F`` from the other factor's ``uK = u_Kᵀ K``,
    ``vK = v_Kᵀ K``, ``uvK = u_Kᵀ v_K``; for ``same`` the first two terms are one and ``C_v``
    is ``None``."""
    if same:  # 2 sym(uK) W⁻¹ as (uK + uKᵀ) W⁻¹: the same bits (the factors 2 and ½ are exact)
        return -uvK @ W_inv, (uK + mT(uK)) @ W_inv, None
    return -sym(uvK) @ W_inv, sym(vK) @ W_inv, sym(uK) @ W_inv
