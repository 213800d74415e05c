"""Worst case or average over the ball: what a measure does with one batch.

Each case is a small frozen value with the sizes that change its result (iterations,
restarts, samples) and one method, :meth:`measure_batch`, that turns one batch into a
:class:`~quotientgeo.sharpness.result.BatchRecord`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..validation import positive_int
from .apgd import auto_pgd
from .objective import Objective, Where
from .result import BatchRecord

__all__ = ["AverageCase", "WorstCase"]

FIRST_ORDER_MOVE = "the first-order move of the worst perturbation"  # in messages


@dataclasses.dataclass(frozen=True)
class WorstCase:
    """``max_{||ξ||_x ≤ ρ} L_S(γ_ξ(1)) - L_S(x)`` by Auto-PGD.

    Restart 0 starts at ``ξ = 0`` (equivariant, so results are invariant along orbits to
    floating point); later ones at random horizontal directions of norm ``ρ``. The record also
    holds the loss at the first-order move ``x + ξ*`` of the worst perturbation ``ξ*`` found
    (one extra no-grad forward, unless the map is first order or ``ξ* = 0``; with several
    restarts, one for each restart that beats the ones before it).
    """

    n_iter: int = 100
    restarts: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "n_iter", positive_int("n_iter", self.n_iter))
        object.__setattr__(self, "restarts", positive_int("restarts", self.restarts))

    @property
    def steps(self) -> int:
        """Progress-bar steps per batch."""
        return self.n_iter * self.restarts

    def settings(self) -> dict[str, Any]:
        return {"n_iter": self.n_iter, "restarts": self.restarts}

    def measure_batch(
        self,
        objective: Objective,
        batch,
        where: Where,
        gen: torch.Generator,
        *,
        rho: float,
        first_order_map: bool,
        return_perturbation: bool,
        advance: Callable[[], object],
    ) -> BatchRecord:
        """One batch's record; ``first_order_map``: the map is ``x + ξ`` (no extra forward
        for the first-order loss); ``advance()`` after each iteration (a progress bar)."""
        assert objective.worst_case  # a worst-case objective keeps the best iterate
        base = worst = first = None
        norm, xi, trace = 0.0, None, []
        for r in range(self.restarts):
            at = Where(where.batch, 0, r)
            objective.begin(batch, at, None if r == 0 else gen, rho)
            best, losses = auto_pgd(
                objective,
                rho=rho,
                n_iter=self.n_iter,
                check=lambda losses, at=at: objective.check_finite(losses, at),
                advance=advance,
            )
            trace.append(torch.cummax(losses, 0).values.tolist())
            if r == 0:
                base = worst = first = float(losses[0])
            best = float(best)
            assert worst is not None
            if best > worst:  # ξ* = 0 (the base point) until an iterate beats it
                worst = best
                xi_best = objective.best_iterate()
                norm = float(objective.sqnorm(xi_best).sqrt())
                first = worst
                if not first_order_map:
                    loss = objective.first_order_loss(xi_best, Where(where.batch, FIRST_ORDER_MOVE))
                    objective.check_finite(loss.reshape(1), Where(where.batch, FIRST_ORDER_MOVE))
                    first = float(loss)
                if return_perturbation:
                    xi = objective.tangent(xi_best)
        assert base is not None and worst is not None
        if return_perturbation:
            if xi is None:
                xi = objective.tangent(None)
            if objective.ranks.world > 1:  # gathered as pickled objects: via the host
                xi = {name: t.cpu() for name, t in xi.items()}
        objective.reset()
        return BatchRecord(base, worst, norm, trace, first, xi)


@dataclasses.dataclass(frozen=True)
class AverageCase:
    """``E_ξ L_S(γ_ξ(1)) - L_S(x)`` over ``||ξ||_x = ρ``, by ``n_samples`` draws.

    ``ξ`` is a standard Gaussian of the metric at ``x`` (isotropic in every block), projected
    to the horizontal space and scaled to norm ``ρ``; ``n_samples`` forward passes per batch.
    """

    n_samples: int = 100

    def __post_init__(self) -> None:
        object.__setattr__(self, "n_samples", positive_int("n_samples", self.n_samples))

    @property
    def steps(self) -> int:
        return self.n_samples

    def settings(self) -> dict[str, Any]:
        return {"n_samples": self.n_samples}

    def measure_batch(
        self,
        objective: Objective,
        batch,
        where: Where,
        gen: torch.Generator,
        *,
        rho: float,
        first_order_map: bool,
        return_perturbation: bool,
        advance: Callable[[], object],
    ) -> BatchRecord:
        """One batch's record; ``advance()`` after each sample (a progress bar)."""
        n = self.n_samples
        objective.begin(batch, where, None, rho)
        first = objective.value(0, grad=False)
        losses = torch.empty(n + 1, dtype=first.dtype, device=first.device)
        losses[0] = first
        for s in range(1, n + 1):
            objective.set_random(gen, rho)
            losses[s] = objective.value(s, grad=False)
            advance()
        objective.check_finite(losses, where)
        objective.reset()
        return BatchRecord(float(losses[0]), float(losses[1:].mean()), rho, [losses[1:].tolist()])
