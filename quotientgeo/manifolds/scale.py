r"""Positive scaling of a weight block: the symmetry of weights that feed a normalization layer.

``ScaleQuotient(ndim)`` is ``total / group``: :class:`ScaleTotalSpace` (non-zero blocks with the
metric ``Σ η ζ / ||w||²``) by :class:`ScaleGroup` (``w ↦ a w``, ``a > 0``).
"""

from __future__ import annotations

import math

import torch

from ..validation import positive_int
from .base import AtPoint
from .groups import DEFAULT_CONDITION, random_exp
from .quotient import Quotient, TotalSpace

Tensor = torch.Tensor

__all__ = ["ScaleGroup", "ScaleQuotient", "ScaleTotalSpace"]


def _expand(a: Tensor, ndim: int) -> Tensor:
    """A per-block scalar of shape ``(...)`` viewed as ``(..., 1, ..., 1)``."""
    return a.reshape(*a.shape, *[1] * ndim)


def _dot(a: Tensor, b: Tensor, ndim: int) -> Tensor:
    """``Σ a b`` per block, keeping the block dimensions (size 1)."""
    return (a * b).sum(dim=tuple(range(-ndim, 0)), keepdim=True)


class ScaleTotalSpace(TotalSpace):
    r"""Blocks ``w`` (trailing ``ndim`` dimensions) with the metric ``Σ η ζ / r²``, ``r = ||w||``.

    In log-polar coordinates ``w = e^ρ θ`` the metric is ``dρ² + |dθ|²``; the closed forms
    (``M⁻¹``, the isotropic map, Christoffel symbols, the exact geodesic) are those of
    :class:`ScaleQuotient`. The total space of :class:`ScaleQuotient`.
    """

    closed_form_geodesic = True

    name = "ScaleTotalSpace"
    ndim = 1

    def __init__(self, ndim: int = 1, *, exp_steps: int | None = None):
        ndim = positive_int("ndim", ndim, "dimensions of a block")
        super().__init__(exp_steps=exp_steps)
        self.ndim: int = ndim

    def extra_repr(self) -> str:
        return f"ndim={self.ndim}"

    def _check_shape(self, shape, name):
        if len(shape) < self.ndim:
            return False, (
                f"{name} must have at least ndim={self.ndim} dimensions (the block), "
                f"got {tuple(shape)}"
            )
        if math.prod(shape[len(shape) - self.ndim :]) == 0:
            return False, f"{name} has an empty block: {tuple(shape)}"
        return True, None

    def _sqnorm(self, x: Tensor) -> Tensor:
        """``r² = ||w||²`` per block, keeping the block dimensions (size 1)."""
        return self._reduce(x.square(), keepdim=True)

    def metric(self, p: AtPoint, u: Tensor) -> Tensor:
        """``u / r²``."""
        return u / self._sqnorm(p.x)

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        """``r² v``."""
        return v * self._sqnorm(p.x)

    def isotropic(self, p: AtPoint, e: Tensor) -> Tensor:
        """``r e``: ``Σ (r e)² / r² = |e|²``."""
        return e * self._sqnorm(p.x).sqrt()

    def inner(
        self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False
    ) -> Tensor:
        """``Σ u v / r²``."""
        p, v = self._pair_at(x, u, v)
        return self._reduce(u * v, keepdim) / self._reduce(p.x.square(), keepdim)

    def christoffel(self, x: Tensor | AtPoint, u: Tensor, v: Tensor | None = None) -> Tensor:
        """``Γ(u, v) = [(u·v) w - (w·u) v - (w·v) u] / r²``."""
        p = self.at(x)
        self._check_vector(p, u)
        w, d = p.x, self.ndim
        wu = _dot(w, u, d)
        if v is None:
            return (_dot(u, u, d) * w - 2 * wu * u) / self._sqnorm(w)
        return (_dot(u, v, d) * w - wu * v - _dot(w, v, d) * u) / self._sqnorm(w)

    def expmap(self, x: Tensor | AtPoint, u: Tensor, *, steps: int | None = None) -> Tensor:
        """``e^α (cos ν · w + sinc ν · u_⊥)`` (:class:`ScaleQuotient`; exact, ``steps`` unused)."""
        p = self.at(x)
        self._check_vector(p, u)
        w, d = p.x, self.ndim
        r2 = self._sqnorm(w)
        alpha = _dot(w, u, d) / r2
        u_perp = u - alpha * w
        # cos ν and sinc ν are smooth in ν²; the clamp keeps the gradient finite at ν = 0
        nu = (_dot(u_perp, u_perp, d) / r2).clamp_min(torch.finfo(w.dtype).tiny).sqrt()
        return torch.exp(alpha) * (torch.cos(nu) * w + torch.sinc(nu / math.pi) * u_perp)

    def _check_free(self, x: Tensor) -> None:
        if not bool((self._sqnorm(x) > 0).all()):
            raise ValueError(
                "the point has a zero block: the scaling action is not free there and the "
                "metric Σ η ζ / ||w||² is undefined"
            )

    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        """Entries finite and every block non-zero (the action is free only there)."""
        x = x.x if isinstance(x, AtPoint) else x
        if not bool(torch.isfinite(x).all()):
            return False, "the point has non-finite entries"
        if x.numel() == 0:
            return True, None
        smallest = self._sqnorm(x).sqrt().min().item()
        if smallest == 0:
            return False, "a block is zero; the scaling action is not free there"
        return True, f"smallest block norm = {smallest:.3e}"


