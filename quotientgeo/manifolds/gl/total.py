r"""The total space of the GL(h) quotients: full-rank pairs ``x = [G; H]`` with an invariant
metric, the metric's class chosen at construction (``inv.py``, ``mix.py``, ``interpolated.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from ...linalg import cholesky, cholesky_inverse, gram, identity, mT
from ...validation import positive_int, real_in
from ..base import AtPoint, metric_variant
from ..ode import rk4
from ..quotient import TotalSpace
from .blocks import Coefficients, Products, blockwise, factor_products
from .damping import BallDamping, FrameDamping, relaxation

Tensor = torch.Tensor
T = TypeVar("T")
Pair = tuple[Tensor, Tensor]

__all__ = ["GLTotalSpace"]


class GLTotalSpace(TotalSpace):
    r"""The total space of the GL(h) quotients: full-rank pairs with an invariant metric.

    A point is one tensor ``x = [G; H]`` of shape ``(..., n+m, h)``, ``G`` its first ``n`` rows;
    leading dimensions are batch dimensions (heads, layers). Every metric here is a right
    multiplication ``M(x) u = (u_G W_G, u_H W_H)`` by ``h × h`` SPD weights that transform as
    ``W_G ↦ A W_G Aᵀ``, ``W_H ↦ A⁻ᵀ W_H A⁻¹`` under ``(G, H) ↦ (G A⁻¹, H Aᵀ)``, hence invariant
    under ``GL(h)`` and each of its subgroups. With ``P = GᵀG + eps·I`` and ``Q = HᵀH + eps·I``:
    ``"inv"`` ``(P⁻¹, Q⁻¹)`` (:class:`~.inv.InvTotalSpace`), ``"mix"`` ``(Q, P)``
    (:class:`~.mix.MixTotalSpace`), ``s ∈ [0, 1]`` ``(1-s)·inv + s·mix``
    (:class:`~.interpolated.InterpolatedTotalSpace`); ``GLTotalSpace(n, metric)`` returns an
    instance of the metric's class.

    This class holds everything that does not depend on the group: the layout (``split``,
    ``join``, shape and rank checks), the cached ``P``, ``Q``, their Cholesky factors and
    inverses, the metric and its inverse, the isotropic map, ``inner``, the Christoffel symbols
    (closed form from each metric's :meth:`gamma_coefficients`), the second-order and exact
    exponential maps and the geodesic (closed form for ``"inv"`` with ``eps = 0``, integrated in
    the span of ``[F, u_F]`` otherwise). As a manifold on its own it is the quotient by the
    trivial group (empty Lie algebra: every vector is horizontal). The quotients
    (:class:`GLQuotient`, :class:`~.rotary.RotaryGLQuotient`) add the group.

    Args:
        n: number of rows of ``G`` (``m`` follows from the point's shape).
        metric: ``"mix"`` (default), ``"inv"`` or the interpolation weight ``s``.
        eps: Gram relaxation ``≥ 0``, a :class:`~.damping.FrameDamping` (the class is then
            :class:`~.framed.FramedTotalSpace`), or a :class:`~.damping.BallDamping` (one ``ε``
            per pair, scaled to a ball's radius).
        exp_steps: RK4 steps of :meth:`geodesic` where it integrates; ``None`` (default)
            chooses them from the velocity for a stated accuracy.
        dense_max: largest Lie-algebra dimension for which the generic projection forms the
            normal equations densely.
    """

    name = "GLTotalSpace"
    ndim = 2

    def __new__(
        cls: type[T], n: int = 1, metric: str | float | None = None, *a: Any, **k: Any
    ) -> T:
        from . import framed, interpolated, inv, mix  # the metrics' classes, which subclass this

        if cls is GLTotalSpace and isinstance(k.get("eps", a[0] if a else None), FrameDamping):
            return super().__new__(framed.FramedTotalSpace)  # type: ignore[misc]
        variants = {
            "inv": inv.InvTotalSpace,
            "mix": mix.MixTotalSpace,
            float: interpolated.InterpolatedTotalSpace,
        }
        return super().__new__(metric_variant(cls, GLTotalSpace, metric, variants))  # type: ignore[misc]

    def __init__(
        self,
        n: int,
        metric: str | float | None = None,
        eps: float | BallDamping | FrameDamping = 0.0,
        *,
        exp_steps: int | None = None,
        dense_max: int = 64,
    ):
        n = positive_int("n", n, "rows of G")
        if not isinstance(eps, BallDamping):
            eps = real_in("eps", eps, 0.0)
        super().__init__(exp_steps=exp_steps, dense_max=dense_max)
        self.n = n
        self.eps: float | BallDamping | FrameDamping = eps

    @property
    def relaxed(self) -> bool:
        """Whether the Grams are relaxed (``eps > 0`` or a :class:`~.damping.BallDamping`)."""
        return isinstance(self.eps, (BallDamping, FrameDamping)) or self.eps > 0

    def extra_repr(self) -> str:
        return f"n={self.n}, eps={self.eps}"

    # ------------------------------------------------------------------ layout
    def split(self, x: Tensor | AtPoint) -> tuple[Tensor, Tensor]:
        """``x = [G; H] ↦ (G, H)`` (``x`` a tensor or an :class:`AtPoint`): views, whose
        backward pass is one concatenation (slicing's writes two zero-filled copies and adds
        them)."""
        x = x.x if isinstance(x, AtPoint) else x
        # the operator itself: Tensor.split is a Python wrapper that costs as much again
        G, H = x.split_with_sizes((self.n, x.shape[-2] - self.n), dim=-2)
        return G, H

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
    def relaxation(self, p: AtPoint) -> float | Tensor:
        """The Gram relaxation at ``p``: ``eps``, or a :class:`~.damping.BallDamping`'s ``ε``
        of each pair (shape ``(..., 1, 1)``), cached on ``p``."""
        eps = self.eps
        if isinstance(eps, FrameDamping):  # FramedTotalSpace damps in H's frame instead
            raise TypeError("a FrameDamping is no Gram relaxation ε·I")
        return p.cached("relaxation", lambda: relaxation(eps, *self.split(p)))

    def grams(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        """``(P, Q) = (GᵀG + eps·I, HᵀH + eps·I)``, cached on ``p``."""

        def compute():
            G, H = self.split(p)
            eps = self.relaxation(p)
            return gram(G, eps), gram(H, eps)

        return p.cached("grams", compute)

    def cholesky_factors(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        """Lower Cholesky factors ``(L_P, L_Q)`` of ``P`` and ``Q``, cached on ``p``."""
        P, Q = self.grams(p)
        return p.cached("cholesky", lambda: (cholesky(P, "GᵀG"), cholesky(Q, "HᵀH")))

    def inverses(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        """``(P⁻¹, Q⁻¹)``, cached on ``p``."""
        LP, LQ = self.cholesky_factors(p)
        return p.cached("inverses", lambda: (cholesky_inverse(LP), cholesky_inverse(LQ)))

    # ------------------------------------------------------------------ primitives
    def weights(self, p: AtPoint) -> tuple[Tensor, Tensor]:
        """The metric weights ``(W_G, W_H)`` at ``p`` (see the class docstring).

        Each metric's class defines it; not abstract, so that a type checker accepts
        ``GLQuotient(n, metric)``, which constructs that class.
        """
        raise NotImplementedError(f"{type(self).__name__} defines no metric weights")

    def metric(self, p: AtPoint, u: Tensor) -> Tensor:
        """``(u_G W_G, u_H W_H)``."""
        return self._blockwise(u, *self.weights(p))

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        """``(v_G W_G⁻¹, v_H W_H⁻¹)`` (Cholesky inverses of the weights, cached)."""

        def compute():
            return tuple(cholesky_inverse(cholesky(W, "a metric weight")) for W in self.weights(p))

        return self._blockwise(v, *p.cached("weights_inv", compute))

    def isotropic(self, p: AtPoint, e: Tensor) -> Tensor:
        """``(e_G L_G⁻¹, e_H L_H⁻¹)`` with ``W = L Lᵀ``: ``tr(ξ W ξᵀ) = |e|²``."""

        def compute():
            return tuple(cholesky(W, "a metric weight") for W in self.weights(p))

        LG, LH = p.cached("weights_cholesky", compute)
        eG, eH = self.split(e)
        solve = torch.linalg.solve_triangular
        return self.join(
            solve(LG, eG, upper=False, left=False), solve(LH, eH, upper=False, left=False)
        )

    # ------------------------------------------------------------------ closed forms
    def inner(
        self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False
    ) -> Tensor:
        """``tr(W_G u_Gᵀ v_G) + tr(W_H u_Hᵀ v_H)``.

        Evaluated as ``Σ W ⊙ uᵀv`` per factor: one pass over ``u`` and ``v`` and nothing of their
        size allocated.
        """
        p, v = self._pair_at(x, u, v)
        W_G, W_H = self.weights(p)
        (uG, uH), (vG, vH) = self.split(u), self.split(v)
        value = (W_G * (mT(uG) @ vG)).sum((-2, -1)) + (W_H * (mT(uH) @ vH)).sum((-2, -1))
        return value[..., None, None] if keepdim else value

    def gamma_coefficients(self, k: Products, same: bool) -> Coefficients:
        """The ``h × h`` coefficients of ``Γ(u, v)`` from the products ``k`` (a ``Products``).

        Returns ``((C_G, C_uG, C_vG), (C_H, C_uH, C_vH))`` with
        ``Γ_F(u, v) = F C_F + u_F C_uF + v_F C_vF`` per factor ``F``; ``C_v`` is ``None`` when
        ``same`` (``v is u``: the two last terms are one). Each metric's class defines it (not
        abstract, like :meth:`weights`).
        """
        raise NotImplementedError(f"{type(self).__name__} defines no Christoffel coefficients")

    def christoffel(self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None) -> Tensor:
        """Symmetric bilinear ``Γ(u, v)``: per factor ``F C_F + u_F C_uF + v_F C_vF``, the
        coefficients from :meth:`gamma_coefficients`, accumulated into one output."""
        p = self.at(x)
        v = u if v is None else v
        same = v is u
        cG, cH = self._christoffel_coefficients(p, u, v)
        out = self._blockwise(u, cG[1], cH[1])
        if not same:
            cvG, cvH = cG[2], cH[2]
            assert cvG is not None and cvH is not None  # the bilinear form has them
            self._blockwise(v, cvG, cvH, add=out, into=True)
        return self._blockwise(p.x, cG[0], cH[0], add=out, into=True)

    def expmap2(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        """``x + u - ½ Γ(u, u)``: per factor ``F (I - ½ C_F) + u_F (I - ½ C_uF)`` with the
        coefficients of :meth:`christoffel`, two products accumulated into one output (adding
        ``x``, ``u`` and ``Γ`` would take two more passes over the blocks); equal to the sum
        up to rounding."""
        p = self.at(x)
        (CG, CuG, _), (CH, CuH, _) = self._christoffel_coefficients(p, u, u)
        eye = identity(CG.shape[-1], CG)
        out = self._blockwise(u, torch.add(eye, CuG, alpha=-0.5), torch.add(eye, CuH, alpha=-0.5))
        A_G, A_H = torch.add(eye, CG, alpha=-0.5), torch.add(eye, CH, alpha=-0.5)
        return self._blockwise(p.x, A_G, A_H, add=out, into=True)

    def expmap2_vjp(self, x: Tensor | AtPoint, u: Tensor, d: Tensor) -> Tensor:
        """``J(u)ᵀ d`` of :meth:`expmap2`: per factor ``F (I - ½ C_F) + u_F (I - ½ C_uF)``, its
        coefficients functions of ``u_Fᵀ F`` and ``u_Fᵀ u_F`` (:meth:`_affine_vjp`); a
        subclass's own ``expmap2`` by autodiff."""
        if type(self).expmap2 is not GLTotalSpace.expmap2:
            return super().expmap2_vjp(x, u, d)
        p = self.at(x)

        def coefficients(S, T):
            k = Products(*self.grams(p), *self.inverses(p), S, S, T)
            (CG, CuG, _), (CH, CuH, _) = self.gamma_coefficients(k, True)
            eye = identity(CG.shape[-1], CG)
            A = tuple(torch.add(eye, C, alpha=-0.5) for C in (CG, CH))
            B = tuple(torch.add(eye, C, alpha=-0.5) for C in (CuG, CuH))
            return A, B

        return self._affine_vjp(p, u, d, coefficients)

    def _affine_vjp(
        self,
        p: AtPoint,
        u: Tensor,
        d: Tensor,
        coefficients: Callable[[Pair, Pair], tuple[Sequence[Tensor], Sequence[Tensor]]],
    ) -> Tensor:
        """``J(u)ᵀ d`` of a map ``u ↦ (F A_F + u_F B_F)_F`` whose ``h × h`` coefficients
        ``((A_G, A_H), (B_G, B_H)) = coefficients(S, T)`` depend on ``u`` only through
        ``S_F = u_Fᵀ F`` and ``T_F = u_Fᵀ u_F`` (and on the point): the second-order map and the
        inv metric's closed-form geodesic. With ``Ā_F = Fᵀ d_F``, ``B̄_F = u_Fᵀ d_F`` and
        ``(S̄, T̄)`` their vector-Jacobian product through ``coefficients`` (reverse-mode
        autodiff on ``h × h`` matrices),

        ``J(u)ᵀ d = (d_F B_Fᵀ + F S̄_Fᵀ + u_F (T̄_F + T̄_Fᵀ))_F``:

        seven passes over blocks of the point's size (the products ``S``, ``T``, ``Ā``, ``B̄``,
        each one batched product for both factors where ``G`` and ``H`` have as many rows, and
        three products accumulated into the output), where autodiff through the map
        recomputes it and differentiates each of its full-size products. Equal to that up to
        rounding; not differentiable itself.
        """
        self._check_vector(p, u)
        self._check_vector(p, d, "d")
        n = self.n
        with torch.enable_grad():
            S, T = _leaves(factor_products(n, u, p.x)), _leaves(factor_products(n, u, u))
            A, B = coefficients(S, T)
            bars = (*factor_products(n, p.x, d), *factor_products(n, u, d))
            SG, SH, TG, TH = torch.autograd.grad(
                (*A, *B), (*S, *T), bars, allow_unused=True, materialize_grads=True
            )
        out = self._blockwise(d, *(mT(b.detach()) for b in B))
        self._blockwise(p.x, mT(SG), mT(SH), add=out, into=True)
        return self._blockwise(u, TG + mT(TG), TH + mT(TH), add=out, into=True)

    def _christoffel_coefficients(self, p: AtPoint, u: Tensor, v: Tensor) -> Coefficients:
        """:meth:`gamma_coefficients` of ``u`` and ``v`` at ``p`` (``v is u``: the symmetric
        ones, ``C_v = None``), from the products of the point and the vectors."""
        self._check_vector(p, u)
        same = v is u
        if not same:
            self._check_vector(p, v, "v")
        G, H = self.split(p)
        (uG, uH), (vG, vH) = self.split(u), self.split(v)
        uF = (mT(uG) @ G, mT(uH) @ H)
        vF = uF if same else (mT(vG) @ G, mT(vH) @ H)
        uv = (mT(uG) @ vG, mT(uH) @ vH)
        k = Products(*self.grams(p), *self.inverses(p), uF, vF, uv)
        return self.gamma_coefficients(k, same)

    def gram_products(
        self,
        p: AtPoint,
        P0: Tensor,
        Q0: Tensor,
        uF: tuple[Tensor, Tensor],
        uv: tuple[Tensor, Tensor],
    ) -> Products:
        """The ``Products`` of ``Γ(u, u)`` from the Grams ``P₀ = GᵀG``, ``Q₀ = HᵀH`` of a
        point on the geodesic from ``p`` (relaxed as at ``p``) and ``uF``, ``uv``."""
        if self.relaxed:
            eye = torch.eye(P0.shape[-1], dtype=P0.dtype, device=P0.device)
            P0, Q0 = P0 + self.relaxation(p) * eye, Q0 + self.relaxation(p) * eye
        LP, LQ = cholesky(P0, "GᵀG"), cholesky(Q0, "HᵀH")
        return Products(P0, Q0, cholesky_inverse(LP), cholesky_inverse(LQ), uF, uF, uv)

    # ------------------------------------------------------------------ geodesics
    def geodesic(
        self, x: Tensor | AtPoint, u: Tensor, t: float | Tensor = 1.0, *, steps: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(γ(t), γ'(t))`` of the geodesic from ``(x, u)``, integrated in ``span [F, u_F]``.

        Every metric here has ``Γ_F(u, u) = F C_F + u_F C_uF`` with ``h × h`` coefficients that
        depend on the factors only through ``FᵀF``, ``u_Fᵀ F`` and ``u_Fᵀ u_F``. The geodesic
        therefore stays in the column span of ``B_F = [F(0), F'(0)]`` (``n × 2h``): with
        ``F(t) = B_F C_F(t)``, ``F'(t) = B_F D_F(t)`` and ``K_F = B_Fᵀ B_F``, the products are
        ``Cᵀ K C``, ``Dᵀ K C``, ``Dᵀ K D`` and ``C'' = -(C C_F + D C_uF)``, an ODE on
        ``2h × h`` matrices from ``C(0) = [I; 0]``, ``D(0) = [0; I]``. RK4 integrates it; its
        cost per step is ``O(h³)`` per head, independent of ``n`` and ``m``, and the end point
        costs one ``n × 2h`` by ``2h × h`` product per factor. The step count is ``steps``, else
        this manifold's ``exp_steps``, else chosen from the velocity (:meth:`rk4_steps`).
        ``t`` is a number or a tensor broadcastable to the batch dimensions.
        """
        p = self.at(x)
        self._check_vector(p, u)
        t = self._times(t, p, u)
        (G, H), (uG, uH) = self.split(p), self.split(u)
        batch = torch.broadcast_shapes(p.x.shape[:-2], u.shape[:-2], t.shape[:-2])
        BG, BH = (torch.cat(torch.broadcast_tensors(F, uF), -1) for F, uF in ((G, uG), (H, uH)))
        KG, KH = mT(BG) @ BG, mT(BH) @ BH
        h = p.x.shape[-1]
        eye = torch.eye(h, dtype=p.x.dtype, device=p.x.device).expand(*batch, h, h)
        zero = torch.zeros_like(eye)
        C0, D0 = torch.cat([eye, zero], dim=-2), torch.cat([zero, eye], dim=-2)

        def acceleration(CG, CH, DG, DH):
            KCG, KCH, KDG, KDH = KG @ CG, KH @ CH, KG @ DG, KH @ DH
            uF, uv = (mT(DG) @ KCG, mT(DH) @ KCH), (mT(DG) @ KDG, mT(DH) @ KDH)
            k = self.gram_products(p, mT(CG) @ KCG, mT(CH) @ KCH, uF, uv)
            (aG, bG, _), (aH, bH, _) = self.gamma_coefficients(k, True)
            return -(CG @ aG + DG @ bG), -(CH @ aH + DH @ bH)

        def run(n: int) -> tuple[Tensor, Tensor]:
            CG, CH, DG, DH = rk4(acceleration, (C0, C0), (D0, D0), t, n)
            return self.join(BG @ CG, BH @ CH), self.join(BG @ DG, BH @ DH)

        return self._integrated(run, p, u, t, steps)

    def expmap(self, x: Tensor | AtPoint, u: Tensor, *, steps: int | None = None) -> Tensor:
        """The exact exponential map ``γ(1)`` (:meth:`geodesic`)."""
        return self.geodesic(x, u, steps=steps)[0]

    def _blockwise(
        self, u: Tensor, W_G: Tensor, W_H: Tensor, add: Tensor | None = None, *, into: bool = False
    ) -> Tensor:
        """:func:`blockwise` with this space's ``n``: ``(u_G W_G, u_H W_H)`` (+ ``add``)."""
        return blockwise(self.n, u, W_G, W_H, add, into=into)

    # ------------------------------------------------------------------ points
    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        """Full column rank of ``G`` and ``H`` to working precision (not needed with ``eps > 0``).

        Every formula factorizes ``GᵀG`` and ``HᵀH``, whose condition numbers are ``cond(G)²``
        and ``cond(H)²``, so a factor counts as rank deficient once ``cond² ≥ 1 / eps`` of the
        dtype. Reports the worst condition numbers.
        """
        x = x.x if isinstance(x, AtPoint) else x
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
            if deficient and not self.relaxed:
                return False, (
                    f"{name} is rank deficient to {x.dtype} precision (worst condition number "
                    f"{cond:.3e}); compute in float64 or use eps > 0 to relax the geometry"
                )
        return True, "worst condition numbers: " + ", ".join(f"{n} {c:.3e}" for n, c, _ in worst)

    def random(
        self,
        *size: int | tuple[int, ...],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """Gaussian factors (full rank with probability one), entries ``N(0, 1/h)``."""
        size = self._checked_size(size)
        return torch.randn(*size, dtype=dtype, device=device) / size[-1] ** 0.5

    def origin(
        self,
        *size: int | tuple[int, ...],
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        seed: int = 42,
    ) -> Tensor:
        """``[I_{n×h}; I_{m×h}]`` broadcast to ``size``."""
        size = self._checked_size(size)
        rows, h = size[-2], size[-1]
        eye = lambda r: torch.eye(r, h, dtype=dtype, device=device)  # noqa: E731
        return torch.cat([eye(self.n), eye(rows - self.n)], dim=-2).expand(*size).clone()


def _leaves(pair: Pair) -> Pair:
    """``pair`` detached, as leaves that require their gradient."""
    G, H = (t.detach().requires_grad_(True) for t in pair)
    return G, H
