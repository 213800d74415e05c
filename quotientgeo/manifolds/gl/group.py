"""The group ``GL(h)`` acting on GL pairs ``x = [G; H]`` by ``(G, H) ↦ (G A⁻¹, H Aᵀ)``."""

from __future__ import annotations

import torch

from ...linalg import conditioned_matrix, mT
from ...validation import positive_int
from ..base import AtPoint
from ..groups import DEFAULT_CONDITION, check_condition
from .blocks import blockwise

Tensor = torch.Tensor

__all__ = ["GLGroup"]


class GLGroup:
    r"""``GL(h)`` acting on pairs ``x = [G; H]`` (``n`` rows in ``G``) by
    ``(G, H) ↦ (G A⁻¹, H Aᵀ)``.

    Lie algebra ``gl(h)`` (``Ω`` of shape ``(h, h)``), vertical vectors ``(-G Ω, H Ωᵀ)``; the
    differential of the action is the same map on tangent vectors. Subgroups
    (:class:`~.rotary.RotaryGroup`) refine the Lie algebra and keep the action.
    """

    def __init__(self, n: int):
        self.n = positive_int("n", n, "rows of G")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={self.n})"

    def lie_shape(self, p: AtPoint) -> tuple[int, ...]:
        h = p.x.shape[-1]
        return (h, h)

    def vertical(self, p: AtPoint, omega: Tensor) -> Tensor:
        """``(-G Ω, H Ωᵀ)``."""
        return blockwise(self.n, p.x, -omega, mT(omega))

    def precondition(self, p: AtPoint, r: Tensor) -> Tensor:
        """The identity (the metric's quotient class may know the normal operator's inverse)."""
        return r

    def act(self, x: Tensor, A: Tensor) -> Tensor:
        """``(G, H) ↦ (G A⁻¹, H Aᵀ)`` for ``A`` of shape ``(..., h, h)``."""
        G, H = x[..., : self.n, :], x[..., self.n :, :]
        return torch.cat((torch.linalg.solve(A, G, left=False), H @ mT(A)), dim=-2)

    def push(self, x: Tensor, u: Tensor, A: Tensor) -> Tensor:
        """Differential of the action: ``(ξ_G, ξ_H) ↦ (ξ_G A⁻¹, ξ_H Aᵀ)``."""
        return self.act(u, A)

    def random_group(
        self,
        x: Tensor | AtPoint,
        *,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        condition: float = DEFAULT_CONDITION,
    ) -> Tensor:
        """``A = scale · U diag(σ) Vᵀ``, one per batch entry of ``x``: ``U``, ``V`` Haar-random
        orthogonal, ``σ`` log-uniform in ``[c^{-1/2}, c^{1/2}]`` (``c = condition``), so
        ``cond(A) ≤ c`` and the Gram matrices ``GᵀG``, ``HᵀH`` of the moved point have condition
        numbers at most ``c²`` times the original ones (both components of GL(h) occur)."""
        x = x.x if isinstance(x, AtPoint) else x
        h = x.shape[-1]
        A = conditioned_matrix(
            *x.shape[:-2],
            h,
            h,
            condition=check_condition(condition),
            generator=generator,
            dtype=x.dtype,
            device=x.device,
        )
        return A.mul_(scale)

    def group_name(self, shape: tuple[int, ...]) -> str:
        return f"GL({shape[-1]})"
