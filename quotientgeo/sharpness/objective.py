"""The loss of a batch as a function of the perturbation ``ξ``: what Auto-PGD maximises.

``ξ`` is a list of tensors, one per kind of symmetry block (in the order of the geometry's
kinds) and last the adaptive rest. Each block moves by the measure's map (exact,
second-order or first-order geodesic step) at its cached base point, the rest along straight
lines; the perturbed parameters go to :func:`torch.func.functional_call`, so the model is
never written to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..diagnosis import Diagnosis
from ..geometry import ParameterGeometry
from ..linalg import tensor_sum
from ..manifolds import AdaptiveGeometry, QuotientManifold
from ..options import Norm, Perturbation
from ..perturbation import MOVES, PerturbationSpace, move_of
from .ranks import Local

Tensor = torch.Tensor

__all__ = ["Objective", "Where"]


@dataclasses.dataclass(frozen=True)
class Where:
    """An evaluation as messages name it: the batch, the restart, and the iteration index or
    what the evaluation is."""

    batch: int
    at: int | str = 0
    restart: int = 0

    def __str__(self) -> str:
        return f"batch {self.batch}, {self.moment}"

    @property
    def moment(self) -> str:
        """``iteration k (restart r)``, or what the evaluation is."""
        if isinstance(self.at, str):
            return self.at
        return f"iteration {self.at} (restart {self.restart})"

    def iteration(self, k: int) -> Where:
        return dataclasses.replace(self, at=k)


class _LossOf(nn.Module):
    """``forward(batch) = loss_fn(model, batch)``: the module given to ``functional_call``."""

    def __init__(self, model: nn.Module, loss_fn: Callable):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)


class Objective:
    """``ξ ↦ L_S(γ_ξ(1))`` for any batch ``S``, and the ball it is maximised in.

    Args:
        model, loss_fn: the network and ``loss_fn(model, batch) -> scalar tensor``.
        geometry: the model's parameter geometry; each kind is measured in its declared
            manifold (``eps``, unless ``None``, re-chooses the Gram relaxation of those with a
            metric).
        perturbation: the map of the symmetry blocks.
        norm: the metric of the ball and of the gradient.
        ranks: the rank mode (losses and gradients averaged over ranks with ``split_batch``).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], Tensor],
        geometry: ParameterGeometry,
        perturbation: Perturbation,
        norm: Norm,
        eps: float | None,
        ranks: Local,
    ):
        self.geometry = geometry
        self.ranks = ranks
        self.wrapper = _LossOf(model, loss_fn)
        points, w = geometry.gather()
        self.dtype, self.device = w.dtype, w.device
        manifolds = geometry.manifolds(eps=eps)
        self.diagnosis = Diagnosis(geometry, manifolds, points, w, "the model is restored")
        self.diagnosis.check_finite()  # NaN/Inf weights are named as such, not as rank deficient

        def ball(manifold: QuotientManifold) -> QuotientManifold:
            return manifold if norm == Norm.RIEMANNIAN else AdaptiveGeometry()

        with self.diagnosis.located():
            self.blocks = [
                PerturbationSpace(m, x, move_of(m, perturbation), ball(m))
                for m, x in zip(manifolds, points, strict=True)
            ]
        rest = geometry.rest_manifold()  # adaptive sharpness: straight lines, its own metric
        self.blocks.append(PerturbationSpace(rest, w, MOVES[Perturbation.FIRST_ORDER], rest))

    # ------------------------------------------------------------------ the ball
    def zeros(self) -> list[Tensor]:
        return [b.zeros() for b in self.blocks]

    def sqnorm(self, cs: list[Tensor]) -> Tensor:
        """``||ξ||²_x``: the blocks' square norms add."""
        return tensor_sum(b.sqnorm(c) for b, c in zip(self.blocks, cs, strict=True))

    def rgrad(self, grads: list[Tensor]) -> list[Tensor]:
        """The horizontal gradient in the ball's metric, block by block."""
        return [b.rgrad(d) for b, d in zip(self.blocks, grads, strict=True)]

    def random_direction(self, gen: torch.Generator, rho: float) -> list[Tensor]:
        """Horizontal direction of norm ``rho``, isotropic in the metric at the base point."""
        cs = [b.random(gen) for b in self.blocks]
        scale = rho / self.sqnorm(cs).sqrt()
        return [c * scale for c in cs]

    def tangent(self, cs: list[Tensor]) -> dict[str, Tensor]:
        """``cs`` in parameter coordinates, as new detached tensors. ``scatter`` is linear: views,
        transposes, concatenations and slice scatters that overwrite every entry (covered ones
        from the blocks, the others from the adaptive vector)."""
        values = self.geometry.scatter(cs[:-1], cs[-1])
        return {name: t.detach().clone() for name, t in values.items()}

    # ------------------------------------------------------------------ the loss
    def evaluate(
        self, batch, cs: list[Tensor], where: Where, *, grad: bool, first_order: bool = False
    ) -> tuple[Tensor, list[Tensor] | None]:
        """Loss of ``batch`` at ``cs`` (detached, compute dtype) and, with ``grad``, its
        gradient wrt ``cs``; with ``distributed="split_batch"`` both averaged over ranks.
        ``first_order``: every block moves by ``retr`` (``x + ξ``) instead of the measure's
        map. An exception of ``loss_fn`` keeps its type and gains a note naming ``where``; a
        failure of the geometry at faulty weights raises the error that names them."""

        def attempt():
            with self.diagnosis.located():
                return self._evaluate(batch, cs, where, grad, first_order)

        return self.ranks.evaluate(attempt, cs, where, grad)

    def first_order_loss(self, batch, cs: list[Tensor], where: Where) -> float:
        """Loss at the first-order move ``x + ξ`` of ``cs``: one no-grad forward."""
        loss, _ = self.evaluate(batch, cs, where, grad=False, first_order=True)
        self.check_finite(loss.reshape(1), where)
        return float(loss)

    def check_finite(self, losses: Tensor, where: Where) -> None:
        """Raise (on every rank) if ``losses`` are not all finite; ``losses[k]`` is the loss at
        iteration ``k`` of ``where`` (or at ``where`` itself for one loss). The message also
        names the heads whose factors are rank deficient to working precision, if any."""
        finite = torch.isfinite(losses)
        all_finite = bool(finite.all())
        self.ranks.check_finite(all_finite)
        if all_finite:
            return
        k = int((~finite).nonzero()[0, 0])
        at = where if isinstance(where.at, str) else where.iteration(k)
        message = (
            f"loss_fn returned a non-finite loss ({float(losses[k])}) on batch {at.batch} at "
            f"{at.moment}"
        )
        deficient = self.diagnosis.rank_deficient()  # nearly singular heads are a cause
        if deficient is not None:
            raise ValueError(f"{message}, likely from {deficient}")
        raise ValueError(f"{message}; the model is restored")

    def _evaluate(self, batch, cs: list[Tensor], where: Where, grad: bool, first_order: bool):
        with torch.enable_grad() if grad else torch.no_grad():
            leaves = [c.detach().requires_grad_(grad) for c in cs]
            moves = [b.first_order if first_order else b.move for b in self.blocks]
            ys = [move(c) for move, c in zip(moves, leaves, strict=True)]
            params = self.geometry.scatter(ys[:-1], ys[-1])
            params = {f"model.{name}": t for name, t in params.items()}
            try:
                loss = torch.func.functional_call(self.wrapper, params, (batch,))
            except Exception as err:
                add_note = getattr(err, "add_note", None)  # Python 3.11+
                if add_note is not None:
                    add_note(f"raised by loss_fn on {where}; the model is restored")
                raise
            if not isinstance(loss, Tensor):
                raise TypeError(
                    f"loss_fn must return a scalar tensor, got {type(loss).__name__} ({where})"
                )
            if loss.numel() != 1:
                raise ValueError(
                    f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)} ({where})"
                )
            if not grad:
                return loss.detach().reshape(()).to(self.dtype), None
            if not loss.requires_grad:
                raise ValueError(
                    f"loss_fn returned a tensor that does not depend on the parameters ({where})"
                )
            grads = torch.autograd.grad(loss.reshape(()), leaves, allow_unused=True)
        grads = [torch.zeros_like(c) if g is None else g for c, g in zip(cs, grads, strict=True)]
        return loss.detach().reshape(()).to(self.dtype), grads
