r"""The GL(h) metrics damped in ``H``'s frame: exactly invariant, also where ``G = 0``.

:class:`~.damping.FrameDamping` replaces ``P = GᵀG`` in the metric weights by
``P_δ = GᵀG + δ Q⁻¹`` (``Q = HᵀH``, ``δ = (ρ/κ)²``). Under ``(G, H) ↦ (G M⁻¹, H Mᵀ)``,
``Q⁻¹ ↦ M⁻ᵀ Q⁻¹ M⁻¹`` transforms as ``GᵀG`` does, so the weights transform as every GL metric's
must and the damped metrics are GL(h)-invariant wherever ``H`` has full rank. For a LoRA pair
(``G = B``, ``H = Aᵀ``) the mix metric is

    ``‖ξ‖² = ‖ξ_B A‖² + ‖B ξ_A‖² + (ρ/κ)² ‖A⁺ ξ_A‖²``,

the inv metric's term of ``A``, ``tr(Q⁻¹ ξ_Hᵀξ_H) = ‖A⁺ξ_A‖²``, added with weight ``δ``. This
file derives, for the weights of the metric ``s`` (``"inv"`` = 0, ``"mix"`` = 1)

    ``W_G = (1-s) P_δ⁻¹ + s Q``,   ``W_H = (1-s) Q⁻¹ + s P_δ``,

the rest of the geometry. ``P₀ = GᵀG`` below is the undamped Gram.
"""

from __future__ import annotations

from typing import Any

import torch

from ...linalg import cholesky, cholesky_inverse, gram, mT, solve_sylvester, sylvester_basis, sym
from ...validation import real_in
from ..base import AtPoint
from .blocks import Coefficients, Products
from .damping import FrameDamping
from .quotient import GLQuotient
from .total import GLTotalSpace

Tensor = torch.Tensor

__all__ = ["FramedGLQuotient", "FramedTotalSpace"]

WEIGHTS = {"inv": 0.0, "mix": 1.0}


