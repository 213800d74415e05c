"""What decides the transformers study: the population, sizes, radii grid and the measures of
every table row."""

from __future__ import annotations

import argparse
import dataclasses

from quotientgeo import Measure

from .. import _finetune
from .records import Row

POPULATIONS = ("grid", "random")  # the first is the default
GRID = tuple(10 ** (k / 2) for k in range(-4, 3))  # f = 0.01 … 10, half-decade steps
GRID5 = tuple(10 ** (k / 2) for k in range(-2, 3))  # f = 0.1 … 10
QUICK_GRID = (0.1, 1.0, 10.0)
FIXED_FACTOR = 1.0
MEASURES = ("adaptive", "geodesic_inv", "geodesic_mix")  # the τ(ρ) study
GEODESIC = ("geodesic_inv", "geodesic_mix")  # their curvature share; they pick the best radius
SPECTRUM = (0.25, 0.5, 0.75)
FEATURE_LAYER = "head"  # the nn.Linear whose weight relative flatness is taken of
PAPER = {  # Table 1 of the paper: Kendall τ with the generalization gap
    "ImageNet (CLIP ViT-B/32, 72 models)": {
        "adaptive": -0.41,
        "geodesic_inv": -0.71,
        "geodesic_mix": -0.70,
    },
    "MNLI (BERT, 35 models)": {"adaptive": 0.06, "geodesic_inv": 0.28, "geodesic_mix": 0.38},
}


@dataclasses.dataclass(frozen=True)
class GridRecipe:
    """The grid population (:func:`~.._finetune.grid_population`): label noise × fraction of
    the pool × replicate seeds, every other setting fixed; ``pool`` images of the digits 5–9
    train, the rest test."""

    noise: tuple[float, ...] = (0.0, 0.15, 0.3, 0.45)
    sizes: tuple[float, ...] = (1.0, 2 / 3, 1 / 3)
    seeds: int = 3
    steps: int = 600
    lr: float = 3e-3
    weight_decay: float = 0.0
    batch_size: int = 32
    pool: int = 384

    @property
    def n_models(self) -> int:
        return len(self.noise) * len(self.sizes) * self.seeds

    def recipes(self, seed: int) -> list[_finetune.FineTuning]:
        return _finetune.grid_population(
            seed,
            self.noise,
            self.sizes,
            self.seeds,
            steps=self.steps,
            lr=self.lr,
            weight_decay=self.weight_decay,
            batch_size=self.batch_size,
            pool=self.pool,
        )


@dataclasses.dataclass(frozen=True)
class Size:
    """How big the study is; the defaults are the random population's (the first design)."""

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
    spectrum: tuple[float, ...] = SPECTRUM
    best_radius: bool = True  # ablations also at the grid point where geodesic τ is largest
    average_samples: int = 100  # draws of average sharpness per batch

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
            average_samples=4,
        )

    @classmethod
    def grid_population(cls, recipe: GridRecipe) -> Size:
        """The grid population's default run, trimmed to about 25 minutes on two cores: five
        grid points, 12 Auto-PGD iterations, one spectrum point, ablations at ``f = 1`` only;
        the measurement points are the smallest training subset (``pool/3 = 128``)."""
        return cls(
            n_models=recipe.n_models,
            n_iter=12,
            n_batches=2,
            batch=64,
            grid=GRID5,
            spectrum=(0.5,),
            best_radius=False,
        )

    @classmethod
    def grid_quick(cls, recipe: GridRecipe) -> Size:
        return dataclasses.replace(
            cls.quick(), n_models=recipe.n_models, spectrum=(0.5,), best_radius=False
        )


QUICK_GRID_RECIPE = GridRecipe(noise=(0.0, 0.2, 0.4), sizes=(1.0, 0.5), seeds=1, steps=30)


