r"""GL(h) two-factor quotient: pairs ``(G, H)`` that enter a network only through ``G Hᵀ``."""

from __future__ import annotations

import torch

from ..linalg import cholesky, cholesky_inverse, gram, mT, solve_sylvester, sylvester_basis, sym
from .base import AtPoint, QuotientManifold, as_tensor

Tensor = torch.Tensor

__all__ = ["GLQuotient"]


class GLQuotient(QuotientManifold):
    r"""Quotient of full-rank factor pairs by ``GL(h)``: ``(G, H) ~ (G A⁻¹, H Aᵀ)``.

    A point is one tensor ``x = [G; H]`` of shape ``(..., n+m, h)``, ``G`` its first ``n`` rows;
    leading dimensions are batch dimensions (heads, layers). With ``P = GᵀG + eps·I`` and
    ``Q = HᵀH + eps·I``:

    ============  ===========================================  ===========================
    metric        ``<η, ζ>``                                   horizontal space
    ============  ===========================================  ===========================
    ``"inv"``     ``tr(P⁻¹ η_Gᵀ ζ_G) + tr(Q⁻¹ η_Hᵀ ζ_H)``      ``ξ_Gᵀ G Q = P Hᵀ ξ_H``
    ``"mix"``     ``tr(Q η_Gᵀ ζ_G) + tr(P η_Hᵀ ζ_H)``          ``Gᵀ ξ_G Q = P ξ_Hᵀ H``
    ============  ===========================================  ===========================

    Vertical vectors ``(-G Ω, H Ωᵀ)``. Horizontal projection ``(ξ_G + G Λ, ξ_H - H Λᵀ)`` with

    - mix: ``Λ = ½ (ξ_Hᵀ H Q⁻¹ - P⁻¹ Gᵀ ξ_G)``;
    - inv: ``Λ = Xᵀ``, ``A X + X A = B``, ``A = P Q``, ``B = P Hᵀ ξ_H - ξ_Gᵀ G Q``, solved in the
      eigenbasis of ``A = V diag(d) V⁻¹`` (``P = L Lᵀ``, ``Lᵀ Q L = U diag(d) Uᵀ``, ``V = L U``).

    Riemannian gradient: inv ``proj(∇_G P, ∇_H Q)``; mix ``proj(∇_G Q⁻¹, ∇_H P⁻¹)``.
    Christoffel contraction, G part (H part: swap the roles of ``(G, P)`` and ``(H, Q)``):

    - inv: ``Γ_G(ξ, ξ) = -ξ_G P⁻¹ (ξ_Gᵀ G + Gᵀ ξ_G) + G P⁻¹ ξ_Gᵀ ξ_G``;
    - mix: ``Γ_G(ξ, ξ) = ξ_G (ξ_Hᵀ H + Hᵀ ξ_H) Q⁻¹ - G ξ_Hᵀ ξ_H Q⁻¹``.

    ``eps > 0`` is the relaxation of the paper's Appendix H.2 for (nearly) rank-deficient
    factors: ``P``, ``Q`` are replaced by their relaxed versions in every formula, so the
    action is then only approximately an isometry and the projection only approximately
    idempotent. Use :meth:`at` to reuse the factorizations of a fixed base point.

    Args:
        n: number of rows of ``G`` (``m`` follows from the point's shape).
        metric: ``"inv"`` or ``"mix"``.
        eps: Gram relaxation ``≥ 0``.
        exp_steps: RK4 steps of :meth:`expmap`.
    """

    name = "GLQuotient"
    ndim = 2
    point_aware = True

    def __init__(self, n: int, metric: str = "inv", eps: float = 0.0, *, exp_steps: int = 10):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive integer (rows of G), got {n!r}")
        if metric not in ("inv", "mix"):
            raise ValueError(f"metric must be 'inv' or 'mix', got {metric!r}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        super().__init__(exp_steps=exp_steps)
        self.n = n
        self.metric_name = metric
        self.eps = float(eps)

    def extra_repr(self) -> str:
        return f"n={self.n}, metric={self.metric_name!r}, eps={self.eps}"

    # ------------------------------------------------------------------ layout
    def split(self, x) -> tuple[Tensor, Tensor]:
        """``x = [G; H] ↦ (G, H)``."""
        x = as_tensor(x)
        return x[..., : self.n, :], x[..., self.n :, :]

    def join(self, G: Tensor, H: Tensor) -> Tensor:
        """``(G, H) ↦ [G; H]``."""
        if G.shape[-2] != self.n:
            raise ValueError(f"G must have n={self.n} rows, got shape {tuple(G.shape)}")
        if G.shape[-1] != H.shape[-1]:
            raise ValueError(
                f"G and H need the same number of columns h, got {tuple(G.shape)} and "
                f"{tuple(H.shape)}"
            )
        return torch.cat((G, H), dim=-2)

    def _check_shape(self, shape, name):
        if len(shape) < 2:
            return False, f"{name} must have at least 2 dimensions (n+m, h), got {tuple(shape)}"
        rows, h = shape[-2], shape[-1]
        m = rows - self.n
        if m < 1:
            return False, f"{name} has {rows} rows, but n={self.n} rows belong to G alone"
        if h > self.n or h > m:
            return False, (
                f"{name} has h={h} columns but G is {self.n}×{h} and H is {m}×{h}: "
                "full column rank needs h <= n and h <= m"
            )
        return True, None

    # ------------------------------------------------------------------ cached quantities
    def _grams(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        def compute():
            G, H = self.split(p.x)
            return gram(G, self.eps), gram(H, self.eps)

        return p.cached("grams", compute)

    def _cholesky(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        P, Q = self._grams(p)
        return p.cached("cholesky", lambda: (cholesky(P, "GᵀG"), cholesky(Q, "HᵀH")))

    def _inverses(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        LP, LQ = self._cholesky(p)
        return p.cached("inverses", lambda: (cholesky_inverse(LP), cholesky_inverse(LQ)))

    def _sylvester(self, p: AtPoint):
        P, Q = self._grams(p)
        return p.cached("sylvester", lambda: sylvester_basis(P, Q, self._cholesky(p)[0]))

    # ------------------------------------------------------------------ primitives
    def lie_shape(self, x) -> tuple[int, int]:
        h = as_tensor(x).shape[-1]
        return (h, h)

    def vertical(self, x, omega: Tensor) -> Tensor:
        """``(-G Ω, H Ωᵀ)``."""
        G, H = self.split(x)
        return self.join(-G @ omega, H @ mT(omega))

    def precondition(self, x, r: Tensor) -> Tensor:
        """mix: ``½ P⁻¹ r Q⁻¹``, the exact inverse of ``V* M V: Ω ↦ 2 P Ω Q`` (at ``eps = 0``)."""
        if self.metric_name == "inv":
            return r
        P_inv, Q_inv = self._inverses(self.at(x))
        return 0.5 * P_inv @ r @ Q_inv

    def act(self, x, A: Tensor) -> Tensor:
        """``(G, H) ↦ (G A⁻¹, H Aᵀ)`` for ``A`` of shape ``(..., h, h)``."""
        G, H = self.split(x)
        return self.join(torch.linalg.solve(A, G, left=False), H @ mT(A))

    def push(self, x, u: Tensor, A: Tensor) -> Tensor:
        """Differential of the action: ``(ξ_G, ξ_H) ↦ (ξ_G A⁻¹, ξ_H Aᵀ)``."""
        return self.act(u, A)

    def metric(self, x, u: Tensor) -> Tensor:
        """inv: ``(u_G P⁻¹, u_H Q⁻¹)``; mix: ``(u_G Q, u_H P)``."""
        p = self.at(x)
        uG, uH = self.split(u)
        if self.metric_name == "inv":
            P_inv, Q_inv = self._inverses(p)
            return self.join(uG @ P_inv, uH @ Q_inv)
        P, Q = self._grams(p)
        return self.join(uG @ Q, uH @ P)

    def metric_inv(self, x, v: Tensor) -> Tensor:
        """inv: ``(v_G P, v_H Q)``; mix: ``(v_G Q⁻¹, v_H P⁻¹)``."""
        p = self.at(x)
        vG, vH = self.split(v)
        if self.metric_name == "inv":
            P, Q = self._grams(p)
            return self.join(vG @ P, vH @ Q)
        P_inv, Q_inv = self._inverses(p)
        return self.join(vG @ Q_inv, vH @ P_inv)

    # ------------------------------------------------------------------ closed forms
    def inner(self, x, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False) -> Tensor:
        """inv ``tr(P⁻¹ u_Gᵀ v_G) + tr(Q⁻¹ u_Hᵀ v_H)``; mix ``tr(Q u_Gᵀ v_G) + tr(P u_Hᵀ v_H)``."""
        p = self.at(x)
        self._check_vector(p, u)
        v = u if v is None else v
        return self._reduce(u * self.metric(p, v), keepdim)

    def proju(self, x, u: Tensor) -> Tensor:
        """Horizontal projection ``(ξ_G + G Λ, ξ_H - H Λᵀ)`` (Λ in the class docstring)."""
        p = self.at(x)
        self._check_vector(p, u)
        G, H = self.split(p.x)
        uG, uH = self.split(u)
        if self.metric_name == "inv":
            P, Q = self._grams(p)
            B = P @ (mT(H) @ uH) - mT(mT(G) @ uG) @ Q
            Lam = mT(solve_sylvester(self._sylvester(p), B))
        else:
            P_inv, Q_inv = self._inverses(p)
            Lam = 0.5 * ((mT(uH) @ H) @ Q_inv - P_inv @ (mT(G) @ uG))
        return self._shift(u, p.x, Lam)

    def _shift(self, u: Tensor, x: Tensor, Lam: Tensor) -> Tensor:
        """``(u_G + G Λ, u_H - H Λᵀ)``, accumulated in place into one copy of ``u``.

        Memory traffic, not arithmetic, dominates here: in-place ``baddbmm_`` on one clone is
        about twice as fast as adding and concatenating the two factor blocks.
        """
        n, (rows, h) = self.n, u.shape[-2:]
        batch = torch.broadcast_shapes(u.shape[:-2], x.shape[:-2], Lam.shape[:-2])
        out = u.expand(*batch, rows, h).clone(memory_format=torch.contiguous_format)
        flat = out.view(-1, rows, h)
        x = x.expand(*batch, rows, h).reshape(-1, rows, h)
        Lam = Lam.expand(*batch, h, h).reshape(-1, h, h)
        flat[:, :n].baddbmm_(x[:, :n], Lam)
        flat[:, n:].baddbmm_(x[:, n:], mT(Lam), alpha=-1)
        return out

    def egrad2rgrad(self, x, u: Tensor) -> Tensor:
        """inv: ``proj(∇_G P, ∇_H Q)``; mix: ``proj(∇_G Q⁻¹, ∇_H P⁻¹)``."""
        p = self.at(x)
        self._check_vector(p, u, "the gradient")
        return self.proju(p, self.metric_inv(p, u))

    def christoffel(self, x, u: Tensor, v: Tensor | None = None) -> Tensor:
        """Symmetric bilinear ``Γ(u, v)`` (class docstring gives ``Γ(ξ, ξ)``; polarised here)."""
        p = self.at(x)
        self._check_vector(p, u)
        v = u if v is None else v
        G, H = self.split(p.x)
        uG, uH = self.split(u)
        vG, vH = (uG, uH) if v is u else self.split(v)
        P_inv, Q_inv = self._inverses(p)
        if self.metric_name == "inv":
            return self.join(_gamma_inv(G, P_inv, uG, vG), _gamma_inv(H, Q_inv, uH, vH))
        return self.join(
            _gamma_mix(G, Q_inv, uG, vG, H, uH, vH), _gamma_mix(H, P_inv, uH, vH, G, uG, vG)
        )

    # ------------------------------------------------------------------ points
    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        """Full column rank of ``G`` and ``H`` (not needed with ``eps > 0``); reports cond."""
        x = as_tensor(x)
        if not bool(torch.isfinite(x).all()):
            return False, "the point has non-finite entries"
        worst = []
        for name, F in zip(("G", "H"), self.split(x), strict=True):
            s = torch.linalg.svdvals(F)
            tol = max(F.shape[-2:]) * torch.finfo(F.dtype).eps * s[..., :1]
            cond = (s[..., 0] / s[..., -1]).max().item()
            worst.append((name, cond, bool((s[..., -1:] <= tol).any())))
        for name, cond, deficient in worst:
            if deficient and self.eps == 0:
                return False, (
                    f"{name} is rank deficient (worst condition number {cond:.3e}); "
                    "use eps > 0 to relax the geometry"
                )
        return True, "worst condition numbers: " + ", ".join(f"{n} {c:.3e}" for n, c, _ in worst)

    def random(self, *size, dtype=None, device=None, **kwargs) -> Tensor:
        """Gaussian factors (full rank with probability one), entries ``N(0, 1/h)``."""
        size = self._checked_size(size)
        return torch.randn(*size, dtype=dtype, device=device) / size[-1] ** 0.5

    def origin(self, *size, dtype=None, device=None, seed=42) -> Tensor:
        """``[I_{n×h}; I_{m×h}]`` broadcast to ``size``."""
        size = self._checked_size(size)
        rows, h = size[-2], size[-1]
        eye = lambda r: torch.eye(r, h, dtype=dtype, device=device)  # noqa: E731
        return torch.cat([eye(self.n), eye(rows - self.n)], dim=-2).expand(*size).clone()


def _gamma_inv(F: Tensor, W_inv: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """inv factor part, polarised: ``F W⁻¹ sym(uᵀv) - u W⁻¹ sym(vᵀF) - v W⁻¹ sym(uᵀF)``.

    ``W`` is the Gram matrix of ``F``; for ``v is u`` the two last terms are one product.
    """
    Su = W_inv @ sym(mT(u) @ F)
    if v is u:
        return F @ (W_inv @ (mT(u) @ u)) - u @ (2 * Su)
    Sv = W_inv @ sym(mT(v) @ F)
    return F @ (W_inv @ sym(mT(u) @ v)) - u @ Sv - v @ Su


def _gamma_mix(
    F: Tensor, W_inv: Tensor, uF: Tensor, vF: Tensor, K: Tensor, uK: Tensor, vK: Tensor
) -> Tensor:
    """mix factor part, polarised: ``[u_F sym(v_Kᵀ K) + v_F sym(u_Kᵀ K) - F sym(u_Kᵀ v_K)] W⁻¹``.

    ``W`` is the Gram matrix of the other factor ``K``; ``W⁻¹`` is folded into the ``h × h``
    factors, and for ``v is u`` the first two terms are one product.
    """
    SuK = sym(mT(uK) @ K) @ W_inv
    if vF is uF:
        return uF @ (2 * SuK) - F @ ((mT(uK) @ uK) @ W_inv)
    SvK = sym(mT(vK) @ K) @ W_inv
    return uF @ SvK + vF @ SuK - F @ (sym(mT(uK) @ vK) @ W_inv)
