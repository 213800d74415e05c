r"""The interpolated metric ``(1-s)·inv + s·mix``: its total space and GL(h) quotient."""

from __future__ import annotations

from typing import cast

import torch

from ...linalg import cholesky, cholesky_inverse
from ...validation import real_in
from ..base import AtPoint
from .blocks import Coefficients, Products
from .inv import inv_coefficients
from .mix import mix_coefficients
from .quotient import GLQuotient
from .total import GLTotalSpace

Tensor = torch.Tensor

__all__ = ["InterpolatedGLQuotient", "InterpolatedTotalSpace"]


class InterpolatedTotalSpace(GLTotalSpace):
    r"""``GLTotalSpace(n, s)``: weights ``W_G = (1-s) P⁻¹ + s Q``, ``W_H = (1-s) Q⁻¹ + s P``.

    The metric-spectrum ablation: ``s = 0`` is the ``"inv"`` metric, ``s = 1`` the ``"mix"``
    metric. ``M(x)⁻¹ v = (v_G W_G⁻¹, v_H W_H⁻¹)`` (``W`` SPD, inverted by Cholesky). Geodesics
    are integrated in the span of ``[F, ξ_F]`` (:meth:`GLTotalSpace.geodesic`).

    Christoffel symbols in closed form: ``Γ(u, u) = M⁻¹ [DM(x)[u] u - ½ ∇ₓ(uᵀ M(x) u)]`` and the
    bracket is linear in the metric, so with ``M_inv Γ_inv = (Γ_inv,G P⁻¹, Γ_inv,H Q⁻¹)`` and
    ``M_mix Γ_mix = (Γ_mix,G Q, Γ_mix,H P)``:
    ``Γ_G = [(1-s) Γ_inv,G P⁻¹ + s Γ_mix,G Q] W_G⁻¹`` and
    ``Γ_H = [(1-s) Γ_inv,H Q⁻¹ + s Γ_mix,H P] W_H⁻¹`` (coefficient by coefficient).

    Args:
        n: number of rows of ``G``.
        metric: the interpolation weight ``s ∈ [0, 1]``.
        eps: Gram relaxation ``≥ 0``, as for :class:`GLTotalSpace`.
        exp_steps: RK4 steps of :meth:`expmap`, as for :class:`GLTotalSpace`.
        dense_max: as for :class:`GLTotalSpace`.
    """

    name = "InterpolatedTotalSpace"

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
        self.metric_name = s

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

    def gamma_coefficients(self, k: Products, same: bool) -> Coefficients:
        """``(1-s)`` inv and ``s`` mix brackets, weighted back by ``W⁻¹`` (class docstring)."""
        s = self.s
        (iG, iH), (mG, mH) = inv_coefficients(k, same), mix_coefficients(k, same)

        def combine(c_inv, c_mix, W_inv: Tensor, W_mix: Tensor, W: Tensor):
            W_out = cholesky_inverse(cholesky(W, "a metric weight"))

            def one(a: Tensor, b: Tensor) -> Tensor:
                return ((1 - s) * a @ W_inv + s * b @ W_mix) @ W_out

            C_v = None if c_inv[2] is None or c_mix[2] is None else one(c_inv[2], c_mix[2])
            return one(c_inv[0], c_mix[0]), one(c_inv[1], c_mix[1]), C_v

        return (
            combine(iG, mG, k.P_inv, k.Q, (1 - s) * k.P_inv + s * k.Q),
            combine(iH, mH, k.Q_inv, k.P, (1 - s) * k.Q_inv + s * k.P),
        )

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        """``(v_G W_G⁻¹, v_H W_H⁻¹)``; ``W⁻¹`` is ``(P, Q)`` at ``s = 0`` (no inversion)."""
        if self.s == 0.0:
            return self._blockwise(v, *self.grams(p))
        return super().metric_inv(p, v)


class InterpolatedGLQuotient(GLQuotient):
    r"""``GLQuotient(n, s)``: :class:`InterpolatedTotalSpace` by ``GL(h)``.

    The projection comes from the generic base (normal equations of the ``h²``-dimensional
    vertical space, solved by conjugate gradients when ``h² > dense_max``); metric, ``M⁻¹``,
    Christoffel symbols and geodesics from :class:`InterpolatedTotalSpace`.

    Args:
        n: number of rows of ``G``.
        metric: the interpolation weight ``s ∈ [0, 1]`` (default ``0.5``).
        eps: Gram relaxation ``≥ 0``, as for :class:`GLQuotient`.
        exp_steps: RK4 steps of :meth:`expmap`, as for :class:`GLQuotient`.
        dense_max: as for :class:`GLQuotient`.
    """

    name = "InterpolatedGLQuotient"
    total_class = InterpolatedTotalSpace

    @property
    def s(self) -> float:
        """The interpolation weight."""
        return cast("InterpolatedTotalSpace", self.total).s
