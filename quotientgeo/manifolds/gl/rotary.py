r"""The GL pair quotient of attention scores with rotary position embeddings.

With rotary embeddings the score of a query ``q`` and a key ``k`` at offset ``Δ`` is
``qᵀ R_Δ k``, ``R_Δ`` a rotation by ``θ_j Δ`` on each rotated coordinate pair (distinct
frequencies ``θ_j``) and the identity on the unrotated coordinates (partial rotary). A move
``(G, H) ↦ (G A⁻¹, H Aᵀ)`` keeps every score only if ``A`` commutes with every ``R_Δ``: on each
pair a complex scaling ``[[a, -b], [b, a]]``, on the ``u`` unrotated coordinates any element of
``GL(u)``, and nothing across. The symmetry group is therefore ``(C*)^{r/2} × GL(u)``, a
subgroup of ``GL(h)`` (``h = r + u``, ``r`` rotated coordinates).
"""

from __future__ import annotations

import math

import torch

from ...linalg import cholesky, conditioned_matrix, gram, log_uniform, mT, tensor_sum
from ...validation import integer
from ..base import DEFAULT_METRIC, AtPoint
from ..groups import DEFAULT_CONDITION, check_condition
from ..quotient import Quotient
from .damping import BallDamping, FrameDamping
from .group import GLGroup
from .quotient import GLQuotient
from .total import GLTotalSpace

Tensor = torch.Tensor

__all__ = ["RotaryGLQuotient", "RotaryGroup"]

PAIRINGS = ("half", "interleaved")


