"""Statistics of the diagonal study, from its records only: per population the gap spread over
the test noise, Kendall τ with the gap at every radius with bootstrap bands and p-values, the
granulated τ (grid populations), median sharpness and the curvature share."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable

from .. import _common as C
from .config import GEODESIC, HEADLINE_FACTOR, Config
from .records import PopulationRecords, Records


@dataclasses.dataclass(frozen=True)
class PopulationAnalysis:
    """One population's statistics; per-ρ series are indexed like the grid. ``noise``: the
    mean over members of the standard error of a test loss; ``granulated``: per row and grid
    factor, the granulated τ per axis and ``"psi"`` (``None`` for random draws)."""

    records: PopulationRecords
    gap: list[float]
    gap_std: float
    noise: float
    rho_grid: dict[str, list[float]]
    tau: dict[str, list[float]]
    p_value: dict[str, list[float]]
    band: dict[str, list[tuple[float, float]]]  # 90 % bootstrap interval of τ
    median: dict[str, list[float]]  # median sharpness over the members
    share: dict[str, list[float]]  # median curvature share (S₂ - S₁) / S₂ of GEODESIC
    granulated: dict[str, list[dict[str, float]]] | None
    headline: int  # grid index of HEADLINE_FACTOR

    @property
    def gap_spread_over_noise(self) -> float:
        return self.gap_std / self.noise


@dataclasses.dataclass(frozen=True)
class Analysis:
    records: Records
    populations: dict[str, PopulationAnalysis]


def median(values: Iterable[float]) -> float:
    """Median of the finite values (NaN if none)."""
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def curvature_share(records: PopulationRecords, row: str, i: int) -> float:
    """Median over members with a positive value of ``(S₂ - S₁) / S₂`` at grid factor ``i``."""
    pairs = ((m.values[row][i], m.first_order[row][i]) for m in records.members)
    return median((s2 - s1) / s2 for s2, s1 in pairs if s2 > 0)


def analyse_population(config: Config, records: PopulationRecords) -> PopulationAnalysis:
    """The statistics of one population (module docstring)."""
    size, members = config.size, records.members
    gap = [m.gap for m in members]
    span = range(len(size.grid))

    def column(row: str, i: int) -> list[float]:
        return [m.values[row][i] for m in members]

    kendall = {row: [C.kendall(column(row, i), gap) for i in span] for row in config.measures}
    band = {
        row: [
            C.kendall_interval(column(row, i), gap, resamples=size.resamples, seed=config.seed)
            for i in span
        ]
        for row in config.measures
    }
    granulated = None
    if records.axes:
        groups = [m.hyperparameters(records.axes) for m in members]
        granulated = {
            row: [C.granulated_tau(column(row, i), gap, groups, records.axes) for i in span]
            for row in config.measures
        }
    rho1 = records.rho1
    return PopulationAnalysis(
        records=records,
        gap=gap,
        gap_std=statistics.stdev(gap),
        noise=statistics.fmean(m.test_se for m in members),
        rho_grid={row: [f * rho1[config.ball[row]] for f in size.grid] for row in config.measures},
        tau={row: [t for t, _ in kendall[row]] for row in config.measures},
        p_value={row: [p for _, p in kendall[row]] for row in config.measures},
        band=band,
        median={row: [median(column(row, i)) for i in span] for row in config.measures},
        share={row: [curvature_share(records, row, i) for i in span] for row in GEODESIC},
        granulated=granulated,
        headline=size.grid.index(HEADLINE_FACTOR),
    )


def analyse(config: Config, records: Records) -> Analysis:
    """Every population's statistics."""
    return Analysis(
        records,
        {name: analyse_population(config, r) for name, r in records.populations.items()},
    )
