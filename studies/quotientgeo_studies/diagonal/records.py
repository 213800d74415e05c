"""What the diagonal study collects: per population its members, calibrations and values."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Member:
    """One trained network: its hyperparameters (``seed``: the batch-order seed's index),
    losses, the standard error of its test loss, and per row its value at every grid factor
    (``first_order``: for the second-order geodesic rows, the loss increase at the first-order
    move of the same maximiser; NaN where a measurement failed)."""

    alpha: float
    lr_factor: float
    batch_size: int
    seed: int
    steps: int
    train_loss: float
    test_loss: float
    test_se: float
    values: dict[str, list[float]]
    first_order: dict[str, list[float]]

    @property
    def gap(self) -> float:
        return self.test_loss - self.train_loss

    def hyperparameters(self, axes: tuple[str, ...]) -> dict[str, float | int]:
        """The member's grid coordinates ``axes`` and its seed (the granulated τ's groups)."""
        return {**{axis: getattr(self, axis) for axis in axes}, "seed": self.seed}


@dataclasses.dataclass(frozen=True)
class Calibrated:
    """A ball's ``ρ₁`` on the reference member, the value reached there, measurements used."""

    rho: float
    value: float
    evaluations: int


@dataclasses.dataclass(frozen=True)
class PopulationRecords:
    """One population: ``members`` (the networks that did not diverge, in population order),
    its grid ``axes`` (empty: random draws, no granulated τ), the reference member (an index
    into ``members``) and each ball's calibration there at loss increase ``target``."""

    name: str
    axes: tuple[str, ...]
    members: list[Member]
    n_models: int
    n_converged: int
    reference: int
    target: float
    calibration: dict[str, Calibrated]
    failures: list[str]
    seconds: dict[str, float]

    @property
    def rho1(self) -> dict[str, float]:
        return {row: c.rho for row, c in self.calibration.items()}


@dataclasses.dataclass(frozen=True)
class Records:
    """Everything :func:`~.collect.collect` gathered, population by population."""

    populations: dict[str, PopulationRecords]
    ranks: int
    started: float  # time.perf_counter() when collecting began
