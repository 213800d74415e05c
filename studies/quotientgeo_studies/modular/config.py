"""What decides the modular study: sizes, the population grid, the radii grid and the measure of
every table row."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from quotientgeo import Measure

from . import task as M

GRID = (0.1, 10**-0.5, 1.0, 10**0.5)  # f: half-decades around the calibrated radius
FIXED_FACTOR = 1.0
SWEPT = ("adaptive", "geodesic_inv", "geodesic_mix")  # the τ(ρ) rows
GEODESIC = ("geodesic_inv", "geodesic_mix")  # their curvature share
AXES = ("fraction", "weight_decay")


@dataclasses.dataclass(frozen=True)
class Size:
    """How big the study is."""

    p: int = 23
    fractions: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7)
    weight_decays: tuple[float, ...] = (0.0, 1.0, 3.0)
    seeds: int = 2
    steps: int = 2000
    lr: float = 3e-3
    width: int = 32
    n_iter: int = 20
    n_samples: int = 20
    n_batches: int = 2
    batch: int = 64
    grid: tuple[float, ...] = GRID
    calibration_rtol: float = 0.1
    calibration_evals: int = 16
    resamples: int = 2000
    measure_dtype: str = "float64"  # weight decay drives attention factors to near rank loss

    @classmethod
    def quick(cls) -> Size:
        return cls(
            p=17,
            fractions=(0.4, 0.8),
            weight_decays=(0.0, 1.0),
            seeds=1,
            steps=150,
            width=16,
            n_iter=2,
            n_samples=4,
            n_batches=1,
            batch=64,
            grid=(0.32, 1.0),
            calibration_rtol=0.5,
            calibration_evals=8,
            resamples=200,
        )

    def recipes(self, seed: int) -> list[M.Recipe]:
        """The population in grid order: fraction, then weight decay, then seed."""
        return [
            M.Recipe(f, wd, self.steps, seed * 1000 + s, width=self.width, lr=self.lr)
            for f in self.fractions
            for wd in self.weight_decays
            for s in range(self.seeds)
        ]


def rows(size: Size, seed: int) -> tuple[dict[str, Any], dict[str, str | None]]:
    """The table rows in print order, ``(measures, ball)``: each row's measure (at the
    placeholder ``ρ = 1``) and the row whose calibrated ``ρ₁`` it uses (itself for a ball of
    its own, ``None`` for relative flatness, which has no radius)."""
    n_iter = size.n_iter
    measures: dict[str, Any] = {"adaptive": Measure.adaptive(1.0, n_iter=n_iter, seed=seed)}
    ball: dict[str, str | None] = {"adaptive": "adaptive"}
    for metric in ("inv", "mix"):
        second = Measure.geodesic(
            1.0, metric=metric, perturbation="second_order", n_iter=n_iter, seed=seed
        )
        own = f"geodesic_{metric}"
        measures[own], ball[own] = second, own
        for kind in ("first_order", "exact"):
            row = f"{kind}_{metric}"
            measures[row], ball[row] = second.replace(perturbation=kind), own
    measures["average"] = Measure.average(
        1.0, metric="inv", perturbation="second_order", n_samples=size.n_samples, seed=seed
    )
    ball["average"] = "average"
    measures["relative_flatness"], ball["relative_flatness"] = (
        Measure.relative_flatness("head"),
        None,
    )
    return measures, ball


@dataclasses.dataclass(frozen=True)
class Config:
    quick: bool
    seed: int
    target: float
    size: Size
    measures: dict[str, Any]
    ball: dict[str, str | None]
    gaps_only: bool = False
    threads: int = 1
    progress: bool = True

    @property
    def task(self) -> M.Task:
        return M.Task(self.size.p, self.seed)

    @property
    def calibrated(self) -> list[str]:
        return [row for row, own in self.ball.items() if own == row]

    def measure(self, row: str, factor: float, rho1: dict[str, float]):
        """Row ``row`` at ``ρ = factor · ρ₁`` of its ball (as is without a ball)."""
        own = self.ball[row]
        return (
            self.measures[row] if own is None else self.measures[row].with_rho(factor * rho1[own])
        )

    def plan(self) -> list[tuple[str, float]]:
        """``(row, factor)`` of every measurement of a member: the τ(ρ) grid, then the other
        rows at ``f = 1``."""
        grid = [(row, f) for row in SWEPT for f in self.size.grid]
        return grid + [(row, FIXED_FACTOR) for row in self.measures if row not in SWEPT]


def config(args: argparse.Namespace) -> Config:
    size = Size.quick() if args.quick else Size()
    if args.n_iter:
        size = dataclasses.replace(size, n_iter=args.n_iter)
    measures, ball = rows(size, args.seed)
    return Config(
        quick=args.quick,
        seed=args.seed,
        target=args.target,
        size=size,
        measures=measures,
        ball=ball,
        gaps_only=args.gaps_only,
        threads=args.threads,
        progress=not args.no_progress,
    )


def batches(config: Config) -> list:
    """The fixed measurement batches: the task order's first ``n_batches · batch`` pairs."""
    x, y = M.pairs(config.task)
    b = config.size.batch
    return [(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b]) for i in range(config.size.n_batches)]