class FramedTotalSpace(GLTotalSpace):
    r"""``GLTotalSpace(n, metric, FrameDamping(ρ, κ))``: weights
    ``W_G = (1-s) P_δ⁻¹ + s Q``, ``W_H = (1-s) Q⁻¹ + s P_δ``, ``P_δ = GᵀG + δ Q⁻¹``.

    :meth:`grams` returns ``(P_δ, Q)``, so the weights read as those of the undamped metrics.

    Christoffel symbols in closed form. The metric is ``M(x) u = (u_G W_G, u_H W_H)`` with
    weights that are functions of ``P₀ = GᵀG`` and ``Q = HᵀH``, so
    ``M Γ(u, v) = ½ [DM[u] v + DM[v] u] - ½ ∇ₓ ⟨u, v⟩`` is, per factor ``F``,

        ``M Γ_F(u, v) = ½ [u_F Ẇ_F[v] + v_F Ẇ_F[u]] - F Φ_F(u, v)``,

    ``Ẇ_F[u]`` the derivative of ``W_F`` along ``u`` and ``Φ_F`` the gradient of
    ``⟨u, v⟩`` with respect to ``F``'s Gram (``∇_F tr(Φ FᵀF) = 2 F Φ``). With
    ``Ṗ = 2 sym(u_Gᵀ G)``, ``Q̇ = 2 sym(u_Hᵀ H)``, ``Ṗ_δ = Ṗ - δ Q⁻¹ Q̇ Q⁻¹``,
    ``S_F = sym(u_Fᵀ v_F)``, ``R = P_δ⁻¹``:

    - ``Ẇ_G[u] = -(1-s) R Ṗ_δ R + s Q̇``, ``Ẇ_H[u] = -(1-s) Q⁻¹ Q̇ Q⁻¹ + s Ṗ_δ``;
    - ``Φ_δ = -(1-s) R S_G R + s S_H`` (the gradient with respect to ``P_δ``), ``Φ_G = Φ_δ``,
      ``Φ_H = -δ Q⁻¹ Φ_δ Q⁻¹ - (1-s) Q⁻¹ S_H Q⁻¹ + s S_G`` (``P_δ`` depends on ``Q``);
    - ``Γ_F = [M Γ]_F W_F⁻¹``.

    At ``δ = 0`` these are the inv and mix formulas of :mod:`.inv` and :mod:`.mix`. They cost
    ``O(h³)`` per head beyond the products ``u_Fᵀ F``, ``u_Fᵀ v_F`` that every GL metric forms,
    and depend on the factors only through ``FᵀF``, ``u_Fᵀ F``, ``u_Fᵀ u_F``: the geodesic is
    integrated in the span of ``[F, u_F]`` (:meth:`GLTotalSpace.geodesic`). No closed-form
    geodesic (the damped inv metric is no product metric).

    Points: ``H`` must have full column rank; ``G`` may be anything, ``0`` included.

    Args:
        n: number of rows of ``G``.
        metric: ``"mix"`` (default), ``"inv"`` or the interpolation weight ``s``.
        eps: the :class:`~.damping.FrameDamping` (with its radius, or ``None`` waiting for a
            ball's).
        exp_steps: as for :class:`GLTotalSpace`.
        dense_max: as for :class:`GLTotalSpace`.
    """

    name = "FramedTotalSpace"

    def __new__(cls, *a: Any, **k: Any):
        return super(GLTotalSpace, cls).__new__(cls)

    def __init__(
        self,
        n: int,
        metric: str | float | None = None,
        eps: FrameDamping | None = None,
        *,
        exp_steps: int | None = None,
        dense_max: int = 64,
    ):
        if not isinstance(eps, FrameDamping):
            raise TypeError(f"FramedTotalSpace needs a FrameDamping as eps, got {eps!r}")
        metric = "mix" if metric is None else metric
        if isinstance(metric, str) and metric not in WEIGHTS:
            raise ValueError(f"metric must be 'mix', 'inv' or a number s in [0, 1], got {metric!r}")
        s = WEIGHTS[metric] if isinstance(metric, str) else real_in("s", metric, 0.0, 1.0)
        super().__init__(n, metric, 0.0, exp_steps=exp_steps, dense_max=dense_max)
        self.eps: FrameDamping = eps  # type: ignore[assignment]
        self.s = s
        self.metric_name = metric

    def extra_repr(self) -> str:
        metric = repr(self.metric_name) if isinstance(self.metric_name, str) else self.s
        return f"n={self.n}, metric={metric}, eps={self.eps}"

    @property
    def relaxed(self) -> bool:
        return True

    @property
    def delta(self) -> float:
        """``δ = (ρ/κ)²`` (an error while the damping waits for a ball's radius)."""
        return self.eps.delta

    # ------------------------------------------------------------------ cached quantities
    def relaxation(self, p: AtPoint) -> float:
        """``δ``."""
        return self.delta

    def grams(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        """``(P_δ, Q) = (GᵀG + δ Q⁻¹, HᵀH)``, cached on ``p``."""

        def compute():
            G, H = self.split(p)
            return self.damped(gram(G), gram(H))[:2]

        return p.cached("grams", compute)

    def damped(self, P0: Tensor, Q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(P_δ, Q, Q⁻¹)`` from the Grams ``P₀ = GᵀG`` and ``Q = HᵀH``."""
        Q_inv = cholesky_inverse(cholesky(Q, "HᵀH"))
        return P0 + self.delta * Q_inv, Q, Q_inv

    def undamped_gram(self, p: AtPoint) -> Tensor:
        """``P₀ = GᵀG``, cached on ``p``."""
        return p.cached("undamped_gram", lambda: gram(self.split(p)[0]))

    def weights(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        """``((1-s) P_δ⁻¹ + s Q, (1-s) Q⁻¹ + s P_δ)``; terms of weight 0 skipped."""

        def compute():
            P, Q = self.grams(p)
            if self.s == 1.0:
                return Q, P
            R, Q_inv = self.inverses(p)
            if self.s == 0.0:
                return R, Q_inv
            s = self.s
            return (1 - s) * R + s * Q, (1 - s) * Q_inv + s * P

        return p.cached("weights", compute)

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        """``(v_G Q⁻¹, v_H P_δ⁻¹)`` (mix), ``(v_G P_δ, v_H Q)`` (inv), Cholesky otherwise."""
        if self.s == 1.0:
            R, Q_inv = self.inverses(p)
            return self._blockwise(v, Q_inv, R)
        if self.s == 0.0:
            return self._blockwise(v, *self.grams(p))
        return super().metric_inv(p, v)

    # ------------------------------------------------------------------ Christoffel symbols
    def gamma_coefficients(self, k: Products, same: bool) -> Coefficients:
        """The coefficients of the class docstring; ``k.P`` is ``P_δ``, ``k.P_inv`` is ``R``."""
        s, delta = self.s, self.delta
        R, Q_inv = k.P_inv, k.Q_inv

        def sandwich(W: Tensor, X: Tensor) -> Tensor:  # W X W
            return W @ X @ W

        def derivatives(uF: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
            """``(Ẇ_G[u], Ẇ_H[u])`` from ``(u_Gᵀ G, u_Hᵀ H)``."""
            P_dot, Q_dot = (F + mT(F) for F in uF)  # 2 sym(·), the same bits
            Pd_dot = P_dot - delta * sandwich(Q_inv, Q_dot)
            dG, dH = s * Q_dot, s * Pd_dot
            if s != 1.0:
                dG = dG - (1 - s) * sandwich(R, Pd_dot)
                dH = dH - (1 - s) * sandwich(Q_inv, Q_dot)
            return dG, dH

        S_G, S_H = sym(k.uv[0]), sym(k.uv[1])
        phi_delta = s * S_H - (1 - s) * sandwich(R, S_G) if s != 1.0 else S_H
        phi_H = s * S_G - delta * sandwich(Q_inv, phi_delta)
        if s != 1.0:
            phi_H = phi_H - (1 - s) * sandwich(Q_inv, S_H)
        W_inv = self._weights_inverse(k)
        du = derivatives(k.uF)
        if same:
            return (
                (-phi_delta @ W_inv[0], du[0] @ W_inv[0], None),
                (-phi_H @ W_inv[1], du[1] @ W_inv[1], None),
            )
        dv = derivatives(k.vF)
        return tuple(  # type: ignore[return-value]
            (-phi @ Wi, 0.5 * d_v @ Wi, 0.5 * d_u @ Wi)
            for phi, Wi, d_u, d_v in zip((phi_delta, phi_H), W_inv, du, dv, strict=True)
        )

    def _weights_inverse(self, k: Products) -> tuple[Tensor, Tensor]:
        """``(W_G⁻¹, W_H⁻¹)`` from the products ``k``."""
        if self.s == 1.0:
            return k.Q_inv, k.P_inv
        if self.s == 0.0:
            return k.P, k.Q
        s = self.s
        W_G, W_H = (1 - s) * k.P_inv + s * k.Q, (1 - s) * k.Q_inv + s * k.P
        return (
            cholesky_inverse(cholesky(W_G, "a metric weight")),
            cholesky_inverse(cholesky(W_H, "a metric weight")),
        )

    def gram_products(
        self,
        p: AtPoint,
        P0: Tensor,
        Q0: Tensor,
        uF: tuple[Tensor, Tensor],
        uv: tuple[Tensor, Tensor],
    ) -> Products:
        """The ``Products`` of the geodesic's integration from the undamped Grams."""
        P, Q, Q_inv = self.damped(P0, Q0)
        return Products(P, Q, cholesky_inverse(cholesky(P, "GᵀG + δQ⁻¹")), Q_inv, uF, uF, uv)

    # ------------------------------------------------------------------ points
    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        """Full column rank of ``H`` to working precision (``G`` may be anything, ``0`` too)."""
        x = x.x if isinstance(x, AtPoint) else x
        if not bool(torch.isfinite(x).all()):
            return False, "the point has non-finite entries"
        if x.numel() == 0:
            return True, None
        s = torch.linalg.svdvals(self.split(x)[1])
        cond = (s[..., 0] / s[..., -1]).max().item()
        if not cond**2 < 1 / torch.finfo(x.dtype).eps:
            return False, (
                f"H is rank deficient to {x.dtype} precision (worst condition number "
                f"{cond:.3e}); the frame damping needs H of full rank"
            )
        return True, f"worst condition number of H {cond:.3e}"


class FramedGLQuotient(GLQuotient):
    r"""``GLQuotient(n, metric, FrameDamping(ρ, κ))``: :class:`FramedTotalSpace` by ``GL(h)``.

    Horizontal space: ``ξ`` is metric-orthogonal to every ``(-G Ω, H Ωᵀ)`` iff
    ``P₀ Λ W_G + W_H Λ Q = W_H ξ_Hᵀ H - Gᵀ ξ_G W_G`` holds for the projection
    ``(ξ_G + G Λ, ξ_H - H Λᵀ)`` (``Gᵀ ξ_G W_G = W_H ξ_Hᵀ H`` for ``ξ`` horizontal). Closed forms:

    - **mix** (``W_G = Q``, ``W_H = P_δ``):
      ``Λ = (P₀ + P_δ)⁻¹ (P_δ ξ_Hᵀ H - Gᵀ ξ_G Q) Q⁻¹``; ``P₀ + P_δ = 2 GᵀG + δ Q⁻¹`` is SPD,
      so it is defined at ``G = 0``;
    - **inv** (``W_G = P_δ⁻¹``, ``W_H = Q⁻¹``): multiplied by ``Q`` on the left and ``P_δ`` on
      the right, ``K Λ + Λ K + δ Λ = ξ_Hᵀ H P_δ - Q Gᵀ ξ_G`` with ``K = Q P₀`` (``Q P_δ = K + δI``).
      ``K = V diag(d) V⁻¹`` with ``Q = L Lᵀ``, ``Lᵀ P₀ L = U diag(d) Uᵀ``, ``V = L U`` (``d ≥ 0``),
      so ``Λ = V [(V⁻¹ C V) / (d_i + d_j + δ)] V⁻¹``: one Cholesky of ``Q``, one ``eigh``;
    - any other ``s``: the generic projection (normal equations of the vertical space).

    Riemannian gradient ``proj(M⁻¹ ∇)`` (``(∇_G Q⁻¹, ∇_H P_δ⁻¹)`` for mix, ``(∇_G P_δ, ∇_H Q)``
    for inv: horizontal already for an invariant loss). A vector of metric norm ``ρ`` moves ``H``
    at most ``κ`` in its own frame in the mix metric (``δ tr(Q⁻¹ ξ_Hᵀξ_H) ≤ ρ²``), and ``G = 0``
    is at a finite distance in the inv metric (``W_G = Q/δ`` there: ``‖ξ_G Hᵀ‖ ≤ ρ²/κ``).
    """

    name = "FramedGLQuotient"
    total_class = FramedTotalSpace  # type: ignore[assignment]

    @property
    def s(self) -> float:
        """The interpolation weight of the metric (``"inv"`` 0, ``"mix"`` 1)."""
        return self.total.s  # type: ignore[attr-defined]

    def proju(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        """``(ξ_G + G Λ, ξ_H - H Λᵀ)``, ``Λ`` in closed form for mix and inv (class docstring)."""
        s = self.s
        if s not in (0.0, 1.0):
            return super().proju(x, u)
        p = self.at(x)
        self._check_vector(p, u)
        total: FramedTotalSpace = self.total  # type: ignore[assignment]
        G, H = self.split(p)
        uG, uH = self.split(u)
        P, Q = self.grams(p)
        P0 = total.undamped_gram(p)
        HuH, GuG = mT(uH) @ H, mT(G) @ uG  # ξ_Hᵀ H, Gᵀ ξ_G
        if s == 1.0:
            L = p.cached("framed_sum", lambda: cholesky(P0 + P, "2GᵀG + δQ⁻¹"))
            Q_inv = self.inverses(p)[1]
            Lam = torch.cholesky_solve(P @ HuH - GuG @ Q, L) @ Q_inv
        else:
            basis = p.cached("framed_sylvester", lambda: self._sylvester(p, P0, Q, total.delta))
            Lam = solve_sylvester(basis, HuH @ P - Q @ GuG)
        return self._blockwise(p.x, Lam, -mT(Lam), add=u)

    def _sylvester(self, p: AtPoint, P0: Tensor, Q: Tensor, delta: float):
        """The eigenbasis of ``Λ ↦ K Λ + Λ K + δ Λ``, ``K = Q P₀``."""
        basis = sylvester_basis(Q, P0, self.cholesky_factors(p)[1])
        return basis._replace(denom=basis.denom + delta)
