r"""The ``inv`` metric ``tr(P⁻¹ η_Gᵀ ζ_G) + tr(Q⁻¹ η_Hᵀ ζ_H)``: total space and GL(h) quotient."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ... import linalg
from ...linalg import expm, expm_squarings, mT, solve_sylvester, sylvester_basis, sym
from ..base import AtPoint, speed_bound
from .blocks import Coefficients, Products
from .quotient import GLQuotient
from .total import GLTotalSpace

Tensor = torch.Tensor

__all__ = ["GLInvQuotient", "InvTotalSpace"]


class InvTotalSpace(GLTotalSpace):
    r"""``GLTotalSpace(n, "inv")``: weights ``(W_G, W_H) = (P⁻¹, Q⁻¹)``.

    - ``M⁻¹ v = (v_G P, v_H Q)``;
    - isotropic map ``(e_G L_Pᵀ, e_H L_Qᵀ)``;
    - Christoffel contraction, G part (H part: ``(G, P) ↔ (H, Q)``):
      ``Γ_G(ξ, ξ) = -ξ_G P⁻¹ (ξ_Gᵀ G + Gᵀ ξ_G) + G P⁻¹ ξ_Gᵀ ξ_G``;
    - geodesics in closed form for ``eps = 0`` (:func:`inv_geodesic`, per factor), else
      integrated in the span of ``[F, ξ_F]`` (:meth:`GLTotalSpace.geodesic`). The metric is
      invariant under all of ``GL(h)``, so these are the geodesics of every quotient of this
      space (:class:`GLInvQuotient`, the rotary quotient with the ``"inv"`` metric): one closed
      form for all of them.
    """

    name = "InvTotalSpace"
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

    @property
    def closed_form_geodesic(self) -> bool:  # type: ignore[override]
        """Closed form for ``eps = 0`` (the relaxed metric is integrated)."""
        return not self.relaxed

    def geodesic(
        self, x: Tensor | AtPoint, u: Tensor, t: float | Tensor = 1.0, *, steps: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(γ(t), γ'(t))``: closed form per factor (:func:`inv_geodesic`) for ``eps = 0``
        (``steps`` unused); with ``eps > 0`` the relaxed metric is not GL(h)-invariant and the
        geodesic is integrated (:meth:`GLTotalSpace.geodesic`)."""
        if self.relaxed:
            return super().geodesic(x, u, t, steps=steps)
        point, velocity = self._closed_form(x, u, t, velocity=True)
        assert velocity is not None
        return point, velocity

    def expmap(self, x: Tensor | AtPoint, u: Tensor, *, steps: int | None = None) -> Tensor:
        """``γ(1)``: for ``eps = 0`` the closed form without the velocity (no ``F'(1)``, whose
        ``n × h`` products cost as much as the point's), else :meth:`GLTotalSpace.expmap`."""
        if self.relaxed:
            return super().expmap(x, u, steps=steps)
        return self._closed_form(x, u, 1.0, velocity=False)[0]

    def expmap_vjp(self, x: Tensor | AtPoint, u: Tensor, d: Tensor) -> Tensor:
        """``J(u)ᵀ d`` of :meth:`expmap`: for ``eps = 0`` the closed form ``γ_F(1) = F A_F +
        u_F B_F``, its ``h × h`` coefficients functions of ``Fᵀ u_F`` and ``u_Fᵀ u_F``
        (:func:`inv_geodesic`; :meth:`~.total.GLTotalSpace._affine_vjp`) with the matrix
        exponentials' squarings of :meth:`expmap`; else (``eps > 0``, or a subclass's own
        ``expmap``) autodiff through the map."""
        if self.relaxed or type(self).expmap is not InvTotalSpace.expmap:
            return super().expmap_vjp(x, u, d)
        p = self.at(x)
        bound = speed_bound()
        L = torch.stack(self.cholesky_factors(p))
        L_inv = p.cached("cholesky_inverses", lambda: lower_inverse(L))

        def coefficients(S, T):
            rows = _rows(torch.stack([mT(s) for s in S]), torch.stack(T), L_inv, 1.0, bound)[0]
            A, B = _coefficients(rows, L, L_inv)
            return A.unbind(0), B.unbind(0)

        return self._affine_vjp(p, u, d, coefficients)

    def _closed_form(
        self, x: Tensor | AtPoint, u: Tensor, t: float | Tensor, velocity: bool
    ) -> tuple[Tensor, Tensor | None]:
        """``(γ(t), γ'(t))`` by :func:`inv_geodesics` (``γ'(t)`` only with ``velocity``), with
        the bound of :func:`~quotientgeo.manifolds.base.speeds_at_most` where ``t`` is a number
        of size at most 1 (:func:`squarings_at_speed` holds there)."""
        p = self.at(x)
        self._check_vector(p, u)
        bound, speed = speed_bound(), None
        if bound is not None and not isinstance(t, Tensor) and abs(t) <= 1:
            speed = bound * abs(t)
        if isinstance(t, Tensor):
            t = self._times(t, p, u)
        (G, H), (uG, uH) = self.split(p), self.split(u)
        # the factors stacked anew on each call: a cached stack would be a second copy of them
        L = torch.stack(self.cholesky_factors(p))
        L_inv = p.cached("cholesky_inverses", lambda: lower_inverse(L))
        (G1, dG), (H1, dH) = inv_geodesics(
            [(G, uG), (H, uH)], L, t, velocity=velocity, speed=speed, L_inv=L_inv
        )
        if dG is None or dH is None:
            return self.join(G1, H1), None
        return self.join(G1, H1), self.join(dG, dH)

    def gamma_coefficients(self, k: Products, same: bool) -> Coefficients:
        """:func:`inv_coefficients`."""
        return inv_coefficients(k, same)


