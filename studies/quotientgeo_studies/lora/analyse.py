"""Statistics of the LoRA study, from its records only: test accuracy per arm and learning
rate, robustness to the learning rate against AdamW, and Kendall τ (with band, p-value,
granulated τ and Ψ) of every measure and scope with the generalization gap."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import cast

from .. import _common as C
from .config import MEASURES, REFERENCE_ARM, Config
from .model import SCOPES
from .records import Records

AXES = ("optimizer", "learning_rate")
"""The axes of the granulated τ; the replicate is part of every group, never an axis."""


@dataclasses.dataclass(frozen=True)
class Spread:
    """Mean and sample standard deviation (NaN for fewer than 2) of ``values``."""

    values: list[float]

    @property
    def mean(self) -> float:
        return statistics.mean(self.values) if self.values else math.nan

    @property
    def sd(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else math.nan


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Mean accuracy of arm ``arm`` minus AdamW's (at ``lr``, or each at its worst learning
    rate), the standard error ``√(s₁²/n₁ + s₂²/n₂)`` of that difference, whether it exceeds
    twice that error (``beats``, ``False`` where the error is undefined) and Welch's p."""

    arm: str
    lr: float | None
    difference: float
    standard_error: float
    beats: bool
    p_value: float


@dataclasses.dataclass(frozen=True)
class Robustness:
    """An arm's seed-mean accuracy over the learning-rate grid: worst and best (and where),
    their range and the mean over the grid."""

    worst: float
    worst_lr: float
    best: float
    best_lr: float
    range: float
    mean: float


@dataclasses.dataclass(frozen=True)
class Tau:
    """Kendall τ-b of a measure with the gap over the members, its p-value and 90 %
    bootstrap band, the granulated τ per axis and Ψ (key ``"psi"``), and ``reason`` where τ
    is undefined (NaN)."""

    tau: float
    p_value: float
    band: tuple[float, float]
    granulated: dict[str, float]
    reason: str | None


@dataclasses.dataclass(frozen=True)
class Analysis:
    """Everything the report prints and writes; per-learning-rate lists follow the grid."""

    records: Records
    accuracy: dict[str, list[Spread]]  # arm -> per learning rate
    robustness: dict[str, Robustness]
    per_lr: dict[str, list[Comparison]]  # arm (not adamw) -> against AdamW per learning rate
    worst: dict[str, Comparison]  # arm (not adamw) -> worst against AdamW's worst
    gap: list[float]
    values: dict[tuple[str, str], list[float]]  # (scope, measure) -> per member
    tau: dict[tuple[str, str], Tau]
    failures: list[str]


def welch_p(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p-value of Welch's t-test of the means of ``a`` and ``b``."""
    from scipy import stats

    return float(cast("tuple[float, float]", stats.ttest_ind(a, b, equal_var=False))[1])


def compare(arm: str, lr: float | None, a: Spread, b: Spread) -> Comparison:
    """``a`` (of ``arm``) against ``b`` (AdamW's)."""
    se = math.sqrt(a.sd**2 / len(a.values) + b.sd**2 / len(b.values))
    difference = a.mean - b.mean
    beats = math.isfinite(se) and difference > 2 * se
    p = welch_p(a.values, b.values) if math.isfinite(se) and se > 0 else math.nan
    return Comparison(arm, lr, difference, se, beats, p)


def robustness(spreads: Sequence[Spread], grid: Sequence[float]) -> Robustness:
    means = [s.mean for s in spreads]
    lo = min(range(len(means)), key=lambda i: means[i])
    hi = max(range(len(means)), key=lambda i: means[i])
    return Robustness(
        means[lo], grid[lo], means[hi], grid[hi], means[hi] - means[lo], statistics.mean(means)
    )


def undefined(values: Sequence[float], gaps: Sequence[float]) -> str | None:
    """Why Kendall τ of ``values`` and ``gaps`` is undefined, or ``None`` if it is not."""
    x, y = C.finite_pairs(values, gaps)
    if len(x) < 2:
        return f"{len(x)} member(s) with a finite value"
    if len(set(x.tolist())) < 2:
        return "the measure has one value over the members"
    if len(set(y.tolist())) < 2:
        return "the gap has one value over the members"
    return None


def tau(config: Config, values: list[float], gap: list[float], keys: list[dict]) -> Tau:
    reason = undefined(values, gap)
    granulated = C.granulated_tau(values, gap, keys, AXES)
    if reason is not None:
        return Tau(math.nan, math.nan, (math.nan, math.nan), granulated, reason)
    t, p = C.kendall(values, gap)
    band = C.kendall_interval(values, gap, resamples=config.size.resamples, seed=config.seed)
    return Tau(t, p, band, granulated, None)


def analyse(config: Config, records: Records) -> Analysis:
    """The study's statistics (module docstring)."""
    grid, members = config.size.learning_rates, records.members
    accuracy = {
        arm: [
            Spread(
                [
                    m.metrics["test_accuracy"]
                    for m in members
                    if m.recipe.arm == arm and m.recipe.lr == lr
                ]
            )
            for lr in grid
        ]
        for arm in config.arms
    }
    reference = accuracy[REFERENCE_ARM]
    others = [arm for arm in config.arms if arm != REFERENCE_ARM]
    robust = {arm: robustness(accuracy[arm], grid) for arm in config.arms}

    def at_worst(arm: str) -> Spread:
        return accuracy[arm][grid.index(robust[arm].worst_lr)]

    gap = [m.gap for m in members]
    keys = [m.recipe.axes() for m in members]
    values = {(s, name): records.values(s, name) for s in SCOPES for name in MEASURES}
    return Analysis(
        records=records,
        accuracy=accuracy,
        robustness=robust,
        per_lr={
            arm: [
                compare(arm, lr, a, b)
                for lr, a, b in zip(grid, accuracy[arm], reference, strict=True)
            ]
            for arm in others
        },
        worst={arm: compare(arm, None, at_worst(arm), at_worst(REFERENCE_ARM)) for arm in others},
        gap=gap,
        values=values,
        tau={ball: tau(config, v, gap, keys) for ball, v in values.items()},
        failures=[m.failure for m in records.measurements if m.failure],
    )
