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
        LP, LQ = self.cholesky_factors(p)
        LP_inv, LQ_inv = p.cached("cholesky_inv", lambda: (lower_inverse(LP), lower_inverse(LQ)))
        (G1, dG), (H1, dH) = inv_geodesics(
            [(G, uG, LP, LP_inv), (H, uH, LQ, LQ_inv)], t, velocity=velocity, speed=speed
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
    Su = W_inv @ sym(uF)
    if same:
        return W_inv @ uv, -2 * Su, None
    return W_inv @ sym(uv), -(W_inv @ sym(vF)), -Su


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
    point, velocity = inv_geodesics([(F, xi, L, L_inv)], t)[0]
    assert velocity is not None
    return point, velocity


def inv_geodesics(
    factors: Sequence[tuple[Tensor, Tensor, Tensor, Tensor | None]],
    t: Tensor | float = 1.0,
    velocity: bool = True,
    speed: float | None = None,
) -> list[tuple[Tensor, Tensor | None]]:
    """:func:`inv_geodesic` of several factors ``(F, ξ, L, L_inv)`` at once: where their
    ``h × h`` matrices have one shape (the two factors of one point), the matrix exponentials
    of all of them are two batched calls of :func:`~quotientgeo.linalg.expm`. Without
    ``velocity``, ``F'(t)`` is not formed (``None``).

    ``speed``: a bound on every factor's ``ν = |t| ‖ξ L⁻ᵀ‖_F`` (its speed in the metric), from
    which the exponentials take their squarings (:func:`squarings_at_speed`); ``None``:
    :func:`~quotientgeo.linalg.expm`'s own choice."""
    parts = [
        _generators(F, xi, lower_inverse(L) if L_inv is None else L_inv)
        for F, xi, L, L_inv in factors
    ]
    if len({part[0].shape for part in parts}) > 1:  # nothing to batch
        return [inv_geodesics([f], t, velocity, speed)[0] for f in factors]
    h = factors[0][0].shape[-1]
    s_M, s_X = (None, None) if speed is None else squarings_at_speed(h, speed)

    def times_t(A: Tensor) -> Tensor:
        return A if isinstance(t, (int, float)) and t == 1 else t * A

    E = expm(times_t(torch.stack([part[0] for part in parts])), s_M)[..., :h]
    Xt = expm(times_t(mT(torch.stack([part[1] for part in parts]))), s_X)
    return [
        _moved(F, xi, L, *part[1:], E_i, Xt_i, velocity)
        for (F, xi, L, _), part, E_i, Xt_i in zip(
            factors, parts, E.unbind(0), Xt.unbind(0), strict=True
        )
    ]


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


def _generators(F: Tensor, xi: Tensor, L_inv: Tensor):
    """``(M_balanced, X, W⊥ᵀW⊥, σ, L⁻¹)`` of :func:`inv_geodesic`."""
    h = F.shape[-1]

    def congruence(A: Tensor) -> Tensor:  # L⁻¹ A L⁻ᵀ
        return L_inv @ A @ mT(L_inv)

    X = congruence(mT(F) @ xi)
    S2 = congruence(mT(xi) @ xi) - mT(X) @ X
    # balance M by the similarity diag(I, σI), M_b = [[X - Xᵀ, -W⊥ᵀW⊥ / σ], [σI, 0]] (the
    # same expm[:, :h] up to the factor 1/σ on the bottom block): its norm drops from ≥ 1 to
    # the size of the velocity; σ is a constant
    sigma = torch.linalg.matrix_norm(S2.detach()).sqrt().clamp_min(1e-3)[..., None, None]
    top = torch.cat([X - mT(X), S2 / -sigma], -1)
    bottom = sigma * linalg.identity(2 * h, X)[:h]  # σ [I, 0]
    return torch.cat([top, bottom], -2), X, S2, sigma, L_inv


def _moved(
    F: Tensor, xi: Tensor, L: Tensor, X: Tensor, S2: Tensor, sigma: Tensor, L_inv: Tensor,
    E: Tensor, Xt: Tensor, velocity: bool = True,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """``(F(t), F'(t))`` of :func:`inv_geodesic` from ``E = expm(t M_balanced)[:, :h]`` and
    ``Xt = expm(t Xᵀ)`` (``F'(t)`` only with ``velocity``, else ``None``)."""
    h = F.shape[-1]
    E1, E2 = E.split(h, -2)
    Y = torch.cat([E1, E2 / sigma], -2) @ Xt  # expm(t M_unbalanced)[:, :h] expm(tXᵀ)

    def point(Y: Tensor) -> Tensor:  # [F, ξ] [[R⁻¹, -R⁻¹X], [0, R⁻¹]] Y R with R = Lᵀ
        Y1, Y2 = Y.split(h, -2)
        A = mT(L_inv) @ (Y1 - X @ Y2) @ mT(L)
        B = mT(L_inv) @ Y2 @ mT(L)
        return F @ A + xi @ B

    if not velocity:
        return point(Y), None
    bottom = linalg.identity(2 * h, X)[:h].expand(*X.shape[:-2], h, 2 * h)  # [I, 0]
    M = torch.cat([torch.cat([X - mT(X), -S2], -1), bottom], -2)
    return point(Y), point(M @ Y + Y @ mT(X))


def lower_inverse(L: Tensor) -> Tensor:
    """``L⁻¹`` of a lower triangular ``L`` (one triangular solve against the identity)."""
    return torch.linalg.solve_triangular(
        L, linalg.identity(L.shape[-1], L).expand_as(L), upper=False
    )
