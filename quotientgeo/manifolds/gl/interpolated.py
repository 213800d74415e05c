r"""GL(h) two-factor quotient with the interpolated metric ``(1-s)·inv + s·mix``."""

from __future__ import annotations

import torch

from ...validation import real_in
from ..base import AtPoint
from .base import GLQuotient

Tensor = torch.Tensor

__all__ = ["InterpolatedGLQuotient"]


class InterpolatedGLQuotient(GLQuotient):
    r"""``GLQuotient(n, s)``: weights ``W_G = (1-s) P⁻¹ + s Q``, ``W_H = (1-s) Q⁻¹ + s P``.

    The metric-spectrum ablation: ``s = 0`` is the ``"inv"`` metric, ``s = 1`` the ``"mix"``
    metric. ``M(x)⁻¹ v = (v_G W_G⁻¹, v_H W_H⁻¹)`` (``W`` SPD, inverted by Cholesky). Only the
    metric is defined here: projection, Christoffel symbols and exponential maps come from
    the generic base (normal equations of the ``h²``-dimensional vertical space, solved by
    conjugate gradients when ``h² > dense_max``; ``Γ`` by autodiff of ``M(x)``).

    Args:
        n: number of rows of ``G``.
        metric: the interpolation weight ``s ∈ [0, 1]``.
        eps: Gram relaxation ``≥ 0``, as for :class:`GLQuotient`.
        exp_steps: RK4 steps of :meth:`expmap`, as for :class:`GLQuotient`.
        dense_max: as for :class:`GLQuotient`.
    """

    name = "InterpolatedGLQuotient"

    def __init__(
        self,
        n: int,
        metric: float = 0.5,
        eps: float = 0.0,
        *,
        exp_steps: int = 10,
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

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        """``(v_G W_G⁻¹, v_H W_H⁻¹)``; ``W⁻¹`` is ``(P, Q)`` at ``s = 0`` (no inversion)."""
        if self.s == 0.0:
            return self._blockwise(v, *self.grams(p))
        return super().metric_inv(p, v)