class GLInvQuotient(GLQuotient):
    r"""``GLQuotient(n, "inv")``: :class:`InvTotalSpace` by ``GL(h)``.

    - horizontal space ``ξ_Gᵀ G Q = P Hᵀ ξ_H``; projection ``(ξ_G + G Λ, ξ_H - H Λᵀ)`` with
      ``Λ = Xᵀ``, ``A X + X A = B``, ``A = P Q``, ``B = P Hᵀ ξ_H - ξ_Gᵀ G Q``, solved in the
      eigenbasis of ``A = V diag(d) V⁻¹`` (``P = L Lᵀ``, ``Lᵀ Q L = U diag(d) Uᵀ``, ``V = L U``);
    - Riemannian gradient ``proj(∇_G P, ∇_H Q)``;
    - metric, ``M⁻¹``, isotropic map, Christoffel symbols and the closed-form geodesic
      (``eps = 0``) from :class:`InvTotalSpace`.
    """

    total_class = InvTotalSpace

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


def inv_coefficients(k: Products, same: bool) -> Coefficients:
    """Per factor ``(F, W) ∈ {(G, P), (H, Q)}``:
    ``Γ_F(u, v) = F W⁻¹ sym(u_Fᵀ v_F) - u_F W⁻¹ sym(v_Fᵀ F) - v_F W⁻¹ sym(u_Fᵀ F)``."""
    G = _gamma(k.P_inv, k.uF[0], k.vF[0], k.uv[0], same)
    return G, _gamma(k.Q_inv, k.uF[1], k.vF[1], k.uv[1], same)