class RotaryGroup(GLGroup):
    r"""The rotary subgroup ``(C*)^{r/2} × GL(u)`` of ``GL(h)``, acting as :class:`GLGroup`.

    Its Lie algebra ``𝔰`` has the coordinates ``ω = (a, b, vec Ω_u)`` (``r + u²`` numbers):
    ``[[a_j, -b_j], [b_j, a_j]]`` on each rotated pair, ``Ω_u`` on the ``u`` unrotated
    coordinates, zero elsewhere (:meth:`algebra`); vertical vectors ``(-G Ω, H Ωᵀ)``,
    ``Ω = algebra(ω)``. Pairs and ``r`` as in :class:`RotaryGLQuotient`.
    """

    def __init__(self, n: int, rotary_dims: int | None = None, pairing: str = "half"):
        if rotary_dims is not None:
            rotary_dims = integer("rotary_dims", rotary_dims)
            if rotary_dims < 2 or rotary_dims % 2:
                raise ValueError(f"rotary_dims must be an even number >= 2, got {rotary_dims}")
        if pairing not in PAIRINGS:
            raise ValueError(f"pairing must be one of {PAIRINGS}, got {pairing!r}")
        super().__init__(n)
        self.rotary_dims = rotary_dims
        self.pairing = pairing

    def __repr__(self) -> str:
        return f"RotaryGroup(n={self.n}, rotary_dims={self.rotary_dims}, pairing={self.pairing!r})"

    def check_shape(self, shape: tuple[int, ...], name: str) -> tuple[bool, str | None]:
        """``(ok, reason)``: ``h`` must hold the rotated coordinates (an even number of them)."""
        h = shape[-1]
        if self.rotary_dims is None and h % 2:
            return False, f"{name} has an odd number h={h} of columns; all cannot be rotated"
        if self.rotary_dims is not None and self.rotary_dims > h:
            return False, f"{name} has h={h} columns, fewer than rotary_dims={self.rotary_dims}"
        return True, None

    def group_name(self, shape: tuple[int, ...]) -> str:
        h = shape[-1]
        r = h if self.rotary_dims is None else self.rotary_dims
        return f"(C*)^{r // 2}" + (f" × GL({h - r})" if h > r else "")

    def coordinates(
        self, h: int, device: torch.device | str | None = None
    ) -> tuple[Tensor, int, int]:
        """``(order, m, u)``: coordinate indices ordered (first of each of the ``m`` pairs,
        second of each pair, the ``u`` unrotated ones)."""
        r = h if self.rotary_dims is None else self.rotary_dims
        m = r // 2
        j = torch.arange(m, device=device)
        first, second = (j, j + m) if self.pairing == "half" else (2 * j, 2 * j + 1)
        order = torch.cat([first, second, torch.arange(r, h, device=device)])
        return order, m, h - r

    def lie_shape(self, p: AtPoint) -> tuple[int]:
        _, m, u = self.coordinates(p.x.shape[-1])
        return (2 * m + u * u,)

    def algebra(self, omega: Tensor, h: int) -> Tensor:
        """``ω = (a, b, vec Ω_u)`` ``(..., r + u²)`` -> ``Ω ∈ 𝔰`` ``(..., h, h)``: ``[[a, -b],
        [b, a]]`` on each pair, ``Ω_u`` on the unrotated coordinates, zero elsewhere."""
        order, m, u = self.coordinates(h, omega.device)
        a, b = omega[..., :m], omega[..., m : 2 * m]
        blocks = torch.cat(
            [
                torch.cat([torch.diag_embed(a), -torch.diag_embed(b)], dim=-1),
                torch.cat([torch.diag_embed(b), torch.diag_embed(a)], dim=-1),
            ],
            dim=-2,
        )
        lead = omega.shape[:-1]
        free = omega[..., 2 * m :].reshape(*lead, u, u)
        top = torch.cat([blocks, blocks.new_zeros(*lead, 2 * m, u)], dim=-1)
        bottom = torch.cat([free.new_zeros(*lead, u, 2 * m), free], dim=-1)
        standard = torch.cat([top, bottom], dim=-2)
        back = torch.argsort(order)
        return standard[..., back, :][..., :, back]

    def vertical(self, p: AtPoint, omega: Tensor) -> Tensor:
        """``(-G Ω, H Ωᵀ)`` with ``Ω = algebra(ω)``."""
        return super().vertical(p, self.algebra(omega, p.x.shape[-1]))

    def random_group(
        self,
        x: Tensor | AtPoint,
        *,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        condition: float = DEFAULT_CONDITION,
    ) -> Tensor:
        """``A = scale · S``, ``S ∈ (C*)^{r/2} × GL(u)`` with ``cond(S) ≤ c`` (``c =
        condition``): on each pair the complex scaling ``ρ e^{iθ}`` (``[[a, -b], [b, a]]`` with
        ``a + ib = ρ e^{iθ}``), ``ρ`` log-uniform in ``[c^{-1/2}, c^{1/2}]`` and ``θ`` uniform
        in ``[0, 2π)``; on the unrotated coordinates ``U diag(σ) Vᵀ`` as in
        :meth:`GLGroup.random_group`."""
        x = x.x if isinstance(x, AtPoint) else x
        condition = check_condition(condition)
        h = x.shape[-1]
        _, m, u = self.coordinates(h)
        batch = x.shape[:-2]
        kw = {"generator": generator, "dtype": x.dtype, "device": x.device}
        rho = log_uniform(*batch, m, condition=condition, **kw)
        theta = (2 * math.pi) * torch.rand(*batch, m, **kw)
        free = conditioned_matrix(*batch, u, u, condition=condition, **kw)
        omega = torch.cat([rho * torch.cos(theta), rho * torch.sin(theta), free.flatten(-2)], -1)
        return self.algebra(omega, h).mul_(scale)


