r"""Auto-PGD (Croce & Hein 2020; as in Andriushchenko et al. 2023) on a ball of tangent vectors.

Maximises ``f(ξ)`` over ``||ξ||_x ≤ ρ`` from a start ``ξ_0``: step ``η = 2ρ``,
``z = P_S(ξ_k + η g / ||g||)``, ``ξ_{k+1} = P_S(ξ_k + α (z - ξ_k) + (1-α)(ξ_k - ξ_{k-1}))`` with
``α = 0.75`` (``ξ_1 = z``), ``g`` the Riemannian gradient of ``f`` in the ball's metric and
``P_S`` the scaling into the ball (the loop only combines horizontal vectors). At the
checkpoints ``p_0 = 0, p_1 = 0.22, p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)``
(fractions of ``n_iter``) the step is halved and the iterate restarts from the best point if
fewer than 75 % of the steps since the last checkpoint improved the best value, or if neither
the step nor the best value changed. One evaluation per iteration gives both the value at
``ξ_k`` and its gradient.

Nothing here knows about models or batches: the objective is a function.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

Tensor = torch.Tensor

__all__ = ["Ball", "auto_pgd", "checkpoints"]

MOMENTUM = 0.75
MIN_UPDATE_RATIO = 0.75


class Ball(Protocol):
    """The metric of the ball: square norm of a tangent vector, gradient in that metric."""

    def sqnorm(self, cs: list[Tensor]) -> Tensor: ...

    def rgrad(self, grads: list[Tensor]) -> list[Tensor]: ...


def checkpoints(n_iter: int) -> list[int]:
    """Auto-PGD checkpoints ``ceil(p_j n)``: ``p_0 = 0``, ``p_1 = 0.22``,
    ``p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)`` (as in the reference code)."""
    p, w = [0.0, 0.22], [0, math.ceil(n_iter * 0.22)]
    while w[-1] < n_iter and w[-1] != w[-2]:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
        w.append(math.ceil(p[-1] * n_iter))
    return sorted({k for k in w[1:] if 0 < k < n_iter})


def _scale_into_ball_(ball: Ball, cs: list[Tensor], rho: float) -> list[Tensor]:
    """``P_S`` on horizontal vectors, in place: ``ξ ← ξ · min(1, ρ / ||ξ||_x)``."""
    scale = (rho / ball.sqnorm(cs).sqrt()).clamp(max=1.0)
    for c in cs:
        c.mul_(scale)
    return cs


def _step(ball: Ball, c, c_prev, grads, eta: float, rho: float, first: bool):
    """``z = P_S(ξ + η g/||g||)``; ``ξ_new = z`` (first step) or
    ``P_S(ξ + α(z - ξ) + (1-α)(ξ - ξ_prev)) = P_S(α z + 2(1-α) ξ - (1-α) ξ_prev)``.

    Fused and in place on fresh tensors: a few passes over the parameters per iteration.
    """
    g = ball.rgrad(grads)
    norm = ball.sqnorm(g).sqrt()
    step = eta / (norm + torch.finfo(norm.dtype).tiny)
    z = _scale_into_ball_(
        ball, [torch.addcmul(ci, gi, step) for ci, gi in zip(c, g, strict=True)], rho
    )
    if first:
        return z
    a = MOMENTUM
    new = [
        torch.mul(ci, 2 * (1 - a)).add_(pi, alpha=-(1 - a)).add_(zi, alpha=a)
        for ci, zi, pi in zip(c, z, c_prev, strict=True)
    ]
    return _scale_into_ball_(ball, new, rho)


def host_tracking(device: torch.device) -> bool:
    """Track the best point with host comparisons (free on CPU) rather than on the device."""
    return device.type == "cpu"


def auto_pgd(
    f: Callable[[list[Tensor], int, bool], tuple[Tensor, list[Tensor] | None]],
    start: list[Tensor],
    *,
    rho: float,
    n_iter: int,
    ball: Ball,
    check: Callable[[Tensor], None] = lambda losses: None,
    advance: Callable[[], object] = lambda: None,
) -> tuple[Tensor, list[Tensor], Tensor]:
    """One Auto-PGD run from ``start``; returns ``(best value, best ξ, value of every iterate)``.

    Args:
        f: ``f(ξ, k, grad) -> (value, gradient or None)``, a 0-dim tensor and one tensor per
            part of ``ξ``; ``k`` is the iterate's index.
        start: ``ξ_0`` (inside the ball).
        rho: radius; n_iter: iterations (``n_iter + 1`` evaluations, the last without
            gradient).
        ball: the metric of the ball.
        check: called with the values so far at the checkpoints and at the end (to fail early
            on non-finite values).
        advance: called once per iteration (a progress bar).

    Iterates are never modified after they are formed, so the best point is kept by reference;
    on CUDA the comparison stays on the device (``torch.where``) to avoid a host sync per
    iteration, and only the checkpoints synchronise.
    """
    marks = set(checkpoints(n_iter))
    c, c_prev = start, start
    losses = torch.empty(n_iter + 1, dtype=start[0].dtype, device=start[0].device)
    on_host = host_tracking(losses.device)
    eta, prev_eta, prev_cp, prev_best = 2.0 * rho, 2.0 * rho, 0, None
    n_updates = torch.zeros((), dtype=torch.int64, device=losses.device)
    best, best_c, best_g = losses[0], start, None  # set at k = 0
    for k in range(n_iter + 1):
        last = k == n_iter
        loss, grads = f(c, k, not last)
        losses[k] = loss
        if k == 0:
            check(losses[:1])
            best, best_c, best_g = loss, c, grads
            prev_best = float(loss)
        else:
            improved = loss > best
            n_updates += improved
            if on_host:
                if bool(improved):
                    best, best_c, best_g = loss, c, grads
            else:
                best = torch.where(improved, loss, best)
                best_c = [torch.where(improved, u, v) for u, v in zip(c, best_c, strict=True)]
                if not last:  # grads is a list whenever not last (f(..., grad=not last))
                    best_g = [
                        torch.where(improved, u, v)
                        for u, v in zip(grads, best_g, strict=True)  # pyright: ignore[reportArgumentType]
                    ]
        if last:
            break
        advance()
        if k in marks:
            check(losses[: k + 1])
            best_now, updates = float(best), int(n_updates)
            stalled = updates < MIN_UPDATE_RATIO * (k - prev_cp)
            frozen = prev_eta == eta and prev_best == best_now
            prev_eta, prev_best, prev_cp = eta, best_now, k
            n_updates.zero_()
            if stalled or frozen:
                eta *= 0.5
                c, c_prev, grads = best_c, best_c, best_g
        c_prev, c = c, _step(ball, c, c_prev, grads, eta, rho, first=k == 0)
    check(losses)
    return best, best_c, losses