def _gamma(
    W_inv: Tensor, uF: Tensor, vF: Tensor, uv: Tensor, same: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(C_F, C_u, C_v)`` of one factor from ``uF = u_Fᵀ F``, ``vF = v_Fᵀ F``, ``uv = u_Fᵀ v_F``;
    for ``same`` (``v is u``) the two last terms are one and ``C_v`` is ``None``."""
    if same:  # -2 W⁻¹ sym(uF) as -W⁻¹ (uF + uFᵀ): the same bits (the factors 2 and ½ are exact)
        return W_inv @ uv, -(W_inv @ (uF + mT(uF))), None
    return W_inv @ sym(uv), -(W_inv @ sym(vF)), -(W_inv @ sym(uF))


def inv_geodesic(
    F: Tensor, xi: Tensor, L: Tensor, t: Tensor | float = 1.0, L_inv: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    r"""Geodesic ``(F(t), F'(t))`` of ``g_F(η, η) = tr((FᵀF)⁻¹ ηᵀη)`` from ``F(0) = F``,
    ``F'(0) = ξ``, batched over leading dimensions; ``L`` is the lower Cholesky factor of ``FᵀF``
    (``L_inv`` its inverse, computed if not given).

    The metric is invariant under ``F ↦ O F A`` (``O ∈ O(n)``, ``A ∈ GL(h)``), and its
    geodesics are orbits of one-parameter subgroups of that group:
    ``F(t) = expm(tΩ) Q expm(tXᵀ) R`` with ``F = QR`` (``R = Lᵀ``), ``W = ξ R⁻¹``,
    ``X = QᵀW``, ``W⊥ = W - QX`` and the skew ``Ω = W⊥Qᵀ - QW⊥ᵀ + Q(X - Xᵀ)Qᵀ``. ``Ω`` maps the
    span of ``[Q, W⊥]`` into itself, ``Ω [Q, W⊥] = [Q, W⊥] M`` with the ``2h × 2h``
    ``M = [[X - Xᵀ, -W⊥ᵀW⊥], [I, 0]]``, so with ``Y(t) = expm(tM)[:, :h] expm(tXᵀ)``:

        ``F(t) = F R⁻¹ (Y₁ - X Y₂) R + ξ R⁻¹ Y₂ R``,   ``F'(t)`` the same with ``Y' = MY + YXᵀ``

    (``Y₁``, ``Y₂`` the top and bottom ``h`` rows). Only ``h × h`` Gram products enter
    (``X = L⁻¹ Fᵀξ L⁻ᵀ``, ``W⊥ᵀW⊥ = L⁻¹ ξᵀξ L⁻ᵀ - XᵀX``): no QR, no ``n × n`` matrix, two
    ``n × h`` products with ``h × h`` coefficients, and the map is smooth in ``ξ``, also where
    ``W⊥ = 0`` (a velocity inside the column space) and at ``ξ = 0``.
    """
    stacked_inv = None if L_inv is None else L_inv[None]
    ((point, velocity),) = inv_geodesics([(F, xi)], L[None], t, L_inv=stacked_inv)
    assert velocity is not None
    return point, velocity


def inv_geodesics(
    factors: Sequence[tuple[Tensor, Tensor]],
    L: Tensor,
    t: Tensor | float = 1.0,
    velocity: bool = True,
    speed: float | None = None,
    L_inv: Tensor | None = None,
) -> list[tuple[Tensor, Tensor | None]]:
    """:func:`inv_geodesic` of several factors ``(F, ξ)`` at once, factors that share their
    leading dimensions and ``h`` (the two factors of one point; their row counts may differ):
    ``L`` their Cholesky factors stacked, ``(len(factors), ..., h, h)`` (``L_inv`` the same of
    their inverses, computed if not given). Every ``h × h`` step is one batched operator for
    all of them, the two matrix exponentials included; only the products with ``F`` and ``ξ``
    (``Fᵀξ``, ``ξᵀξ`` and ``F A + ξ B``) are taken factor by factor. Without ``velocity``,
    ``F'(t)`` is not formed (``None``).

    ``speed``: a bound on every factor's ``ν = |t| ‖ξ L⁻ᵀ‖_F`` (its speed in the metric), from
    which the exponentials take their squarings (:func:`squarings_at_speed`); ``None``:
    :func:`~quotientgeo.linalg.expm`'s own choice."""
    L_inv = lower_inverse(L) if L_inv is None else L_inv
    h = L.shape[-1]
    # Fᵀξ and ξᵀξ of every factor, one stack
    products = [mT(F) @ xi for F, xi in factors] + [mT(xi) @ xi for _, xi in factors]
    FtXi, XitXi = torch.stack(products).unflatten(0, (2, len(factors))).unbind(0)
    rows, X, minus_S2 = _rows(FtXi, XitXi, L_inv, t, speed)
    points = _combinations(factors, _coefficients(rows, L, L_inv))
    if not velocity:
        return [(point, None) for point in points]
    Y1, Y2 = rows.split(h, -2)
    Y = torch.cat([linalg.matmul_add(Y1, X, Y2), Y2], -2)
    bottom = linalg.identity(2 * h, X)[:h].expand(*X.shape[:-2], h, 2 * h)  # [I, 0]
    M = torch.cat([torch.cat([X - mT(X), minus_S2], -1), bottom], -2)
    V1, V2 = (M @ Y + Y @ mT(X)).split(h, -2)  # Y' = M Y + Y Xᵀ
    rows = torch.cat([linalg.matmul_add(V1, X, V2, alpha=-1.0), V2], -2)
    velocities = _combinations(factors, _coefficients(rows, L, L_inv))
    return list(zip(points, velocities, strict=True))


#: The relative slack of :func:`squarings_at_speed`'s bound: a velocity scaled to the bound
#: in the compute dtype, or stored in half precision, may exceed it by its rounding.
SPEED_SLACK = 1.01


def squarings_at_speed(h: int, speed: float) -> tuple[int, int]:
    """The squarings of the two matrix exponentials of :func:`inv_geodesics` (of the balanced
    ``2h × 2h`` ``M`` and of ``tXᵀ``) where every factor's speed ``ν = |t| ‖ξ L⁻ᵀ‖_F`` is at
    most ``speed``: ``‖X‖_F ≤ ν`` and ``‖W⊥ᵀW⊥‖_F ≤ ν²`` (``X = QᵀξR⁻¹``, ``W⊥ = ξR⁻¹ - QX``,
    ``Q`` orthonormal), so with ``σ = max(‖W⊥ᵀW⊥‖_F^½, 10⁻³)`` and ``‖A‖₁ ≤ √h ‖A‖_F``,
    ``‖tM‖₁ ≤ 2√h ν + σ`` on its first ``h`` columns and ``√h σ`` on the others, and
    ``‖tXᵀ‖₁ ≤ √h ν`` (:func:`~quotientgeo.linalg.expm_squarings` of each, ``ν`` with
    :data:`SPEED_SLACK`), at most :data:`~quotientgeo.linalg.DEFERRED_SQUARINGS`: a step that
    needs more fails its checks, as without the bound."""
    nu = speed * SPEED_SLACK
    root = math.sqrt(h)
    sigma = max(nu, 1e-3)
    bounds = (max(2 * root * nu + sigma, root * sigma), root * nu)
    s_M, s_X = (min(expm_squarings(b), linalg.DEFERRED_SQUARINGS) for b in bounds)
    return s_M, s_X


def _rows(
    FtXi: Tensor, XitXi: Tensor, L_inv: Tensor, t: Tensor | float, speed: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``([Y₁ - X Y₂; Y₂], X, -W⊥ᵀW⊥)`` of :func:`inv_geodesic` from ``Fᵀξ``, ``ξᵀξ``, ``L⁻¹``,
    the time and the speed bound (:func:`inv_geodesics`): the ``h × h`` part of the map."""
    h = L_inv.shape[-1]
    M, X, minus_S2, sigma = _generators(FtXi, XitXi, L_inv)
    s_M, s_X = (None, None) if speed is None else squarings_at_speed(h, speed)

    def times_t(A: Tensor) -> Tensor:
        return A if isinstance(t, (int, float)) and t == 1 else t * A

    E1, E2 = expm(times_t(M), s_M)[..., :h].split(h, -2)  # expm(t M_balanced)[:, :h]
    E2 = E2 / sigma
    E_X = expm(times_t(mT(X)), s_X)
    # [Y₁ - X Y₂; Y₂] with Y = [E₁; E₂/σ] expm(tXᵀ)
    rows = torch.cat([linalg.matmul_add(E1, X, E2, alpha=-1.0), E2], -2) @ E_X
    return rows, X, minus_S2


def _generators(FtXi: Tensor, XitXi: Tensor, L_inv: Tensor):
    """``(M_balanced, X, -W⊥ᵀW⊥, σ)`` of :func:`inv_geodesic` from ``Fᵀξ``, ``ξᵀξ`` and
    ``L⁻¹``."""
    h = L_inv.shape[-1]

    def congruence(A: Tensor) -> Tensor:  # L⁻¹ A L⁻ᵀ
        return L_inv @ A @ mT(L_inv)

    X = congruence(FtXi)
    # -W⊥ᵀW⊥ = XᵀX - L⁻¹ ξᵀξ L⁻ᵀ, the sign M takes, in one product
    minus_S2 = linalg.matmul_add(congruence(XitXi), mT(X), X, beta=-1.0)
    # balance M by the similarity diag(I, σI), M_b = [[X - Xᵀ, -W⊥ᵀW⊥ / σ], [σI, 0]] (the
    # same expm[:, :h] up to the factor 1/σ on the bottom block): its norm drops from ≥ 1 to
    # the size of the velocity; σ is a constant
    sigma = torch.linalg.matrix_norm(minus_S2.detach()).sqrt().clamp_min(1e-3)[..., None, None]
    top = torch.cat([X - mT(X), minus_S2 / sigma], -1)
    bottom = sigma * linalg.identity(2 * h, X)[:h]  # σ [I, 0]
    return torch.cat([top, bottom], -2), X, minus_S2, sigma


def _coefficients(rows: Tensor, L: Tensor, L_inv: Tensor) -> tuple[Tensor, Tensor]:
    """``(A, B)`` with ``[F, ξ] [[R⁻¹, -R⁻¹X], [0, R⁻¹]] Y R = F A + ξ B`` (``R = Lᵀ``), all
    factors at once, from ``rows = [Y₁ - X Y₂; Y₂]``: ``A = R⁻¹ (Y₁ - X Y₂) R``,
    ``B = R⁻¹ Y₂ R``."""
    right = rows @ mT(L)  # both blocks times R in one product
    top, bottom = right.split(L.shape[-1], -2)
    return mT(L_inv) @ top, mT(L_inv) @ bottom


def _combinations(
    factors: Sequence[tuple[Tensor, Tensor]], coefficients: tuple[Tensor, Tensor]
) -> list[Tensor]:
    """``F A + ξ B`` factor by factor."""
    A, B = coefficients
    return [
        linalg.matmul_add(F @ A_i, xi, B_i)
        for (F, xi), A_i, B_i in zip(factors, A.unbind(0), B.unbind(0), strict=True)
    ]


def lower_inverse(L: Tensor) -> Tensor:
    """``L⁻¹`` of a lower triangular ``L`` (one triangular solve against the identity)."""
    return torch.linalg.solve_triangular(
        L, linalg.identity(L.shape[-1], L).expand_as(L), upper=False
    )
