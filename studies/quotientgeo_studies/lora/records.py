"""What the LoRA study collects: members, calibrations and one record per measurement."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One member: optimizer ``arm`` at learning rate ``lr``, replicate ``replicate`` whose
    seed ``seed`` fixes the initialisation of the head and the adapters, the batch order and
    the noisy labels."""

    arm: str
    lr: float
    replicate: int
    seed: int

    def axes(self) -> dict[str, Any]:
        """The member's keys for the granulated τ: its two axes and its replicate."""
        return {"optimizer": self.arm, "learning_rate": self.lr, "replicate": self.replicate}


@dataclasses.dataclass(frozen=True)
class Member:
    """A fine-tuned member: its recipe and ``metrics`` (``train_error`` on its own noisy
    labels, ``test_error``, ``test_accuracy``, ``gap = test_error - train_error``,
    ``clean_train_error``, ``n_train``, ``n_test``, ``seconds`` of training, ``diverged``,
    ``cached``: whether it came from the cache)."""

    recipe: Recipe
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
    """Member ``member``'s ``measure`` in ``scope`` at radius ``rho``; a measurement that was
    not made or raised has a NaN value, left out of τ, and a ``failure``."""

    member: int
    scope: str
    measure: str
    rho: float
    value: float
    failure: str | None = None

    @classmethod
    def failed(cls, member: int, scope: str, measure: str, rho: float, reason: str):
        return cls(member, scope, measure, rho, math.nan, reason)


@dataclasses.dataclass(frozen=True)
class Records:
    """Everything :func:`~.collect.collect` made: the members in population order, the
    pretrained model's metrics, the reference member's index, the calibrated balls
    ``{(scope, measure): Calibrated}``, what ``find_symmetries`` maps in each scope (on the
    reference member), every measurement, the number of ranks, the wall time of each phase
    and ``time.perf_counter()`` when collecting began."""

    members: list[Member]
    pretrained: dict[str, float]
    reference: int
    calibration: dict[tuple[str, str], Calibrated]
    geometry: dict[str, dict[str, Any]]
    measurements: list[Measurement]
    ranks: int
    seconds: dict[str, float]
    started: float

    def values(self, scope: str, measure: str) -> list[float]:
        """``measure`` in ``scope`` of every member, in population order."""
        by = {
            m.member: m.value for m in self.measurements if (m.scope, m.measure) == (scope, measure)
        }
        return [by.get(k, math.nan) for k in range(len(self.members))]
