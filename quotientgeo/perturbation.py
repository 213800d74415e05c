"""Perturbations of a model's parameters in its parameter geometry, kind by kind.

Shared by the sharpness measures (the Auto-PGD maximiser) and the sharpness-aware optimizer:
each :class:`PerturbationSpace` holds one kind's manifold at a cached base point, the move that
applies a tangent vector (second-order, first-order or exact geodesic step) and the metric of
the ball.
"""

from __future__ import annotations

import functools

import torch

from .options import Perturbation

Tensor = torch.Tensor

__all__ = ["MOVES", "PerturbationSpace", "move_of"]

MOVES = {
    Perturbation.SECOND_ORDER: "expmap2",
    Perturbation.FIRST_ORDER: "retr",
    Perturbation.EXACT: "expmap",
}


def move_of(manifold, perturbation: Perturbation | str) -> str:
    """The manifold method that applies ``perturbation``: :data:`MOVES`, and for ``"default"``
    the exact geodesic (``expmap``) where it is a closed form
    (``manifold.closed_form_geodesic``), else the second-order map (``expmap2``)."""
    if perturbation == Perturbation.DEFAULT:
        return "expmap" if manifold.closed_form_geodesic else "expmap2"
    return MOVES[Perturbation(perturbation)]


class PerturbationSpace:
    """Perturbations of one kind of points at a base point ``x``, through the manifold API only.

    ``manifold`` carries the perturbation (``move``: one of its ``expmap2``, ``retr``,
    ``expmap`` at the cached base point; ``first_order``: its ``retr``, whatever ``move`` is)
    and the horizontal space; ``ball`` is the metric of the ball and of the gradient:
    ``manifold`` itself (Riemannian norm) or the element-wise
    :class:`~quotientgeo.AdaptiveGeometry` (adaptive norm, perturbations kept horizontal).
    """

    def __init__(self, manifold, x: Tensor, move: str, ball):
        self.manifold = manifold
        self.point = manifold.at(x)
        self.move = functools.partial(getattr(manifold, move), self.point)
        self.first_order = functools.partial(manifold.retr, self.point)  # ``x + ξ``
        self.ball = ball
        self.ball_point = self.point if ball is manifold else ball.at(x)

    def zeros(self) -> Tensor:
        return torch.zeros_like(self.point.x)

    def rgrad(self, d: Tensor) -> Tensor:
        """Horizontal gradient in the ball metric: ``egrad2rgrad`` (or ``proj(M_ball⁻¹ ∇)``)."""
        if self.ball is self.manifold:
            return self.manifold.egrad2rgrad(self.point, d)
        return self.manifold.proju(self.point, self.ball.egrad2rgrad(self.ball_point, d))

    def sqnorm(self, c: Tensor) -> Tensor:
        return self.ball.inner(self.ball_point, c).sum()

    def random(self, gen: torch.Generator) -> Tensor:
        """Random horizontal direction, isotropic in the ball metric before the projection."""
        if self.ball is self.manifold:
            return self.manifold.random_tangent(self.point, generator=gen)
        return self.manifold.proju(
            self.point, self.ball.random_tangent(self.ball_point, generator=gen)
        )
