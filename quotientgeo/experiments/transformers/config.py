"""What decides the transformers study: sizes, radii grid and the measures of every table row."""

from __future__ import annotations

import argparse
import dataclasses

from quotientgeo import Measure

GRID = tuple(10 ** (k / 2) for k in range(-4, 3))  # f = 0.01 … 10, half-decade steps
QUICK_GRID = (0.1, 1.0, 10.0)
FIXED_FACTOR = 1.0
MEASURES = ("adaptive", "geodesic_inv", "geodesic_mix")  # the τ(ρ) study
GEODESIC = ("geodesic_inv", "geodesic_mix")  # their curvature share; they pick the best radius
SPECTRUM = (0.25, 0.5, 0.75)
PAPER = {  # Table 1 of the paper: Kendall τ with the generalization gap
    "ImageNet (CLIP ViT-B/32, 72 models)": {
        "adaptive": -0.41,
        "geodesic_inv": -0.71,
        "geodesic_mix": -0.70,
    },
    "MNLI (BERT, 35 models)": {"adaptive": 0.06, "geodesic_inv": 0.28, "geodesic_mix": 0.38},
}


@dataclasses.dataclass(frozen=True)
class Size:
    """How big the study is."""

    n_models: int = 40
    n_iter: int = 20
    n_batches: int = 2
    batch: int = 128
    grid: tuple[float, ...] = GRID
    pretrain_epochs: int = 40
    width: int = 32
    calibration_rtol: float = 0.05
    calibration_evals: int = 24
    resamples: int = 2000

    @classmethod
    def quick(cls) -> Size:
        return cls(
            n_models=6,
            n_iter=2,
            n_batches=1,
            batch=64,
            grid=QUICK_GRID,
            pretrain_epochs=3,
            width=16,
            calibration_rtol=0.3,
            resamples=200,
        )


def rows(n_iter: int, seed: int) -> tuple[dict[str, Measure], dict[str, str]]:
    """The ablation rows in print order, ``(measures, ball)``: each row's measure (at the
    placeholder ``ρ = 1``) and the row whose calibrated ``ρ₁`` it uses (itself for a ball of
    its own). ``no_symmetry`` (``symmetries=None``) is adaptive sharpness exactly, the same
    measure; the perturbation rows keep the second-order row's ball."""
    adaptive = Measure.adaptive(1.0, n_iter=n_iter, seed=seed)
    measures = {"adaptive": adaptive, "no_symmetry": adaptive}
    ball = {"adaptive": "adaptive", "no_symmetry": "adaptive"}
    geodesic = {
        metric: Measure.geodesic(
            1.0, metric=metric, perturbation="second_order", n_iter=n_iter, seed=seed
        )
        for metric in ("inv", "mix")
    }
    for metric, second in geodesic.items():
        own = f"geodesic_{metric}"
        measures[own], ball[own] = second, own
        for kind in ("first_order", "exact"):
            measures[f"{kind}_{metric}"], ball[f"{kind}_{metric}"] = (
                second.replace(perturbation=kind),
                own,
            )
        norm = f"norm_adaptive_{metric}"
        measures[norm], ball[norm] = second.replace(norm="adaptive"), norm
    for s in SPECTRUM:  # s = 0 and 1 are the inv and mix rows
        name = f"spectrum_s{s:g}"
        measures[name], ball[name] = geodesic["inv"].replace(metric=s), name
    return measures, ball


@dataclasses.dataclass(frozen=True)
class Config:
    """The study's settings; ``measures`` and ``ball`` are :func:`rows`."""

    quick: bool
    seed: int
    target: float  # loss increase (nats) that calibrates ρ₁ of every ball on member 0
    size: Size
    measures: dict[str, Measure]
    ball: dict[str, str]
    threads: int = 1
    progress: bool = True

    @property
    def calibrated(self) -> list[str]:
        """The rows with a ball of their own, in calibration order."""
        return [row for row, own in self.ball.items() if own == row]

    def measure(self, row: str, factor: float, rho1: dict[str, float]) -> Measure:
        """Row ``row`` at ``ρ = factor · ρ₁`` of its ball."""
        return self.measures[row].with_rho(factor * rho1[self.ball[row]])


def config(args: argparse.Namespace) -> Config:
    """The study's :class:`Config` from the command line (``--quick`` sizes, overrides)."""
    size = Size.quick() if args.quick else Size()
    size = dataclasses.replace(
        size, n_models=args.n_models or size.n_models, n_iter=args.n_iter or size.n_iter
    )
    measures, ball = rows(size.n_iter, args.seed)
    return Config(
        quick=args.quick,
        seed=args.seed,
        target=args.target,
        size=size,
        measures=measures,
        ball=ball,
        threads=args.threads,
        progress=not args.no_progress,
    )
