r"""Auto-PGD (Croce & Hein 2020; as in Andriushchenko et al. 2023) on a ball of tangent vectors.

Maximises ``f(ξ)`` over ``||ξ||_x ≤ ρ`` from a start ``ξ_0`` (with ``ξ_{-1} = ξ_0``): step
``η = 2ρ``, ``z = P_S(ξ_k + η g / ||g||)``,
``ξ_{k+1} = P_S(ξ_k + α (z - ξ_k) + (1-α)(ξ_k - ξ_{k-1}))`` with ``α = 0.75`` (``ξ_1 = z``),
``g`` the Riemannian gradient of ``f`` at ``ξ_k`` in the ball's metric and ``P_S`` the scaling
into the ball (the loop only combines horizontal vectors). At the checkpoints
``p_0 = 0, p_1 = 0.22, p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)`` (fractions of
``n_iter``) the step is halved and the iterate restarts from the best point if fewer than 75 %
of the steps since the last checkpoint improved the best value, or if neither the step nor the
best value changed. One evaluation per iteration gives both the value at ``ξ_k`` and its
gradient.

Every iterate is a combination of ``(ξ_k, ξ_{k-1}, g)``: so the loop needs nothing of them but
their Gram matrix ``K`` in the ball's metric, and it chooses the coefficients ``c`` of
``ξ_{k+1} = c₀ ξ_k + c₁ ξ_{k-1} + c₂ g`` with ``||Σ cᵢ vᵢ||² = cᵀ K c``
(:func:`step_coefficients`). The vectors themselves stay with the :class:`Iterates`, which may
keep them anywhere (the sharpness objective keeps the current one in the model's weights).

Nothing here knows about models or batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from ..linalg import constant

Tensor = torch.Tensor

__all__ = ["Iterates", "auto_pgd", "checkpoints", "step_coefficients"]

MOMENTUM = 0.75
MIN_UPDATE_RATIO = 0.75
#: ``(1, 0, 0)``, ``(0, 0, 1)`` and the momentum's ``(1-α)(2, -1, 0)``: the step's constant
#: coefficient vectors (:func:`step_coefficients`).
_STEP_CONSTANTS = ((1.0, 0.0, 0.0), (0.0, 0.0, 1.0), (2 * (1 - MOMENTUM), -(1 - MOMENTUM), 0.0))


class Iterates(Protocol):
    """The iterates ``ξ_k``, ``ξ_{k-1}``, the best one, and the function being maximised."""

    def value(self, k: int, grad: bool) -> Tensor:
        """``f(ξ_k)`` (0-dim); with ``grad``, what :meth:`gradient` needs is kept."""
        ...

    def keep_best(self, keep: bool) -> None:
        """``best ← ξ_k`` if ``keep``: called after every :meth:`value` of an iterate, before
        its gradient is taken (so a best point that ``ξ_k`` replaces can go before the
        backward pass)."""
        ...

    def gradient(self) -> None:
        """The gradient at ``ξ_k`` of the last :meth:`value`, kept for :meth:`gram`."""
        ...

    def gram(self) -> Tensor:
        """The 3 × 3 Gram matrix of ``(ξ_k, ξ_{k-1}, g)``, ``g`` the Riemannian gradient."""
        ...

    def advance(self, c: Tensor) -> None:
        """``ξ_{k-1} ← ξ_k``, ``ξ_k ← c₀ ξ_k + c₁ ξ_{k-1} + c₂ g``."""
        ...

    def restart(self, best_is_current: bool, k: int) -> None:
        """``ξ_k = ξ_{k-1} = best``, with the gradient at ``best`` kept for :meth:`gram`
        (:meth:`gradient` where ``best`` is ``ξ_k``, else evaluated at ``best``)."""
        ...


def checkpoints(n_iter: int) -> list[int]:
    """Auto-PGD checkpoints ``ceil(p_j n)``: ``p_0 = 0``, ``p_1 = 0.22``,
    ``p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)`` (as in the reference code)."""
    p, w = [0.0, 0.22], [0, math.ceil(n_iter * 0.22)]
    while w[-1] < n_iter and w[-1] != w[-2]:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
        w.append(math.ceil(p[-1] * n_iter))
    return sorted({k for k in w[1:] if 0 < k < n_iter})


def step_coefficients(K: Tensor, eta: float, rho: float, *, first: bool) -> Tensor:
    """``c`` with ``ξ_{k+1} = c · (ξ_k, ξ_{k-1}, g)`` from the Gram matrix ``K`` of the three.

    ``y = ξ_k + η g / ||g||``, ``z = y · min(1, ρ / ||y||)``; the first step is ``z``, a later
    one ``u · min(1, ρ / ||u||)`` with ``u = α z + (1-α)(2 ξ_k - ξ_{k-1})``; the norms are
    ``sqrt(cᵀ K c)``, and ``min(1, ρ / ||c||) = max(cᵀ K c / ρ², 1)^(-1/2)``. Tensors on
    ``K``'s device: no host synchronisation.
    """

    def into_ball(c: Tensor) -> Tensor:
        return c * (c @ K @ c).mul(1.0 / rho**2).clamp_min(1.0).rsqrt()

    first_axis, last_axis, momentum = constant(_STEP_CONSTANTS, K)
    step = eta / (K[2, 2].clamp_min(0).sqrt() + torch.finfo(K.dtype).tiny)
    z = into_ball(torch.addcmul(first_axis, step, last_axis))  # (1, 0, step)
    if first:
        return z
    return into_ball(torch.add(momentum, z, alpha=MOMENTUM))


def auto_pgd(
    iterates: Iterates,
    *,
    rho: float,
    n_iter: int,
    check: Callable[[Tensor], None] = lambda losses: None,
    advance: Callable[[], object] = lambda: None,
) -> tuple[Tensor, Tensor]:
    """One Auto-PGD run from ``iterates``' start; returns ``(best value, value of every
    iterate)``; the best iterate is ``iterates``' best.

    Args:
        iterates: the function and the iterates (:class:`Iterates`).
        rho: radius; n_iter: iterations (``n_iter + 1`` evaluations, the last without
            gradient; at a restart from an earlier best point the current iterate's gradient
            is not taken, and the best point is evaluated again with its gradient).
        check: called with the values so far where they are found not all finite (at the
            start and at the checkpoints), and with all of them at the end (to fail early on
            non-finite values).
        advance: called once per iteration (a progress bar).

    One code path on every device, one host read per iteration: after the forward pass of
    ``ξ_k``, whether it beats the best value (at a checkpoint together with whether the values
    so far are finite). The read comes before the backward pass, so a best point that ``ξ_k``
    replaces is freed before it; on an accelerator the device then waits only while the host
    queues the backward pass's first kernels. The count of improving steps and the restart
    decision follow on the host: the best value is unchanged since the last checkpoint exactly
    when no step since then improved it.
    """
    marks = set(checkpoints(n_iter))
    eta, prev_eta, prev_cp = 2.0 * rho, 2.0 * rho, 0
    losses: Tensor | None = None
    best: Tensor | None = None
    n_updates = 0
    for k in range(n_iter + 1):
        last = k == n_iter
        loss = iterates.value(k, not last)
        marked = k in marks and not last
        if k == 0:
            losses = torch.empty(n_iter + 1, dtype=loss.dtype, device=loss.device)
            losses[0] = loss
            if not bool(torch.isfinite(loss)):  # the one host read
                check(losses[:1])
            best, keep = loss, True
        else:
            assert losses is not None and best is not None
            losses[k] = loss
            better = loss > best
            if marked:
                finite = torch.isfinite(losses[: k + 1]).all()
                code = int(better + 2 * ~finite)  # the one host read
                keep = bool(code & 1)
                if code & 2:
                    check(losses[: k + 1])
            else:
                keep = bool(better)  # the one host read
            if keep:
                best, n_updates = loss, n_updates + 1
        restart = False
        if marked:
            # stalled, or frozen (neither the step nor the best value changed)
            restart = n_updates < MIN_UPDATE_RATIO * (k - prev_cp) or (
                prev_eta == eta and n_updates == 0
            )
            prev_eta, prev_cp, n_updates = eta, k, 0
        iterates.keep_best(keep)
        if last:
            break
        advance()
        if restart:
            eta *= 0.5
            iterates.restart(keep, k)
        else:
            iterates.gradient()
        c = step_coefficients(iterates.gram(), eta, rho, first=k == 0)
        iterates.advance(c)
    assert losses is not None and best is not None
    check(losses)
    return best, losses
