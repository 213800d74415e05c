"""What decides the diagonal study: sizes, the two populations, the radius grid and the rows."""

from __future__ import annotations

import argparse
import dataclasses

from quotientgeo import Measure
from quotientgeo.sharpness import SharpnessMeasure

from .training import TrainingConfig

PAPER_TAU = {"adaptive": -0.68, "geodesic_inv": -0.83, "geodesic_mix": -0.86}
MAIN = ("adaptive", "geodesic_inv", "geodesic_mix")  # the paper's rows, in the figure
GEODESIC = ("geodesic_inv", "geodesic_mix")  # second order: their curvature share
#: every row, in print order
MEASURES = (
    *MAIN,
    "first_order_inv",
    "first_order_mix",
    "exact_inv",
    "exact_mix",
    "average",
)
POPULATIONS = ("init", "sgd")
GRID = tuple(10 ** (k / 2) for k in range(-2, 3))  # f = 0.1 … 10, half-decade steps
QUICK_GRID = (0.1, 1.0, 10.0)
HEADLINE_FACTOR = 1.0  # the radius of the headline τ, ρ = ρ₁
#: the row whose value calibrates a ball, where it is not the ball's own row: the second-order
#: (and first-order) mix values jump by orders of magnitude at some radius (the maps' remainder
#: blows up where ``u_i v_i ≈ 0``), so no radius reaches a target; the exact geodesic's value
#: grows smoothly (the mix ball is a Euclidean ball in ``β = u ⊙ v``)
CALIBRATED_BY = {"geodesic_mix": "exact_mix"}


@dataclasses.dataclass(frozen=True)
class Size:
    """How big the study is. ``data``: data and training (its ``n_models`` sizes the ``init``
    population); ``sgd_*``: the ``sgd`` population's grid at the one scale ``sgd_alpha``;
    ``target_fraction``: ρ₁'s loss increase as a fraction of the training labels' mean square."""

    data: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    n_iter: int = 100
    n_samples: int = 100
    grid: tuple[float, ...] = GRID
    target_fraction: float = 0.01
    sgd_alpha: float = 1.0
    sgd_lr: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5)
    sgd_batch: tuple[int, ...] = (1, 2, 5, 10, 25, 100)
    sgd_seeds: int = 2
    calibration_rtol: float = 0.05
    resamples: int = 2000

    @classmethod
    def quick(cls) -> Size:
        return cls(
            data=TrainingConfig.quick(),
            n_iter=5,
            n_samples=10,
            grid=QUICK_GRID,
            sgd_lr=(0.1, 0.5),
            sgd_batch=(1, 5, 20),
            sgd_seeds=1,
            calibration_rtol=0.3,
            resamples=200,
        )


def rows(size: Size, seed: int) -> tuple[dict[str, SharpnessMeasure], dict[str, str]]:
    """The rows in print order, ``(measures, ball)``: each row's measure (at the placeholder
    ``ρ = 1``; geodesic rows get the re-scaling pair of each model when measured) and the row
    whose calibrated ``ρ₁`` it uses. The first-order and exact rows keep the second-order row's
    ball; average sharpness is adaptive: Gaussian directions in the element-wise geometry,
    straight lines."""
    measures = {"adaptive": Measure.adaptive(1.0, n_iter=size.n_iter, seed=seed)}
    ball = {"adaptive": "adaptive"}
    for metric in ("inv", "mix"):
        second = Measure.geodesic(
            1.0, metric=metric, perturbation="second_order", n_iter=size.n_iter, seed=seed
        )
        own = f"geodesic_{metric}"
        measures[own], ball[own] = second, own
        for kind in ("first_order", "exact"):
            measures[f"{kind}_{metric}"] = second.replace(perturbation=kind)
            ball[f"{kind}_{metric}"] = own
    measures["average"] = Measure.average(
        1.0,
        symmetries=None,
        norm="adaptive",
        perturbation="first_order",
        n_samples=size.n_samples,
        seed=seed,
    )
    ball["average"] = "average"
    order = {row: i for i, row in enumerate(MEASURES)}
    return dict(sorted(measures.items(), key=lambda kv: order[kv[0]])), ball


@dataclasses.dataclass(frozen=True)
class Config:
    """The study's settings; ``measures`` and ``ball`` are :func:`rows`."""

    quick: bool
    seed: int
    size: Size
    populations: tuple[str, ...]
    measures: dict[str, SharpnessMeasure]
    ball: dict[str, str]
    progress: bool = True

    @property
    def calibrated(self) -> list[str]:
        """The rows with a ball of their own, in calibration order."""
        return [row for row, own in self.ball.items() if own == row]

    def measure(self, row: str, factor: float, rho1: dict[str, float]) -> SharpnessMeasure:
        """Row ``row`` at ``ρ = factor · ρ₁`` of its ball."""
        return self.measures[row].with_rho(factor * rho1[self.ball[row]])


def config(args: argparse.Namespace) -> Config:
    """The study's :class:`Config` from the command line (``--quick`` sizes, overrides)."""
    size = Size.quick() if args.quick else Size()
    if args.n_models is not None:
        size = dataclasses.replace(
            size, data=dataclasses.replace(size.data, n_models=args.n_models)
        )
    if args.n_iter is not None:
        size = dataclasses.replace(size, n_iter=args.n_iter)
    measures, ball = rows(size, args.seed)
    populations = POPULATIONS if args.population == "both" else (args.population,)
    return Config(
        quick=args.quick,
        seed=args.seed,
        size=size,
        populations=populations,
        measures=measures,
        ball=ball,
        progress=not args.no_progress,
    )