def rows(
    n_iter: int,
    seed: int,
    spectrum: tuple[float, ...] = SPECTRUM,
    average_samples: int = 100,
) -> tuple[dict[str, Row], dict[str, str | None]]:
    """The ablation rows in print order, ``(measures, ball)``: each row's measure (at the
    placeholder ``ρ = 1``) and the row whose calibrated ``ρ₁`` it uses (itself for a ball of
    its own, ``None`` for relative flatness, which has no radius). ``no_symmetry``
    (``symmetries=None``) is adaptive sharpness exactly, the same measure; the perturbation
    rows keep the second-order row's ball; ``average`` is average-case adaptive sharpness
    (Gaussian directions in the adaptive geometry, straight lines) on a ball of its own."""
    adaptive = Measure.adaptive(1.0, n_iter=n_iter, seed=seed)
    measures: dict[str, Row] = {"adaptive": adaptive, "no_symmetry": adaptive}
    ball: dict[str, str | None] = {"adaptive": "adaptive", "no_symmetry": "adaptive"}
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
    for s in spectrum:  # s = 0 and 1 are the inv and mix rows
        name = f"spectrum_s{s:g}"
        measures[name], ball[name] = geodesic["inv"].replace(metric=s), name
    measures["average"] = Measure.average(
        1.0,
        perturbation="first_order",
        norm="adaptive",
        symmetries=None,
        n_samples=average_samples,
        seed=seed,
    )
    ball["average"] = "average"
    measures["relative_flatness"] = Measure.relative_flatness(FEATURE_LAYER)
    ball["relative_flatness"] = None
    return measures, ball


@dataclasses.dataclass(frozen=True)
class Config:
    """The study's settings; ``measures`` and ``ball`` are :func:`rows`; ``recipe`` is the
    grid population's (``None`` for the random one)."""

    quick: bool
    seed: int
    target: float  # loss increase (nats) that calibrates ρ₁ of every ball on member 0
    size: Size
    measures: dict[str, Row]
    ball: dict[str, str | None]
    population: str = "random"
    recipe: GridRecipe | None = None
    threads: int = 1
    progress: bool = True

    @property
    def axes(self) -> tuple[str, ...]:
        """The grid's hyper-parameter axes (recipe fields), for the granulated τ."""
        return ("label_noise", "subset") if self.recipe is not None else ()

    @property
    def pool(self) -> int | None:
        """Training pool size (``None``: half the digits 5–9)."""
        return None if self.recipe is None else self.recipe.pool

    def recipes(self) -> list[_finetune.FineTuning]:
        """The population's fine-tuning recipes."""
        if self.recipe is not None:
            return self.recipe.recipes(self.seed)
        return _finetune.population(self.size.n_models, self.seed, quick=self.quick)

    @property
    def calibrated(self) -> list[str]:
        """The rows with a ball of their own, in calibration order."""
        return [row for row, own in self.ball.items() if own == row]

    def measure(self, row: str, factor: float, rho1: dict[str, float]) -> Row:
        """Row ``row`` at ``ρ = factor · ρ₁`` of its ball (relative flatness: itself)."""
        ball = self.ball[row]
        return (
            self.measures[row] if ball is None else self.measures[row].with_rho(factor * rho1[ball])
        )


def config(args: argparse.Namespace) -> Config:
    """The study's :class:`Config` from the command line (``--population``, ``--quick`` sizes,
    overrides)."""
    population = getattr(args, "population", "random")
    recipe = None
    if population == "grid":
        recipe = QUICK_GRID_RECIPE if args.quick else GridRecipe()
        if getattr(args, "seeds", None):
            recipe = dataclasses.replace(recipe, seeds=args.seeds)
        size = Size.grid_quick(recipe) if args.quick else Size.grid_population(recipe)
        if args.n_models:
            raise ValueError("--n-models is for --population random; the grid's is --seeds")
    else:
        size = Size.quick() if args.quick else Size()
        size = dataclasses.replace(size, n_models=args.n_models or size.n_models)
    size = dataclasses.replace(size, n_iter=args.n_iter or size.n_iter)
    measures, ball = rows(size.n_iter, args.seed, size.spectrum, size.average_samples)
    return Config(
        quick=args.quick,
        seed=args.seed,
        target=args.target,
        size=size,
        measures=measures,
        ball=ball,
        population=population,
        recipe=recipe,
        threads=args.threads,
        progress=not args.no_progress,
    )