class ScaleGroup:
    """Positive scalings ``w ↦ a w`` (``a > 0`` of shape ``(...)``) of blocks of ``ndim``
    trailing dimensions: Lie algebra ``R`` (``ω`` a scalar per block), vertical ``ω w``, the
    differential of the action ``ξ ↦ a ξ``."""

    def __init__(self, ndim: int = 1):
        self.ndim = positive_int("ndim", ndim, "dimensions of a block")

    def __repr__(self) -> str:
        return f"ScaleGroup(ndim={self.ndim})"

    def lie_shape(self, p: AtPoint) -> tuple[()]:
        return ()

    def vertical(self, p: AtPoint, omega: Tensor) -> Tensor:
        """``ω w``."""
        return _expand(omega, self.ndim) * p.x

    def precondition(self, p: AtPoint, r: Tensor) -> Tensor:
        return r

    def act(self, x: Tensor, a: Tensor) -> Tensor:
        """``w ↦ a w`` for ``a > 0`` of shape ``(...)``."""
        return _expand(a, self.ndim) * x

    def push(self, x: Tensor, u: Tensor, a: Tensor) -> Tensor:
        """Differential of the action: ``ξ ↦ a ξ``."""
        return _expand(a, self.ndim) * u

    def random_group(
        self,
        x: Tensor | AtPoint,
        *,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        condition: float = DEFAULT_CONDITION,
    ) -> Tensor:
        """``a = scale · exp(ω)``, ``ω`` uniform in ``[-½ log c, ½ log c]`` per block
        (``quotientgeo.manifolds.groups.random_exp``)."""
        x = x.x if isinstance(x, AtPoint) else x
        kw = {"generator": generator, "dtype": x.dtype, "device": x.device}
        batch = x.shape[: x.dim() - self.ndim]
        return random_exp((), batch, scale=scale, condition=condition, **kw)

    def group_name(self, shape: tuple[int, ...]) -> str:
        return "positive scale R>0"


class ScaleQuotient(Quotient):
    r"""Quotient of non-zero weight blocks by positive scaling ``w ~ a·w``, ``a > 0``.

    A layer followed by a normalization (BatchNorm, LayerNorm, weight normalization) computes
    the same function for ``w`` and ``a·w``. A point is a tensor of shape ``(..., *block)``
    whose trailing ``ndim`` dimensions form one block (``ndim=1``: each row of a weight matrix
    scales on its own, as in front of BatchNorm; ``ndim=2``: the whole matrix, as in front of
    LayerNorm); leading dimensions are batch dimensions. With ``r² = ||w||²`` over the block:

    - action ``w ↦ a w`` (``a`` of shape ``(...)``), push ``ξ ↦ a ξ``; vertical ``ω w``
      (``ω`` a scalar per block, Lie algebra of dimension ``k = 1``);
    - metric :math:`\langle η, ζ \rangle_w = \sum η ζ / r^2`: invariant because the action
      scales ``η``, ``ζ`` and ``r`` by the same ``a``. In log-polar coordinates ``w = e^ρ θ``
      (``|θ| = 1``) it is the product metric ``dρ² + |dθ|²`` of a cylinder ``R × S^{d-1}``, and
      the quotient is the unit sphere with its round metric;
    - horizontal space :math:`\langle w, ξ \rangle = 0`; projection
      :math:`\operatorname{proj}(ξ) = ξ - (\langle w, ξ \rangle / r^2)\, w`;
    - Riemannian gradient :math:`\operatorname{proj}(r^2 ∇)`; isotropic map ``e ↦ r e``;
    - Christoffel contraction
      :math:`Γ(u, v) = [(u \cdot v)\, w - (w \cdot u)\, v - (w \cdot v)\, u] / r^2` (the
      conformally flat metric :math:`e^{2φ} I` with :math:`φ = -\log r`);
    - exact geodesic (product of a line and a great circle): with
      :math:`α = \langle w, u \rangle / r^2`, :math:`u_⊥ = u - α w` and :math:`ν = |u_⊥| / r`,
      :math:`\operatorname{Exp}_w(u) = e^α (\cos ν \cdot w + \operatorname{sinc} ν \cdot u_⊥)`;
      for horizontal ``u`` the norm ``r`` is preserved.

    The quotient is ``total / group``: the metric, its Christoffel symbols and geodesics are
    :class:`ScaleTotalSpace`'s, the action and the vertical space :class:`ScaleGroup`'s; the
    projection and the Riemannian gradient are closed forms here. :meth:`generic` still
    reaches the generic (autodiff) path of :class:`QuotientManifold` for testing.

    Args:
        ndim: number of trailing dimensions that form one scaled block.
        exp_steps: RK4 steps of :meth:`geodesic` (:meth:`expmap` is exact).
    """

    name = "ScaleQuotient"
    ndim = 1
    _parts: tuple[ScaleTotalSpace, ScaleGroup]  # pyright: ignore[reportIncompatibleVariableOverride]

    def __init__(self, ndim: int = 1, *, exp_steps: int | None = None):
        total = ScaleTotalSpace(ndim, exp_steps=exp_steps)
        super().__init__(total, ScaleGroup(total.ndim), exp_steps=exp_steps)

    def extra_repr(self) -> str:
        return f"ndim={self.ndim}"

    def _expand(self, a: Tensor) -> Tensor:
        """A per-block scalar of shape ``(...)`` viewed as ``(..., 1, ..., 1)``."""
        return _expand(a, self.ndim)

    def proju(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        """``u - (<w, u> / r²) w``."""
        p = self.at(x)
        self._check_vector(p, u)
        w = p.x
        return u - (_dot(w, u, self.ndim) / _dot(w, w, self.ndim)) * w

    def egrad2rgrad(self, x: Tensor | AtPoint, u: Tensor) -> Tensor:
        """``proj(r² ∇) = r² ∇ - <w, ∇> w``."""
        p = self.at(x)
        self._check_vector(p, u, "the gradient")
        w = p.x
        return _dot(w, w, self.ndim) * u - _dot(w, u, self.ndim) * w
