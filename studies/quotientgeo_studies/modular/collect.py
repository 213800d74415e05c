"""The expensive part of the modular study: train (or load) the population and print its gaps,
calibrate every ball on member 0, measure every member."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .. import _common as C
from .. import _curvature
from . import task as M
from .config import AXES, Config, batches


@dataclasses.dataclass(frozen=True)
class Value:
    """One measurement: the value, its first-order companion (NaN where there is none) and the
    error message of a measurement that raised (then both are NaN)."""

    value: float
    first_order: float = math.nan
    failure: str | None = None


@dataclasses.dataclass(frozen=True)
class Records:
    recipes: list[M.Recipe]
    metrics: list[dict[str, Any]]
    rho1: dict[str, float]
    calibration: dict[str, dict[str, Any]]
    values: list[dict[tuple[str, float], Value]]  # member -> (row, factor) -> value
    seconds: dict[str, float]
    started: float
    ranks: int


def gap_spread(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Standard deviation of the gaps (n - 1), the binomial standard error
    ``sqrt(e(1-e)/n)`` at the mean test error ``e`` and the smallest test set ``n``, their
    ratio ``gap_spread_over_noise``."""
    gaps = [m["gap"] for m in metrics]
    e = statistics.fmean(m["test_error"] for m in metrics)
    n = min(m["n_test"] for m in metrics)
    noise = math.sqrt(max(e * (1 - e), 1e-12) / n)
    spread = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
    return {
        "gap_std": spread,
        "mean_test_error": e,
        "n_test_min": n,
        "binomial_se": noise,
        "gap_spread_over_noise": spread / noise,
    }


def print_gaps(config: Config, recipes: list[M.Recipe], metrics: list[dict]) -> None:
    """The population's errors per cell and the spread of its gaps."""
    C.print_table(
        f"Modular addition mod {config.size.p}: {len(recipes)} members "
        f"({config.size.steps} full-batch AdamW steps)",
        ["fraction", "weight decay", "seed", "train err", "test err", "gap", "train loss"],
        [
            [
                r.fraction,
                r.weight_decay,
                r.seed,
                m["train_error"],
                m["test_error"],
                m["gap"],
                m["train_loss"],
            ]
            for r, m in zip(recipes, metrics, strict=True)
        ],
    )
    s = gap_spread(metrics)
    print(
        f"gap std {s['gap_std']:.4f}; binomial SE at mean test error {s['mean_test_error']:.3f} "
        f"and n_test = {s['n_test_min']}: {s['binomial_se']:.4f}; "
        f"gap_spread_over_noise = {s['gap_spread_over_noise']:.2f}; "
        f"{sum(m['cached'] for m in metrics)}/{len(metrics)} models from the cache",
        flush=True,
    )


def evaluate(model, data, row: str, m) -> Value:
    """One measurement, or a failed one if it raised ``ValueError``."""
    try:
        result = m.evaluate(model, M.cross_entropy, data, progress=False, distributed="off")
    except ValueError as err:
        return Value(math.nan, math.nan, f"{row}: {err}")
    return Value(result.value, getattr(result, "first_order_value", math.nan))


def collect(config: Config, population: C.Population, out: Path) -> Records | None:
    """Train (or load) the population, print its gaps; then calibrate every ball on member 0
    and measure every member in ``measure_dtype`` (module docstring)."""
    from quotientgeo import calibrate_rho

    started, size, seconds = time.perf_counter(), config.size, {}
    recipes, data, task = size.recipes(config.seed), batches(config), config.task
    show = config.progress and population.is_reporter
    with C.threads(config.threads):
        tick = time.perf_counter()
        with C.counter(
            "models (trained or cached)", len(population.mine(len(recipes))), enabled=show
        ) as bar:
            trained = population.map(lambda r: M.trained(r, task, out / "models"), recipes, bar=bar)
        seconds["training"] = time.perf_counter() - tick
        metrics = [m for _, m in trained]
        if population.is_reporter:
            print_gaps(config, recipes, metrics)
        if config.gaps_only:
            return None
        dtype = getattr(torch, size.measure_dtype)  # members are trained in float32
        models = [model.to(dtype) for model, _ in trained]

        def calibrate(row: str) -> dict[str, Any]:
            cal = calibrate_rho(
                models[0],
                M.cross_entropy,
                data,
                target=config.target,
                measure=config.measures[row],
                low=0.01,
                high=1.0,
                rtol=size.calibration_rtol,
                max_evals=size.calibration_evals,
                progress=False,
                distributed="off",
            )
            return {"rho": cal.rho, "value": cal.value, "evaluations": len(cal.evaluations)}

        tick = time.perf_counter()
        found = population.map(calibrate, config.calibrated)
        calibration = dict(zip(config.calibrated, found, strict=True))
        rho1 = {row: c["rho"] for row, c in calibration.items()}
        seconds["calibration"] = time.perf_counter() - tick

        def measured(model) -> dict[tuple[str, float], Value]:
            return {
                (row, f): evaluate(model, data, row, config.measure(row, f, rho1))
                for row, f in config.plan()
            }

        tick = time.perf_counter()
        with C.counter("measuring", len(population.mine(len(models))), enabled=show) as bar:
            values = population.map(measured, models, bar=bar)
        seconds["measuring"] = time.perf_counter() - tick
    return Records(recipes, metrics, rho1, calibration, values, seconds, started, population.world)


def curvature_populations(
    config: Config, population: C.Population, out: Path
) -> list[_curvature.Population]:
    """The population for the curvature rows: trained (or loaded from ``out / "models"``) as
    :func:`collect` does, in ``measure_dtype``, on the sharpness rows' batches; the
    Riemannian rows in ``inv`` and ``mix`` (``symmetries="auto"``)."""
    size, recipes, data, task = (
        config.size,
        config.size.recipes(config.seed),
        batches(config),
        config.task,
    )
    show = config.progress and population.is_reporter
    with C.threads(config.threads):
        share = len(population.mine(len(recipes)))
        with C.counter("models (trained or cached)", share, enabled=show) as bar:
            trained = population.map(lambda r: M.trained(r, task, out / "models"), recipes, bar=bar)
    dtype = getattr(torch, size.measure_dtype)
    return [
        _curvature.Population(
            name="modular",
            model_of=lambda k: trained[k][0].to(dtype),
            batches_of=lambda k: data,
            loss_fn=M.cross_entropy,
            gaps=[m["gap"] for _, m in trained],
            keys=[
                {"fraction": r.fraction, "weight_decay": r.weight_decay, "seed": r.seed}
                for r in recipes
            ],
            axes=AXES,
            metrics=("inv", "mix"),
        )
    ]
