r"""Element-wise GL(1) re-scaling quotient of diagonal networks ``y = xᵀ(u ⊙ v)``."""

from __future__ import annotations

import torch

from .base import QuotientManifold, as_tensor

Tensor = torch.Tensor

__all__ = ["RescaleQuotient"]


class RescaleQuotient(QuotientManifold):
    r"""Quotient of pairs ``(u, v)`` by element-wise re-scaling ``(α u, v / α)``, ``α ≠ 0``.

    A point is ``x = [u; v]`` of shape ``(..., 2, d)`` with non-zero entries; the network
    only uses ``β = u ⊙ v``. Vertical vectors ``(-u ω, v ω)``; both metrics share the horizontal
    space ``η_u / u = η_v / v``, so the projection is the same for both:
    ``proj(ξ) = (u b, v b)`` with ``b = ½ (ξ_u / u + ξ_v / v)``.

    - inv: ``<η, ζ> = Σ η_u ζ_u / u² + η_v ζ_v / v²``; ``Γ(ξ, η) = -ξ ⊙ η / x`` (each entry is a
      one-dimensional metric ``dw² / w²``); exact geodesic ``x ⊙ exp(t ξ / x)``.
    - mix: ``<η, ζ> = Σ η_u ζ_u v² + η_v ζ_v u²``;
      ``Γ_u(ξ, η) = (ξ_u η_v + η_u ξ_v) / v - ξ_v η_v u / v²`` (``Γ_v``: swap u and v).
      In the coordinates ``p = u v``, ``r = log|u / v|`` the metric is ``½ (dp² + p² dr²)``,
      polar coordinates of a flat plane, so geodesics are straight lines there: with
      ``a = ξ / x`` and ``c = 1 + t (a_u + a_v) + i t (a_u - a_v)``,
      ``γ(t) = (u √|c| e^{arg(c)/2}, v √|c| e^{-arg(c)/2})``, which for horizontal ``ξ`` is
      ``x √(1 + 2 b t)`` (defined while the line avoids ``p = 0``, i.e. ``1 + 2bt > 0``).
      Lines through ``p = 0`` (``a_u = a_v``, ``1 + 2 a_u ≤ 0``) have no unique continuation:
      :meth:`expmap` returns there the limit of the lines that pass it with ``a_u > a_v``
      (``arg c = π``), and ``0`` if ``c = 0``.
    """

    name = "RescaleQuotient"
    ndim = 2
    point_aware = True

    def __init__(self, metric: str = "inv", *, exp_steps: int = 10):
        if metric not in ("inv", "mix"):
            raise ValueError(f"metric must be 'inv' or 'mix', got {metric!r}")
        super().__init__(exp_steps=exp_steps)
        self.metric_name = metric

    def extra_repr(self) -> str:
        return f"metric={self.metric_name!r}"

    def split(self, x) -> tuple[Tensor, Tensor]:
        """``[u; v] ↦ (u, v)``."""
        x = as_tensor(x)
        return x[..., 0, :], x[..., 1, :]

    def join(self, u: Tensor, v: Tensor) -> Tensor:
        """``(u, v) ↦ [u; v]``."""
        return torch.stack((u, v), dim=-2)

    def _check_shape(self, shape, name):
        if len(shape) < 2 or shape[-2] != 2:
            return False, f"{name} must have shape (..., 2, d) holding [u; v], got {tuple(shape)}"
        return True, None

    # ------------------------------------------------------------------ primitives
    def lie_shape(self, x) -> tuple[int]:
        return (as_tensor(x).shape[-1],)

    def vertical(self, x, omega: Tensor) -> Tensor:
        """``(-u ω, v ω)``."""
        return as_tensor(x) * torch.stack((-omega, omega), dim=-2)

    def act(self, x, alpha: Tensor) -> Tensor:
        """``(u, v) ↦ (α u, v / α)`` for ``α`` of shape ``(..., d)``."""
        return as_tensor(x) * torch.stack((alpha, alpha.reciprocal()), dim=-2)

    def push(self, x, u: Tensor, alpha: Tensor) -> Tensor:
        """Differential of the action: ``(ξ_u, ξ_v) ↦ (α ξ_u, ξ_v / α)``."""
        return self.act(u, alpha)

    def metric(self, x, u: Tensor) -> Tensor:
        """inv: ``u / x²``; mix: ``(u_u v², u_v u²)``."""
        x = as_tensor(x)
        return u / x.square() if self.metric_name == "inv" else u * x.flip(-2).square()

    def metric_inv(self, x, v: Tensor) -> Tensor:
        """inv: ``v ⊙ x²``; mix: ``(v_u / v², v_v / u²)``."""
        x = as_tensor(x)
        return v * x.square() if self.metric_name == "inv" else v / x.flip(-2).square()

    # ------------------------------------------------------------------ closed forms
    def proju(self, x, u: Tensor) -> Tensor:
        """``(u b, v b)`` with ``b = ½ (ξ_u / u + ξ_v / v)``."""
        p = self.at(x)
        self._check_vector(p, u)
        return p.x * (u / p.x).mean(dim=-2, keepdim=True)

    def egrad2rgrad(self, x, u: Tensor) -> Tensor:
        """``proj(M⁻¹ ∇)``: inv ``proj(∇ ⊙ x²)``; mix ``proj(∇_u / v², ∇_v / u²)``."""
        p = self.at(x)
        self._check_vector(p, u, "the gradient")
        return self.proju(p, self.metric_inv(p.x, u))

    def christoffel(self, x, u: Tensor, v: Tensor | None = None) -> Tensor:
        """inv ``-u ⊙ v / x``; mix ``(u_u v_v + v_u u_v) / x̃ - (u ⊙ v)~ ⊙ x / x̃²`` (``~``: swap)."""
        p = self.at(x)
        self._check_vector(p, u)
        v = u if v is None else v
        X = p.x
        if self.metric_name == "inv":
            return -u * v / X
        cross = (u * v.flip(-2)).sum(dim=-2, keepdim=True)
        X_swap = X.flip(-2)
        return cross / X_swap - (u * v).flip(-2) * X / X_swap.square()

    def expmap(self, x, u: Tensor, *, steps: int | None = None) -> Tensor:
        """Exact geodesic at ``t = 1`` (closed forms of the class docstring; ``steps`` unused)."""
        p = self.at(x)
        self._check_vector(p, u)
        X = p.x
        a = u / X
        if self.metric_name == "inv":
            return X * torch.exp(a)
        a_u, a_v = a[..., :1, :], a[..., 1:, :]
        re, im = 1 + a_u + a_v, a_u - a_v
        angle = torch.atan2(im, re)
        return X * torch.hypot(re, im).sqrt() * torch.exp(0.5 * torch.cat((angle, -angle), -2))

    # ------------------------------------------------------------------ points
    def _check_free(self, x: Tensor) -> None:
        if not bool((x != 0).all()):
            raise ValueError(
                "the point has zero entries: the re-scaling action is not free there and the "
                "projection b = ½ (ξ_u / u + ξ_v / v) is undefined"
            )

    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        """Entries finite and non-zero (the action is free only there)."""
        x = as_tensor(x)
        if not bool(torch.isfinite(x).all()):
            return False, "the point has non-finite entries"
        if x.numel() == 0:
            return True, None
        smallest = x.abs().min().item()
        if smallest == 0:
            return False, "the point has zero entries; the re-scaling action is not free there"
        return True, f"smallest |entry| = {smallest:.3e}"
