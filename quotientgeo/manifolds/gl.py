r"""GL(h) two-factor quotient: pairs ``(G, H)`` that enter a network only through ``G Hᵀ``."""

from __future__ import annotations

import math

import torch

from ..linalg import cholesky, cholesky_inverse, gram, mT, solve_sylvester, sylvester_basis, sym
from .base import AtPoint, QuotientManifold, as_tensor, positive_int

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

    Accuracy: the formulas factorize ``P`` and ``Q``, whose condition numbers are ``cond(G)²``
    and ``cond(H)²``, so results carry relative errors of order ``cond² · eps`` of the dtype.
    In float32 that is already 1 % at ``cond ≈ 300``; :meth:`check_point_on_manifold` refuses
    points with ``cond² ≥ 1 / eps``. Compute in float64 or relax with ``eps > 0`` there.

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
        n = positive_int(n, "n", "rows of G")
        if metric not in ("inv", "mix"):
            raise ValueError(f"metric must be 'inv' or 'mix', got {metric!r}")
        if not 0 <= eps < math.inf:
            raise ValueError(f"eps must be finite and >= 0, got {eps!r}")
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
        # factorizing Q too costs little and is what detects a rank-deficient H
        P, Q = self._grams(p)
        return p.cached("sylvester", lambda: sylvester_basis(P, Q, self._cholesky(p)[0]))

    # ------------------------------------------------------------------ primitives
    def lie_shape(self, x) -> tuple[int, int]:
        h = as_tensor(x).shape[-1]
        return (h, h)

    def vertical(self, x, omega: Tensor) -> Tensor:
        """``(-G Ω, H Ωᵀ)``."""
        return self._blockwise(as_tensor(x), -omega, mT(omega))

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

    def _weights(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        """``(W_G, W_H)``, ``M(x) u = (u_G W_G, u_H W_H)``: inv ``(P⁻¹, Q⁻¹)``, mix ``(Q, P)``."""
        if self.metric_name == "inv":
            return self._inverses(p)
        P, Q = self._grams(p)
        return Q, P

    def metric(self, x, u: Tensor) -> Tensor:
        """inv: ``(u_G P⁻¹, u_H Q⁻¹)``; mix: ``(u_G Q, u_H P)``."""
        return self._blockwise(u, *self._weights(self.at(x)))

    def metric_inv(self, x, v: Tensor) -> Tensor:
        """inv: ``(v_G P, v_H Q)``; mix: ``(v_G Q⁻¹, v_H P⁻¹)``."""
        p = self.at(x)
        if self.metric_name == "inv":
            P, Q = self._grams(p)
            return self._blockwise(v, P, Q)
        P_inv, Q_inv = self._inverses(p)
        return self._blockwise(v, Q_inv, P_inv)

    # ------------------------------------------------------------------ closed forms
    def inner(self, x, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False) -> Tensor:
        """inv ``tr(P⁻¹ u_Gᵀ v_G) + tr(Q⁻¹ u_Hᵀ v_H)``; mix ``tr(Q u_Gᵀ v_G) + tr(P u_Hᵀ v_H)``.

        Evaluated as ``Σ W ⊙ uᵀv`` per factor: one pass over ``u`` and ``v`` and nothing of their
        size allocated.
        """
        p = self.at(x)
        self._check_vector(p, u)
        if v is None:
            v = u
        else:
            self._check_vector(p, v, "v")
        W_G, W_H = self._weights(p)
        (uG, uH), (vG, vH) = self.split(u), self.split(v)
        value = (W_G * (mT(uG) @ vG)).sum((-2, -1)) + (W_H * (mT(uH) @ vH)).sum((-2, -1))
        return value[..., None, None] if keepdim else value

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
        return self._blockwise(p.x, Lam, -mT(Lam), add=u)

    def _blockwise(
        self, u: Tensor, W_G: Tensor, W_H: Tensor, add: Tensor | None = None, *, into: bool = False
    ) -> Tensor:
        """``(u_G W_G, u_H W_H)``, plus ``add`` if given, for ``h × h`` blocks ``W_G``, ``W_H``.

        ``into=True`` accumulates into ``add`` in place (a contiguous intermediate of the full
        shape that the caller owns) and returns it. Memory traffic, not arithmetic, dominates
        here: when ``G`` and ``H`` have the same shape, ``[G; H]`` is viewed as a batch of
        ``2·heads`` factors and the result is a single batched product with the addition fused
        in; otherwise the two row blocks are separate (strided) products.
        """
        n, (rows, h) = self.n, u.shape[-2:]
        extra = () if add is None else (add.shape[:-2],)
        batch = torch.broadcast_shapes(u.shape[:-2], W_G.shape[:-2], W_H.shape[:-2], *extra)
        u = u.expand(*batch, rows, h)
        W_G, W_H = W_G.expand(*batch, h, h), W_H.expand(*batch, h, h)
        square = rows == 2 * n
        if square:
            W = torch.stack((W_G, W_H), dim=-3).reshape(-1, h, h)
            u = u.reshape(-1, n, h)
        if add is None:
            if square:
                return torch.bmm(u, W).view(*batch, rows, h)
            return self.join(u[..., :n, :] @ W_G, u[..., n:, :] @ W_H)
        if not into:
            if square:
                add = add.expand(*batch, rows, h).reshape(-1, n, h)
                return torch.baddbmm(add, u, W).view(*batch, rows, h)
            add = add.expand(*batch, rows, h).clone(memory_format=torch.contiguous_format)
        if square:
            add.view(-1, n, h).baddbmm_(u, W)
        else:
            flat, u = add.view(-1, rows, h), u.reshape(-1, rows, h)
            flat[:, :n].baddbmm_(u[:, :n], W_G.reshape(-1, h, h))
            flat[:, n:].baddbmm_(u[:, n:], W_H.reshape(-1, h, h))
        return add

    def egrad2rgrad(self, x, u: Tensor) -> Tensor:
        """inv: ``proj(∇_G P, ∇_H Q)``; mix: ``proj(∇_G Q⁻¹, ∇_H P⁻¹)``."""
        p = self.at(x)
        self._check_vector(p, u, "the gradient")
        return self.proju(p, self.metric_inv(p, u))

    def christoffel(self, x, u: Tensor, v: Tensor | None = None) -> Tensor:
        """Symmetric bilinear ``Γ(u, v)`` (class docstring gives ``Γ(ξ, ξ)``; polarised here).

        Each factor block is ``F C_F + u C_u + v C_v`` with ``h × h`` coefficients (see
        :func:`_gamma_inv`, :func:`_gamma_mix`), accumulated into one output.
        """
        p = self.at(x)
        self._check_vector(p, u)
        v = u if v is None else v
        G, H = self.split(p.x)
        uG, uH = self.split(u)
        vG, vH = (uG, uH) if v is u else self.split(v)
        P_inv, Q_inv = self._inverses(p)
        if self.metric_name == "inv":
            cG, cH = _gamma_inv(G, P_inv, uG, vG), _gamma_inv(H, Q_inv, uH, vH)
        else:
            cG = _gamma_mix(Q_inv, uG, vG, H, uH, vH)
            cH = _gamma_mix(P_inv, uH, vH, G, uG, vG)
        out = self._blockwise(u, cG[1], cH[1])
        if v is not u:
            self._blockwise(v, cG[2], cH[2], add=out, into=True)
        return self._blockwise(p.x, cG[0], cH[0], add=out, into=True)

    # ------------------------------------------------------------------ points
    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        """Full column rank of ``G`` and ``H`` to working precision (not needed with ``eps > 0``).

        Every formula factorizes ``GᵀG`` and ``HᵀH``, whose condition numbers are ``cond(G)²``
        and ``cond(H)²``, so a factor counts as rank deficient once ``cond² ≥ 1 / eps`` of the
        dtype. Reports the worst condition numbers.
        """
        x = as_tensor(x)
        if not bool(torch.isfinite(x).all()):
            return False, "the point has non-finite entries"
        if x.numel() == 0:
            return True, None
        worst = []
        for name, F in zip(("G", "H"), self.split(x), strict=True):
            s = torch.linalg.svdvals(F)
            cond = (s[..., 0] / s[..., -1]).max().item()
            worst.append((name, cond, not cond**2 < 1 / torch.finfo(F.dtype).eps))
        for name, cond, deficient in worst:
            if deficient and self.eps == 0:
                return False, (
                    f"{name} is rank deficient to {x.dtype} precision (worst condition number "
                    f"{cond:.3e}); compute in float64 or use eps > 0 to relax the geometry"
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


def _gamma_inv(F: Tensor, W_inv: Tensor, u: Tensor, v: Tensor) -> tuple[Tensor, ...]:
    """inv factor part ``F W⁻¹ sym(uᵀv) - u W⁻¹ sym(vᵀF) - v W⁻¹ sym(uᵀF)`` as ``(C_F, C_u, C_v)``.

    ``W`` is the Gram matrix of ``F``; for ``v is u`` the two last terms are one (``C_v`` is
    then unused).
    """
    Su = W_inv @ sym(mT(u) @ F)
    if v is u:
        return W_inv @ (mT(u) @ u), -2 * Su, None
    Sv = W_inv @ sym(mT(v) @ F)
    return W_inv @ sym(mT(u) @ v), -Sv, -Su


def _gamma_mix(
    W_inv: Tensor, uF: Tensor, vF: Tensor, K: Tensor, uK: Tensor, vK: Tensor
) -> tuple[Tensor, ...]:
    """mix factor part ``[u_F sym(v_Kᵀ K) + v_F sym(u_Kᵀ K) - F sym(u_Kᵀ v_K)] W⁻¹`` as
    ``(C_F, C_u, C_v)``.

    ``W`` is the Gram matrix of the other factor ``K``; for ``vF is uF`` the first two terms are
    one (``C_v`` is then unused).
    """
    SuK = sym(mT(uK) @ K) @ W_inv
    if vF is uF:
        return -(mT(uK) @ uK) @ W_inv, 2 * SuK, None
    SvK = sym(mT(vK) @ K) @ W_inv
    return -sym(mT(uK) @ vK) @ W_inv, SvK, SuK
