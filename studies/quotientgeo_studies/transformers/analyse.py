"""Statistics of the transformers study, from its records only: the gap spread over test-set
noise, Kendall τ with the gap across ρ with bootstrap bands and p-values, median sharpness,
curvature share, the ablation table (τ, band, p-value) at the fixed radius (and the best one,
for the random population) and, on the grid population, the granulated τ and Ψ."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Sequence

from .. import _common as C
from .config import FIXED_FACTOR, GEODESIC, MEASURES, Config
from .records import Measurement, Records

Grid = dict[str, list[list[Measurement]]]  # studied measure -> [member][grid factor]


@dataclasses.dataclass(frozen=True)
class Analysis:
    """Everything the report prints and writes. Per-ρ series are indexed like the grid,
    per-model lists like the members; ``radii`` names the ablation radii (``fixed``,
    ``best``) by their factor."""

    records: Records
    gap: list[float]
    grid: Grid
    rho_grid: dict[str, list[float]]
    tau: dict[str, list[float]]
    p_value: dict[str, list[float]]
    band: dict[str, list[tuple[float, float]]]  # 90 % bootstrap interval of τ
    median: dict[str, list[float]]  # median sharpness over the members
    share: dict[str, list[float]]  # median curvature share (S₂ - S₁) / S₂ of GEODESIC
    radii: dict[str, float]
    rho: dict[str, dict[str, float]]  # radius -> row -> ρ (NaN: relative flatness)
    at: dict[str, dict[str, list[float]]]  # radius -> row -> value of every member
    kendall: dict[str, dict[str, tuple[float, float]]]  # radius -> row -> (τ, p-value)
    interval: dict[str, dict[str, tuple[float, float]]]  # radius -> row -> 90 % band of τ
    gap_spread_over_noise: float
    granulated: dict[str, dict[str, float]]  # row -> axis -> τ, and "psi"; at the fixed radius
    granulated_by_rho: dict[str, list[dict[str, float]]]  # measure -> grid factor -> as above
    failures: list[str]


def gap_spread_over_noise(metrics: Sequence[dict]) -> float:
    """Standard deviation of the members' gaps over the binomial standard error of one member's
    test error at the population's mean test error, ``sqrt(p̄(1 - p̄) / n_test)``."""
    gaps = [m["gap"] for m in metrics]
    p = statistics.mean(m["test_error"] for m in metrics)
    n_test = metrics[0]["n_test"]
    noise = math.sqrt(p * (1 - p) / n_test)
    return statistics.stdev(gaps) / noise if noise > 0 and len(gaps) > 1 else math.nan


def grid_keys(config: Config, records: Records) -> list[dict[str, float | int]]:
    """Every member's grid axes and seed, the groups of :func:`~.._common.granulated_tau`."""
    return [
        {**{a: getattr(m.recipe, a) for a in config.axes}, "seed": m.recipe.seed}
        for m in records.members
    ]


def median(values: Iterable[float]) -> float:
    """Median of the finite values (NaN if none)."""
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def grid_of(
    config: Config, rho1: dict[str, float], measurements: Sequence[Measurement], n: int
) -> Grid:
    """The τ(ρ) grid's measurements of the ``n`` members."""
    by = {(m.member, m.measure): m for m in measurements}
    factors = config.size.grid
    return {
        m: [[by[k, config.measure(m, f, rho1)] for f in factors] for k in range(n)]
        for m in MEASURES
    }


def column(grid: Grid, m: str, i: int) -> list[float]:
    """Values of measure ``m`` at grid factor ``i``, member by member."""
    return [member[i].value for member in grid[m]]


def grid_tau(
    config: Config, rho1: dict[str, float], gap: list[float], measurements: Sequence[Measurement]
) -> dict[str, list[float]]:
    """Kendall τ with the gap of every studied measure at every grid factor."""
    grid = grid_of(config, rho1, measurements, len(gap))
    n = len(config.size.grid)
    return {m: [C.kendall(column(grid, m, i), gap)[0] for i in range(n)] for m in MEASURES}


def best_factor(tau: dict[str, list[float]], grid: Sequence[float]) -> float:
    """The grid factor where geodesic sharpness predicts best: largest mean ``|τ|`` of inv/mix
    (the first such factor; undefined τ counts as -1)."""
    inv, mix = GEODESIC
    score = [(abs(tau[inv][i]) + abs(tau[mix][i])) / 2 for i in range(len(grid))]
    score = [v if math.isfinite(v) else -1.0 for v in score]  # τ undefined: constant values
    return grid[max(range(len(grid)), key=lambda i: (score[i], -i))]


def curvature_share(grid: Grid, m: str, i: int) -> float:
    """Median over members with a positive value of ``(S₂ - S₁) / S₂`` at grid factor ``i``."""
    cells = (member[i] for member in grid[m])
    return median((c.value - c.first_order_value) / c.value for c in cells if c.value > 0)


def radius(config: Config, row: str, factor: float, rho1: dict[str, float]) -> float:
    """``ρ = factor · ρ₁`` of ``row``'s ball; NaN for a row without one (relative flatness)."""
    ball = config.ball[row]
    return math.nan if ball is None else factor * rho1[ball]


def analyse(config: Config, records: Records) -> Analysis:
    """The study's statistics (module docstring)."""
    size, rho1 = config.size, records.rho1
    gap = [member.gap for member in records.members]
    grid = grid_of(config, rho1, records.measurements, len(gap))
    span = range(len(size.grid))
    tau = {m: [C.kendall(column(grid, m, i), gap)[0] for i in span] for m in MEASURES}
    band = {
        m: [
            C.kendall_interval(column(grid, m, i), gap, resamples=size.resamples, seed=config.seed)
            for i in span
        ]
        for m in MEASURES
    }
    radii = {"fixed": FIXED_FACTOR}
    if size.best_radius:
        radii["best"] = best_factor(tau, size.grid)
    by = records.lookup()
    at = {
        name: {
            row: [by[k, config.measure(row, f, rho1)].value for k in range(len(gap))]
            for row in config.measures
        }
        for name, f in radii.items()
    }
    keys, axes = grid_keys(config, records), config.axes

    def granulated(values: list[float]) -> dict[str, float]:
        return C.granulated_tau(values, gap, keys, axes) if axes else {}

    def interval(values: list[float]) -> tuple[float, float]:
        return C.kendall_interval(values, gap, resamples=size.resamples, seed=config.seed)

    return Analysis(
        records=records,
        gap=gap,
        grid=grid,
        rho_grid={m: [f * rho1[m] for f in size.grid] for m in MEASURES},
        tau=tau,
        p_value={m: [C.kendall(column(grid, m, i), gap)[1] for i in span] for m in MEASURES},
        band=band,
        median={m: [median(column(grid, m, i)) for i in span] for m in MEASURES},
        share={m: [curvature_share(grid, m, i) for i in span] for m in GEODESIC},
        radii=radii,
        rho={
            name: {row: radius(config, row, f, rho1) for row in config.measures}
            for name, f in radii.items()
        },
        at=at,
        kendall={name: {row: C.kendall(v, gap) for row, v in at[name].items()} for name in radii},
        interval={name: {row: interval(v) for row, v in at[name].items()} for name in radii},
        gap_spread_over_noise=gap_spread_over_noise([m.metrics for m in records.members]),
        granulated={row: granulated(v) for row, v in at["fixed"].items()} if axes else {},
        granulated_by_rho={m: [granulated(column(grid, m, i)) for i in span] for m in MEASURES}
        if axes
        else {},
        failures=[m.failure for m in records.measurements if m.failure],
    )
