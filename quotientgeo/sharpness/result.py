"""The outcome of a sharpness measurement: one record per batch, and the result over batches."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

Tensor = torch.Tensor

__all__ = ["BatchRecord", "SharpnessResult"]


@dataclasses.dataclass(frozen=True)
class BatchRecord:
    """What a measure found on one batch.

    Attributes:
        base_loss: the unperturbed loss ``L_S(x)``.
        loss: the worst loss found (average measure: the mean perturbed loss).
        perturbation_norm: ball norm ``||ξ*||_x`` of the worst perturbation (``0`` when none
            beat the base loss; ``ρ`` for the average measure).
        trace: per restart, the best loss after each iterate (average measure: one list of
            the loss of every sample).
        first_order_loss: worst-case measures: the loss at the first-order move ``x + ξ*``.
        perturbation: ``ξ*`` in parameter coordinates, when asked for.
    """

    base_loss: float
    loss: float
    perturbation_norm: float
    trace: list[list[float]]
    first_order_loss: float | None = None
    perturbation: dict[str, Tensor] | None = None


@dataclasses.dataclass
class SharpnessResult:
    """Outcome of a sharpness measurement.

    Attributes:
        value: mean over batches of ``worst (or average) loss - base loss``.
        per_batch: that difference for every batch.
        base_losses: unperturbed loss per batch.
        worst_losses: worst loss per batch (average measure: mean perturbed loss).
        perturbation_norms: ball norm ``||ξ||_x`` of the worst perturbation per batch
            (``0`` when no perturbation beat the base loss; ``ρ`` for the average measure).
        trace: ``trace[batch][restart][k]`` best loss after evaluating iterate ``k`` (average
            measure: ``trace[batch][0]`` lists the loss of every sample).
        settings: the switches and sizes of the run, and the geometry summary.
        wall_time: seconds.
        first_order_losses: worst-case measures: per batch, the loss at the first-order move
            ``x + ξ*`` (``retr`` on every block, straight lines on the rest) of the worst
            perturbation ``ξ*`` of ``worst_losses`` (the base loss when ``ξ* = 0``;
            ``worst_losses`` itself with ``perturbation="first_order"``). ``None`` for the
            average measure.
        perturbations: with ``return_perturbation=True``, per batch, ``ξ*`` as a tangent vector
            in parameter coordinates, ``{name: tensor}`` in the parameters' shapes, dtypes and
            device (zeros when ``ξ* = 0``; new tensors, detached); else ``None``.
    """

    value: float
    per_batch: list[float]
    base_losses: list[float]
    worst_losses: list[float]
    perturbation_norms: list[float]
    trace: list[list[list[float]]]
    settings: dict[str, Any]
    wall_time: float
    first_order_losses: list[float] | None = None
    perturbations: list[dict[str, Tensor]] | None = None

    @property
    def first_order_value(self) -> float:
        """``mean_b (first_order_losses[b] - base_losses[b])``: the loss increase at the
        first-order moves ``x + ξ*`` of the worst perturbations; NaN without
        ``first_order_losses``."""
        if self.first_order_losses is None:
            return math.nan
        per_batch = [f - b for f, b in zip(self.first_order_losses, self.base_losses, strict=True)]
        return sum(per_batch) / len(per_batch)

    @property
    def curvature_share(self) -> float:
        """``(value - first_order_value) / value``: the fraction of the worst-case increase that
        the curvature (Christoffel) term of the map is responsible for (``0`` for first-order
        moves, ``O(ρ)`` as ``ρ → 0``, negative where that term lowers the loss at ``ξ*``); NaN
        when ``value == 0`` or without ``first_order_losses``."""
        if self.first_order_losses is None or self.value == 0:
            return math.nan
        return (self.value - self.first_order_value) / self.value

    def to_dict(self) -> dict[str, Any]:
        """Plain ``dict`` of built-in types, ready for :func:`json.dumps`: the fields (not the
        properties), ``perturbations`` as nested lists (:meth:`torch.Tensor.tolist`)."""
        data = dataclasses.asdict(dataclasses.replace(self, perturbations=None))
        if self.perturbations is not None:
            data["perturbations"] = [
                {name: t.tolist() for name, t in xi.items()} for xi in self.perturbations
            ]
        return data

    def __repr__(self) -> str:
        s = self.settings
        return (
            f"SharpnessResult(value={self.value:.6g}, measure={s.get('measure')!r}, "
            f"rho={s.get('rho')}, batches={len(self.per_batch)}, wall_time={self.wall_time:.3g}s)"
        )

    @classmethod
    def from_records(
        cls, records: list[BatchRecord], settings: dict[str, Any], wall_time: float, device
    ) -> SharpnessResult:
        """The result over batches of the per-batch ``records`` (in batch order)."""
        per_batch = [r.loss - r.base_loss for r in records]
        first = [r.first_order_loss for r in records]
        xis = [r.perturbation for r in records]
        return cls(
            value=sum(per_batch) / len(per_batch),
            per_batch=per_batch,
            base_losses=[r.base_loss for r in records],
            worst_losses=[r.loss for r in records],
            perturbation_norms=[r.perturbation_norm for r in records],
            trace=[r.trace for r in records],
            settings=settings,
            wall_time=wall_time,
            first_order_losses=None if None in first else first,  # pyright: ignore[reportArgumentType]
            perturbations=(
                None if None in xis else [{n: t.to(device) for n, t in xi.items()} for xi in xis]  # pyright: ignore[reportOptionalMemberAccess]
            ),
        )
