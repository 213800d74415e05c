"""Worst case or average over the ball: what a measure does with one batch.

Each case is a small frozen value with the sizes that change its result (iterations,
restarts, samples) and one method, :meth:`measure_batch`, that turns one batch into a
:class:`~quotientgeo.sharpness.result.BatchRecord`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..options import Perturbation
from ..validation import positive_int
from .apgd import auto_pgd
from .objective import Objective, Where
from .result import BatchRecord

if TYPE_CHECKING:
    from .measure import Measure

__all__ = ["AverageCase", "WorstCase"]

FIRST_ORDER_MOVE = "the first-order move of the worst perturbation"  # in messages


@dataclasses.dataclass(frozen=True)
class WorstCase:
    """``max_{||ξ||_x ≤ ρ} L_S(γ_ξ(1)) - L_S(x)`` by Auto-PGD.

    Restart 0 starts at ``ξ = 0`` (equivariant, so results are invariant along orbits to
    floating point); later ones at random horizontal directions of norm ``ρ``. The record also
    holds the loss at the first-order move ``x + ξ*`` of the worst perturbation ``ξ*`` found
    (one extra no-grad forward, unless the map is first order or ``ξ* = 0``).
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
        measure: Measure,
        return_perturbation: bool,
        advance: Callable[[], object],
    ) -> BatchRecord:
        """One batch's record; ``advance()`` after each iteration (a progress bar)."""
        rho = measure.rho
        base = worst = None
        worst_c, trace = None, []
        for r in range(self.restarts):
            at = Where(where.batch, 0, r)
            start = objective.zeros() if r == 0 else objective.random_direction(gen, rho)
            best, best_c, losses = auto_pgd(
                lambda c, k, grad, at=at: objective.evaluate(batch, c, at.iteration(k), grad=grad),
                start,
                rho=rho,
                n_iter=self.n_iter,
                ball=objective,
                check=lambda losses, at=at: objective.check_finite(losses, at),
                advance=advance,
            )
            if r == 0:
                base = float(losses[0])
                worst, worst_c = base, None
            best = float(best)
            if worst is None or best > worst:  # worst is set at r == 0
                worst, worst_c = best, best_c
            trace.append(torch.cummax(losses, 0).values.tolist())
        assert base is not None and worst is not None
        norm = 0.0 if worst_c is None else float(objective.sqnorm(worst_c).sqrt())
        # ξ* = 0 (the base point), or the same move: no extra forward pass
        if worst_c is None or measure.perturbation == Perturbation.FIRST_ORDER:
            first = worst
        else:
            first = objective.first_order_loss(batch, worst_c, Where(where.batch, FIRST_ORDER_MOVE))
        xi = None
        if return_perturbation:
            xi = objective.tangent(objective.zeros() if worst_c is None else worst_c)
            if objective.ranks.world > 1:  # gathered as pickled objects: via the host
                xi = {name: t.cpu() for name, t in xi.items()}
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
        measure: Measure,
        return_perturbation: bool,
        advance: Callable[[], object],
    ) -> BatchRecord:
        """One batch's record; ``advance()`` after each sample (a progress bar)."""
        n, rho = self.n_samples, measure.rho
        losses = torch.empty(n + 1, dtype=objective.dtype, device=objective.device)
        losses[0], _ = objective.evaluate(batch, objective.zeros(), where, grad=False)
        for s in range(1, n + 1):
            cs = objective.random_direction(gen, rho)
            losses[s], _ = objective.evaluate(batch, cs, where.iteration(s), grad=False)
            advance()
        objective.check_finite(losses, where)
        return BatchRecord(float(losses[0]), float(losses[1:].mean()), rho, [losses[1:].tolist()])
