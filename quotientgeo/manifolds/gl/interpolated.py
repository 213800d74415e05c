r"""GL(h) two-factor quotient with the interpolated metric ``(1-s)·inv + s·mix``."""

from __future__ import annotations

import torch

from ...linalg import cholesky, cholesky_inverse
from ...validation import real_in
from ..base import AtPoint
from .base import GLQuotient, Products
from .inv import GLInvQuotient
from .mix import GLMixQuotient

Tensor = torch.Tensor

__all__ = ["InterpolatedGLQuotient"]


class InterpolatedGLQuotient(GLQuotient):
    r"""``GLQuotient(n, s)``: weights ``W_G = (1-s) P⁻¹ + s Q``, ``W_H = (1-s) Q⁻¹ + s P``.

    The metric-spectrum ablation: ``s = 0`` is the ``"inv"`` metric, ``s = 1`` the ``"mix"``
    metric. ``M(x)⁻¹ v = (v_G W_G⁻¹, v_H W_H⁻¹)`` (``W`` SPD, inverted by Cholesky). The
    projection comes from the generic base (normal equations of the ``h²``-dimensional vertical
    space, solved by conjugate gradients when ``h² > dense_max``).

    Christoffel symbols in closed form: ``Γ(u, u) = M⁻¹ [DM(x)[u] u - ½ ∇ₓ(uᵀ M(x) u)]`` and the
    bracket is linear in the metric, so with ``M_inv Γ_inv = (Γ_inv,G P⁻¹, Γ_inv,H Q⁻¹)`` and
    ``M_mix Γ_mix = (Γ_mix,G Q, Γ_mix,H P)``:
    ``Γ_G = [(1-s) Γ_inv,G P⁻¹ + s Γ_mix,G Q] W_G⁻¹`` and
    ``Γ_H = [(1-s) Γ_inv,H Q⁻¹ + s Γ_mix,H P] W_H⁻¹`` (coefficient by coefficient).

    Args:
        n: number of rows of ``G``.
        metric: the interpolation weight ``s ∈ [0, 1]``.
        eps, exp_steps, dense_max: as for :class:`GLQuotient`.
    """

    name = "InterpolatedGLQuotient"

    def __init__(
        self,
        n: int,
        metric: float = 0.5,
        eps: float = 0.0,
        *,
        exp_steps: int | None = None,
        dense_max: int = 64,
    ):
        s = real_in("s", metric, 0.0, 1.0)
        super().__init__(n, s, eps, exp_steps=exp_steps, dense_max=dense_max)
        self.s = s

    def extra_repr(self) -> str:
        return f"n={self.n}, s={self.s}, eps={self.eps}"

    def weights(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        """``((1-s) P⁻¹ + s Q, (1-s) Q⁻¹ + s P)``; terms with weight 0 are skipped."""

        def compute():
            P, Q = self.grams(p)
            if self.s == 1.0:
                return Q, P
            P_inv, Q_inv = self.inverses(p)
            if self.s == 0.0:
                return P_inv, Q_inv
            s = self.s
            return (1 - s) * P_inv + s * Q, (1 - s) * Q_inv + s * P

        return p.cached("weights", compute)

    def gamma_coefficients(self, k: Products, same: bool) -> tuple[tuple, tuple]:
        """``(1-s)`` inv and ``s`` mix brackets, weighted back by ``W⁻¹`` (class docstring)."""
        s = self.s
        inv = GLInvQuotient.gamma_coefficients(self, k, same)
        mix = GLMixQuotient.gamma_coefficients(self, k, same)
        out = []
        for c_inv, c_mix, W_inv, W_mix, W in (
            (*inv[:1], *mix[:1], k.P_inv, k.Q, (1 - s) * k.P_inv + s * k.Q),
            (*inv[1:], *mix[1:], k.Q_inv, k.P, (1 - s) * k.Q_inv + s * k.P),
        ):
            W_out = cholesky_inverse(cholesky(W, "a metric weight"))
            out.append(
                tuple(
                    None if a is None else ((1 - s) * a @ W_inv + s * b @ W_mix) @ W_out
                    for a, b in zip(c_inv, c_mix, strict=True)
                )
            )
        return out[0], out[1]

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        """``(v_G W_G⁻¹, v_H W_H⁻¹)``; ``W⁻¹`` is ``(P, Q)`` at ``s = 0`` (no inversion)."""
        if self.s == 0.0:
            return self._blockwise(v, *self.grams(p))
        return super().metric_inv(p, v)
