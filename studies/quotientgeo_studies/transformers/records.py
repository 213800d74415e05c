"""What the transformers study collects: members, calibrations and one record per measurement."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from quotientgeo import Measure

from .._finetune import FineTuning

Row = Measure  # what a table row measures


@dataclasses.dataclass(frozen=True)
class Member:
    """One fine-tuned model: its recipe and ``metrics`` (``train_error``, ``test_error``,
    ``gap = test - train``, ``n_train``, ``cached``: whether it came from the cache)."""

    recipe: FineTuning
    metrics: dict[str, Any]

    @property
    def gap(self) -> float:
        return self.metrics["gap"]


@dataclasses.dataclass(frozen=True)
class Calibrated:
    """A ball's ``ρ₁`` on the reference member, the value reached there, measurements used."""

    rho: float
    value: float
    evaluations: int


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Member ``member`` measured with ``measure`` (its radius is ``measure.rho``), asked for by
    table row ``row`` at ``ρ = factor · ρ₁``. A measurement that raised (e.g. an exact geodesic
    leaving the manifold at a large ρ) has NaN values, left out of τ, and a ``failure``."""

    member: int
    row: str
    factor: float
    measure: Row
    value: float
    first_order_value: float
    failure: str | None = None

    @classmethod
    def failed(cls, member: int, row: str, factor: float, measure: Row, reason: str):
        return cls(member, row, factor, measure, math.nan, math.nan, reason)


@dataclasses.dataclass(frozen=True)
class Records:
    """Everything :func:`~.collect.collect` measured; ``measurements`` holds the τ(ρ) grid, then
    the ablations, each member by member, every distinct ``(member, measure)`` once."""

    members: list[Member]
    pretrained: dict[str, float]  # the pretrained model's metrics
    calibration: dict[str, Calibrated]  # calibrated row -> its ball's ρ₁
    measurements: list[Measurement]
    ranks: int
    seconds: dict[str, float]  # wall time of each phase
    started: float  # time.perf_counter() when collecting began

    @property
    def rho1(self) -> dict[str, float]:
        return {row: c.rho for row, c in self.calibration.items()}

    def lookup(self) -> dict[tuple[int, Row], Measurement]:
        """``{(member, measure): measurement}``."""
        return {(m.member, m.measure): m for m in self.measurements}