class RotaryGLQuotient(Quotient):
    r"""Quotient of GL pairs ``x = [G; H]`` by the rotary subgroup ``(C*)^{r/2} × GL(u)``.

    The metric is a GL(h)-invariant metric of :class:`GLQuotient` (``"inv"``, ``"mix"`` or
    ``s``); it is invariant under the subgroup too, so it descends to this (larger) quotient.
    A :class:`~quotientgeo.manifolds.quotient.Quotient` of the metric's
    :class:`~.total.GLTotalSpace` by :class:`RotaryGroup`: the metric, Christoffel symbols and
    geodesics (closed form for ``"inv"`` with ``eps = 0``) are those of the total space, which
    :attr:`gl`, the GL(h) quotient, shares (one point cache for both); only the vertical space
    shrinks to ``{(-G Ω, H Ωᵀ) : Ω ∈ 𝔰}`` with ``𝔰`` the commutant of the rotations, so the
    horizontal space and the projection change.

    Coordinate pairs (``pairing``): ``"half"`` pairs ``j`` with ``j + r/2`` (Hugging Face's
    ``rotate_half``: Llama, Mistral, Qwen, Gemma, Phi-3, GPT-NeoX), ``"interleaved"`` pairs
    ``2j`` with ``2j + 1`` (GPT-J). The first ``r = rotary_dims`` coordinates are rotated
    (``None``: all ``h``), the other ``u = h - r`` are not.

    Projection (closed form). Write the GL metric as ``M(x)u = (u_G W_G, u_H W_H)`` and
    ``P₀ = GᵀG``, ``Q₀ = HᵀH``. The vertical Gram operator on ``gl(h)`` (dual in the
    Frobenius product) is ``K(Ω) = P₀ Ω W_G + W_H Ω Q₀`` and the pairing of a vertical vector
    with ``ξ`` is ``<Ω, b>`` with ``b = -Gᵀ ξ_G W_G + W_H ξ_Hᵀ H``. The projection is
    ``ξ - (-G Ω, H Ωᵀ)`` with ``Ω ∈ 𝔰`` solving ``Π_𝔰 K(Ω) = Π_𝔰 b``. In coordinates ordered
    ``(first of each pair, second of each pair, unrotated)`` and ``Ω = Ω_r ⊕ Ω_u``:

    - the unrotated block is the two-sided Sylvester equation
      ``S(Ω_u) = P₀ᵤᵤ Ω_u W_Gᵤᵤ + W_Hᵤᵤ Ω_u Q₀ᵤᵤ = bᵤᵤ - Σ_t L_tᵤᵣ Ω_r R_tᵣᵤ`` (terms
      ``(L, R) ∈ {(P₀, W_G), (W_H, Q₀)}``), solved by ``S⁻¹(C) = F_a [(F_aᵀ C F_b) / (d_i + e_j)]
      F_bᵀ`` with ``F_a = L_a⁻ᵀ U``, ``F_b = L_b⁻ᵀ Y`` from the Cholesky factors
      ``W_Hᵤᵤ = L_a L_aᵀ``, ``W_Gᵤᵤ = L_b L_bᵀ`` and the eigendecompositions
      ``L_a⁻¹ P₀ᵤᵤ L_a⁻ᵀ = U diag(d) Uᵀ``, ``L_b⁻¹ Q₀ᵤᵤ L_b⁻ᵀ = Y diag(e) Yᵀ``;
    - eliminating ``Ω_u`` leaves an ``r × r`` symmetric positive definite system for the
      ``r`` real coordinates ``(a_j, b_j)`` of ``Ω_r``, assembled by gathers from the entries
      of ``P₀``, ``Q₀``, ``W_G``, ``W_H`` and factorized once per point.

    Cost per point: ``O(h³ + r² u²)`` once, then ``O((n+m) h² + r u² + u³)`` per projection.

    Args:
        n: number of rows of ``G``.
        metric: ``"inv"``, ``"mix"`` (default) or the interpolation weight ``s``.
        eps: Gram relaxation of the metric, as in :class:`GLQuotient`.
        rotary_dims: number ``r`` of rotated coordinates (even); ``None`` rotates all.
        pairing: ``"half"`` or ``"interleaved"``.
        exp_steps: RK4 steps where :meth:`geodesic` integrates (``None``: automatic).
    """

    name = "RotaryGLQuotient"
    ndim = 2

    def __init__(
        self,
        n: int,
        metric: str | float = DEFAULT_METRIC,
        eps: float | BallDamping | FrameDamping = 0.0,
        *,
        rotary_dims: int | None = None,
        pairing: str = "half",
        exp_steps: int | None = None,
    ):
        group = RotaryGroup(n, rotary_dims, pairing)
        gl = GLQuotient(n, metric, eps, exp_steps=exp_steps)
        super().__init__(gl.total, group, exp_steps=exp_steps)
        self.gl: GLQuotient = gl  # the GL(h) quotient of the same total space
        self.rotary_dims = group.rotary_dims
        self.pairing = group.pairing

    @property
    def total(self) -> GLTotalSpace:
        """The metric's total space (shared with :attr:`gl`)."""
        return self.gl.total

    @property
    def n(self) -> int:
        return self.gl.n

    def extra_repr(self) -> str:
        return f"{self.gl.extra_repr()}, rotary_dims={self.rotary_dims}, pairing={self.pairing!r}"

    def with_metric(
        self, metric: str | float, *, eps: float | BallDamping | FrameDamping | None = None
    ) -> RotaryGLQuotient:
        """The same subgroup with the GL metric ``metric`` (and ``eps``, unless ``None``)."""
        return RotaryGLQuotient(
            self.n,
            metric,
            self.gl.eps if eps is None else eps,
            rotary_dims=self.rotary_dims,
            pairing=self.pairing,
            exp_steps=self.exp_steps,
        )

    @property
    def group(self) -> RotaryGroup:
        """The rotary subgroup."""
        return self._parts[1]  # pyright: ignore[reportReturnType]

    def _check_shape(self, shape, name):
        ok, reason = self.total._check_shape(shape, name)
        if not ok:
            return ok, reason
        return self.group.check_shape(shape, name)

    def coordinates(
        self, h: int, device: torch.device | str | None = None
    ) -> tuple[Tensor, int, int]:
        """The group's :meth:`RotaryGroup.coordinates`."""
        return self.group.coordinates(h, device)

    def algebra(self, omega: Tensor, h: int) -> Tensor:
        """The group's :meth:`RotaryGroup.algebra`."""
        return self.group.algebra(omega, h)

    # ------------------------------------------------------------------ projection
    def proju(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        """Horizontal projection (closed form of the class docstring)."""
        p = self.at(x)
        self._check_vector(p, u)
        solve = p.cached("rotary_projection", lambda: _Projection(self, p))
        omega = solve(u)
        # u - (-G Ω, H Ωᵀ) in one fused pass
        return self.total._blockwise(p.x, omega, -mT(omega), add=u)


class _Projection:
    """The per-point factorizations of :meth:`RotaryGLQuotient.proju`: ``ξ ↦ Ω``."""

    def __init__(self, manifold: RotaryGLQuotient, p: AtPoint):
        total = manifold.total
        G, H = total.split(p)
        W_G, W_H = total.weights(p)
        self.total, self.G, self.H, self.W_G, self.W_H = total, G, H, W_G, W_H
        h = p.x.shape[-1]
        order, m, u = manifold.coordinates(h, p.x.device)
        self.order, self.back, self.m, self.u = order, torch.argsort(order), m, u
        std = self.standard
        # the two terms (L, R) of K(Ω) = Σ L Ω R, in standard coordinates
        self.terms = [(std(gram(G)), std(W_G)), (std(W_H), std(gram(H)))]
        # the rotated basis E_α = Σ_k c[α, k] e_{i[α, k]} e_{j[α, k]}ᵀ: a_j then b_j
        jj = torch.arange(m, device=p.x.device)
        self.i = torch.cat([torch.stack([jj, jj + m], -1), torch.stack([jj + m, jj], -1)])
        self.j = torch.cat([torch.stack([jj, jj + m], -1), torch.stack([jj, jj + m], -1)])
        one = torch.ones(m, dtype=p.x.dtype, device=p.x.device)
        self.c = torch.cat([torch.stack([one, one], -1), torch.stack([one, -one], -1)])
        r = slice(0, 2 * m)
        gram_rr = tensor_sum(self._pair_gram(L[..., r, r], R[..., r, r]) for L, R in self.terms)
        if u:
            self._sylvester_factors()
            gram_rr = gram_rr - self._elimination()
        self.chol = cholesky(0.5 * (gram_rr + mT(gram_rr)), "the rotary vertical Gram matrix")

    def standard(self, X: Tensor) -> Tensor:
        """``X`` with rows and columns in the standard coordinate order."""
        return X[..., self.order, :][..., :, self.order]

    def _pair_gram(self, L: Tensor, R: Tensor) -> Tensor:
        """``[<E_α, L E_β R>]_{αβ} = Σ c_αk c_βl L[i_αk, i_βl] R[j_βl, j_αk]``."""
        i, j, c = self.i, self.j, self.c
        Lg = L[..., i[:, :, None, None], i[None, None, :, :]]
        Rg = R[..., j[None, None, :, :], j[:, :, None, None]]
        weight = c[:, :, None, None] * c[None, None, :, :]
        return (weight * Lg * Rg).sum((-3, -1))

    def _coords(self, X: Tensor) -> Tensor:
        """``[<E_α, X>]_α`` for ``X`` ``(..., 2m, 2m)``."""
        return (self.c * X[..., self.i, self.j]).sum(-1)

    def _sylvester_factors(self) -> None:
        """``F_a``, ``F_b`` and ``d_i + e_j`` of ``S⁻¹`` (class docstring)."""
        f = slice(2 * self.m, None)
        (P0, W_G), (W_H, Q0) = self.terms
        La = cholesky(W_H[..., f, f], "a metric weight")
        Lb = cholesky(W_G[..., f, f], "a metric weight")
        tri = torch.linalg.solve_triangular

        def factor(Lw, A):
            inner = tri(Lw, mT(tri(Lw, A[..., f, f], upper=False)), upper=False)
            d, U = torch.linalg.eigh(0.5 * (inner + mT(inner)))
            return d, tri(mT(Lw), U, upper=True)

        d, self.Fa = factor(La, P0)
        e, self.Fb = factor(Lb, Q0)
        self.denominator = d[..., :, None] + e[..., None, :]

    def _sylvester(self, C: Tensor) -> Tensor:
        """``S⁻¹(C)`` for ``C`` ``(..., u, u)`` (extra leading dims allowed before the batch)."""
        Fa, Fb = self.Fa, self.Fb
        return Fa @ ((mT(Fa) @ C @ Fb) / self.denominator) @ mT(Fb)

    def _coupling(self, omega_r: Tensor) -> Tensor:
        """``Σ_t L_tᵤᵣ Ω_r R_tᵣᵤ``."""
        r, f = slice(0, 2 * self.m), slice(2 * self.m, None)
        return tensor_sum(L[..., f, r] @ omega_r @ R[..., r, f] for L, R in self.terms)

    def _back_coupling(self, X: Tensor) -> Tensor:
        """``Σ_t L_tᵣᵤ X R_tᵤᵣ``."""
        r, f = slice(0, 2 * self.m), slice(2 * self.m, None)
        return tensor_sum(L[..., r, f] @ X @ R[..., f, r] for L, R in self.terms)

    def _elimination(self) -> Tensor:
        """``[<E_α, Σ_t L_tᵣᵤ S⁻¹(T_β) R_tᵤᵣ>]_{αβ}`` with ``T_β = Σ_t L_tᵤᵣ E_β R_tᵣᵤ``."""
        m = self.m
        basis = self._embed(torch.eye(2 * m, dtype=self.G.dtype, device=self.G.device))
        # basis (2m, 2m, 2m); move the basis index behind the batch dims of the point
        batch = self.Fa.dim() - 2
        basis = basis.reshape(2 * m, *[1] * batch, 2 * m, 2 * m)
        corrections = self._back_coupling(self._sylvester(self._coupling(basis)))
        return self._coords(corrections).movedim(0, -1)

    def _embed(self, omega_r: Tensor) -> Tensor:
        """``(a, b)`` ``(..., 2m)`` -> ``[[a, -b], [b, a]]`` ``(..., 2m, 2m)``."""
        m = self.m
        a, b = torch.diag_embed(omega_r[..., :m]), torch.diag_embed(omega_r[..., m:])
        return torch.cat([torch.cat([a, -b], -1), torch.cat([b, a], -1)], -2)

    def __call__(self, xi: Tensor) -> Tensor:
        """The ``Ω ∈ 𝔰`` of ``ξ`` (in the original coordinate order)."""
        xG, xH = self.total.split(xi)
        b = self.W_H @ (mT(xH) @ self.H) - (mT(self.G) @ xG) @ self.W_G
        b = self.standard(b)
        m, u = self.m, self.u
        r, f = slice(0, 2 * m), slice(2 * m, None)
        rhs = self._coords(b[..., r, r])
        if u:
            rhs = rhs - self._coords(self._back_coupling(self._sylvester(b[..., f, f])))
        omega_r = self._embed(torch.cholesky_solve(rhs.unsqueeze(-1), self.chol).squeeze(-1))
        if not u:
            standard = omega_r
        else:
            omega_u = self._sylvester(b[..., f, f] - self._coupling(omega_r))
            lead = omega_u.shape[:-2]
            omega_r = omega_r.expand(*lead, 2 * m, 2 * m)
            top = torch.cat([omega_r, omega_r.new_zeros(*lead, 2 * m, u)], -1)
            bottom = torch.cat([omega_u.new_zeros(*lead, u, 2 * m), omega_u], -1)
            standard = torch.cat([top, bottom], -2)
        return standard[..., self.back, :][..., :, self.back]
