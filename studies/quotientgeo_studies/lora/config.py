"""What decides the LoRA study: the population, the fine-tuning, the sizes and the measures."""

from __future__ import annotations

import argparse
import dataclasses

from quotientgeo import Measure

from .model import Adapters
from .records import Recipe
from .training import ARMS, ArmSettings

LEARNING_RATES = tuple(10 ** (k / 2) for k in range(-7, -2))  # 10^-3.5 … 10^-1.5
REFERENCE_LR = LEARNING_RATES[2]  # 10^-2.5, the grid's centre: the calibration's member
QUICK_LEARNING_RATES = (LEARNING_RATES[2], LEARNING_RATES[4])
MEASURES = ("adaptive", "geodesic_mix", "average")
REFERENCE_ARM = "adamw"


@dataclasses.dataclass(frozen=True)
class Training:
    """How every member is fine-tuned: label noise ``noise`` on a pool of ``pool`` images
    (the rest of the digits 5–9 test), ``steps`` steps of ``batch_size``, the adapters and the
    arms' settings."""

    noise: float = 0.3
    steps: int = 600
    batch_size: int = 32
    pool: int = 384
    adapters: Adapters = dataclasses.field(default_factory=Adapters)
    arms: ArmSettings = dataclasses.field(default_factory=ArmSettings)


@dataclasses.dataclass(frozen=True)
class Size:
    """How big the study is: replicates and learning rates of the population, the pretrained
    model, the measures' work and data, the calibration and the bootstrap."""

    replicates: int = 3
    learning_rates: tuple[float, ...] = LEARNING_RATES
    pretrain_epochs: int = 40
    width: int = 32
    n_iter: int = 20
    n_batches: int = 2
    batch: int = 64
    average_samples: int = 100
    calibration_rtol: float = 0.05
    calibration_evals: int = 24
    resamples: int = 2000
    measure_dtype: str = "float64"

    @classmethod
    def quick(cls) -> Size:
        return cls(
            replicates=1,
            learning_rates=QUICK_LEARNING_RATES,
            pretrain_epochs=3,
            width=16,
            n_iter=2,
            n_batches=1,
            average_samples=4,
            calibration_rtol=0.3,
            resamples=200,
        )


@dataclasses.dataclass(frozen=True)
class Config:
    """The study's settings; ``measures`` are the three measures at the placeholder
    ``ρ = 1`` (:func:`measures`), ``arms`` the optimizers run (all of :data:`ARMS` by
    default)."""

    quick: bool
    seed: int
    target: float  # loss increase (nats) that calibrates every ball on the reference member
    arms: tuple[str, ...]
    training: Training
    size: Size
    measures: dict[str, Measure]
    threads: int = 1
    progress: bool = True

    def recipes(self) -> list[Recipe]:
        """The population: replicate, then learning rate, then arm; replicate ``r`` has the
        seed ``1000·seed + r`` in every cell."""
        return [
            Recipe(arm, lr, r, 1000 * self.seed + r)
            for r in range(self.size.replicates)
            for lr in self.size.learning_rates
            for arm in self.arms
        ]

    @property
    def reference(self) -> int:
        """The index of the reference member: ``adamw`` at the grid's centre, replicate 0."""
        wanted = Recipe(REFERENCE_ARM, REFERENCE_LR, 0, 1000 * self.seed)
        return self.recipes().index(wanted)


def measures(size: Size, seed: int) -> dict[str, Measure]:
    """The three measures (at ``ρ = 1``; each gets its calibrated radius): adaptive sharpness,
    geodesic sharpness with the mix metric and the second-order map (worst cases by Auto-PGD)
    and average sharpness (Gaussian directions in the element-wise adaptive geometry,
    straight lines)."""
    return {
        "adaptive": Measure.adaptive(1.0, n_iter=size.n_iter, seed=seed),
        "geodesic_mix": Measure.geodesic(
            1.0, metric="mix", perturbation="second_order", n_iter=size.n_iter, seed=seed
        ),
        "average": Measure.average(
            1.0,
            perturbation="first_order",
            norm="adaptive",
            symmetries=None,
            n_samples=size.average_samples,
            seed=seed,
        ),
    }


def parse_arms(text: str | None) -> tuple[str, ...]:
    """``--optimizers``: comma-separated arms, in :data:`ARMS` order (default: all);
    ``adamw`` must be one (the reference member is)."""
    if text is None:
        return ARMS
    chosen = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in chosen if a not in ARMS]
    if unknown:
        raise ValueError(f"unknown optimizer {unknown[0]!r}; choose among {', '.join(ARMS)}")
    if REFERENCE_ARM not in chosen:
        raise ValueError(f"--optimizers must include {REFERENCE_ARM!r}: radii are calibrated on it")
    return tuple(a for a in ARMS if a in chosen)


def config(args: argparse.Namespace) -> Config:
    """The study's :class:`Config` from the command line (``--quick`` sizes, overrides)."""
    size = Size.quick() if args.quick else Size()
    training = Training(steps=30) if args.quick else Training()
    if getattr(args, "seeds", None):
        size = dataclasses.replace(size, replicates=args.seeds)
    if getattr(args, "n_iter", None):
        size = dataclasses.replace(size, n_iter=args.n_iter)
    return Config(
        quick=args.quick,
        seed=args.seed,
        target=args.target,
        arms=parse_arms(getattr(args, "optimizers", None)),
        training=training,
        size=size,
        measures=measures(size, args.seed),
        threads=args.threads,
        progress=not args.no_progress,
    )
