"""The expensive part of the diagonal study, per population: train it (every rank: one batched
tensor program per batch-order seed, seconds), calibrate every ball on the reference member,
measure every member at every radius of the grid (members split over the ranks)."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from quotientgeo import calibrate_rho
from quotientgeo.manifolds import DEFAULT_METRIC
from quotientgeo.sharpness import SharpnessMeasure

from .. import _common as C
from .. import _curvature
from .config import CALIBRATED_BY, GEODESIC, Config, Size
from .records import Calibrated, Member, PopulationRecords, Records
from .training import DiagonalNet, hyperparameters, make_data, mse, rescale_geometry, sgd_grid
from .training import train_population as _train

AXES = {"init": (), "sgd": ("lr_factor", "batch_size")}  # grid axes (init: random draws)


def bound(measure: SharpnessMeasure, model: DiagonalNet) -> SharpnessMeasure:
    """``measure`` for ``model``: geodesic rows on its re-scaling pair, declared in their metric."""
    if measure.symmetries is None:
        return measure
    metric = DEFAULT_METRIC if measure.metric is None else str(measure.metric)
    return measure.replace(symmetries=rescale_geometry(model, metric))


def design(name: str, size: Size, seed: int) -> dict[str, torch.Tensor]:
    """The population's hyperparameters, member by member (``seed``: batch-order seed index):
    ``init`` draws them (:func:`~.training.hyperparameters`), ``sgd`` is a grid at one ``α``."""
    data = size.data
    if name == "init":
        hp = hyperparameters(data.n_models, data.n, seed)
        return {**hp, "seed": torch.zeros(data.n_models, dtype=torch.long)}
    return sgd_grid(size.sgd_alpha, size.sgd_lr, size.sgd_batch, size.sgd_seeds)


def train(name: str, config: Config, show: bool) -> dict[str, torch.Tensor]:
    """Every member of population ``name`` (:func:`design`) trained, in member order; the members
    of batch-order seed ``s`` train together with seed ``config.seed + 1000·s`` (``s = 0``: the
    first design's seed). Trained once per process: the sharpness rows and the curvature rows
    share the networks."""
    return _trained(name, config.seed, config.size, show)


@functools.lru_cache(maxsize=len(AXES))
def _trained(name: str, seed: int, size: Size, show: bool) -> dict[str, torch.Tensor]:
    hp, data = design(name, size, seed), make_data(size.data, seed)
    parts, order = [], []
    for s in sorted(set(hp["seed"].tolist())):
        idx = (hp["seed"] == s).nonzero().flatten()
        sub = {k: v[idx] for k, v in hp.items() if k != "seed"}
        with C.counter(f"training {name} (seed {s}, converged)", len(idx), enabled=show) as bar:
            parts.append(_train(data, sub, size.data, seed + 1000 * s, bar))
        order.append(idx)
    inverse = torch.cat(order).argsort()
    return {k: torch.cat([p[k] for p in parts])[inverse] for k in parts[0]}


def calibrate(model: DiagonalNet, batches, config: Config, row: str, target: float) -> Calibrated:
    """``ρ₁`` of ``row``'s ball: where ``model``'s value of ``CALIBRATED_BY`` the ball's row (by
    default the row itself) is ``target``."""
    cal = calibrate_rho(
        model,
        mse,
        batches,
        target=target,
        measure=bound(config.measures[CALIBRATED_BY.get(row, row)], model),
        low=0.01,
        high=1.0,
        rtol=config.size.calibration_rtol,
        progress=False,
        distributed="off",
    )
    return Calibrated(cal.rho, cal.value, len(cal.evaluations))


def measure_member(model: DiagonalNet, batches, config: Config, rho1: dict[str, float]):
    """``(values, first_order, failures)`` of ``model``: every row at every grid factor; a
    measurement that raises ``ValueError`` is NaN and a failure."""
    values: dict[str, list[float]] = {row: [] for row in config.measures}
    first: dict[str, list[float]] = {row: [] for row in GEODESIC}
    failures = []
    for row in config.measures:
        for f in config.size.grid:
            m = bound(config.measure(row, f, rho1), model)
            try:
                result = m.evaluate(model, mse, batches, progress=False, distributed="off")
                value, first_order = result.value, result.first_order_value
            except ValueError as err:
                failures.append(f"{row} at rho={m.rho:.4g}: {err}")
                value = first_order = float("nan")
            values[row].append(value)
            if row in first:
                first[row].append(first_order)
    return values, first, failures


def collect_population(
    name: str, config: Config, population: C.Population, data: dict
) -> PopulationRecords:
    """Train, calibrate and measure population ``name`` (module docstring)."""
    seconds, tick = {}, time.perf_counter()
    show = config.progress and population.is_reporter
    hp = design(name, config.size, config.seed)
    trained = train(name, config, show)
    seconds["training"] = time.perf_counter() - tick
    finite = torch.isfinite(trained["test_loss"]) & torch.isfinite(trained["train_loss"])
    keep = finite.nonzero().flatten().tolist()
    if len(keep) < len(finite) and population.is_reporter:
        print(f"{name}: {len(finite) - len(keep)} network(s) diverged and are left out")
    if len(keep) < 3:
        raise RuntimeError(f"{name}: fewer than 3 networks trained without diverging")
    models = [DiagonalNet(trained["u"][k], trained["v"][k]) for k in keep]
    batches = [(data["X"], data["y"])]
    reference = len(keep) // 2
    target = config.size.target_fraction * float(data["y"].square().mean())

    tick = time.perf_counter()
    balls = config.calibrated
    with C.counter(f"calibrating ρ₁ ({name})", len(population.mine(len(balls))), enabled=show) as b:
        found = population.map(
            lambda row: calibrate(models[reference], batches, config, row, target), balls, bar=b
        )
    calibration = dict(zip(balls, found, strict=True))
    rho1 = {row: c.rho for row, c in calibration.items()}
    seconds["calibration"] = time.perf_counter() - tick

    tick = time.perf_counter()
    share = len(population.mine(len(models)))
    with C.counter(f"τ(ρ) grid ({name}, models)", share, enabled=show) as b:
        measured = population.map(
            lambda model: measure_member(model, batches, config, rho1), models, bar=b
        )
    seconds["grid"] = time.perf_counter() - tick
    members = [
        Member(
            alpha=float(hp["alpha"][k]),
            lr_factor=float(hp["lr_factor"][k]),
            batch_size=int(hp["batch_size"][k]),
            seed=int(hp["seed"][k]),
            steps=int(trained["steps"][k]),
            train_loss=float(trained["train_loss"][k]),
            test_loss=float(trained["test_loss"][k]),
            test_se=float(trained["test_se"][k]),
            values=values,
            first_order=first,
        )
        for k, (values, first, _) in zip(keep, measured, strict=True)
    ]
    return PopulationRecords(
        name=name,
        axes=AXES[name],
        members=members,
        n_models=len(finite),
        n_converged=int((trained["train_loss"] < config.size.data.target_loss).sum()),
        reference=reference,
        target=target,
        calibration=calibration,
        failures=[failure for *_, fails in measured for failure in fails],
        seconds=seconds,
    )


def collect(config: Config, population: C.Population, out: Path) -> Records:
    """Every population of ``config``, in order, split over ``population``'s ranks (nothing is
    cached under ``out``: training takes seconds)."""
    started = time.perf_counter()
    data = make_data(config.size.data, config.seed)
    with C.threads(1):
        records = {
            name: collect_population(name, config, population, data) for name in config.populations
        }
    return Records(records, population.world, started)


def curvature_populations(
    config: Config, population: C.Population, out: Path
) -> list[_curvature.Population]:
    """Every population of ``config`` for the curvature rows: trained as :func:`collect`
    trains it (the same networks), the diverged left out, measured on the whole training set
    as one batch, the Riemannian rows on the declared re-scaling pair in ``inv`` and ``mix``."""
    data = make_data(config.size.data, config.seed)
    batches = [(data["X"], data["y"])]
    show = config.progress and population.is_reporter
    found = []
    for name in config.populations:
        hp = design(name, config.size, config.seed)
        with C.threads(1):
            trained = train(name, config, show)
        finite = torch.isfinite(trained["test_loss"]) & torch.isfinite(trained["train_loss"])
        keep = finite.nonzero().flatten().tolist()
        gaps = [float(trained["test_loss"][k] - trained["train_loss"][k]) for k in keep]
        axes = AXES[name]
        keys = [
            {
                **{axis: float(hp[axis][k]) for axis in axes},
                "seed": int(hp["seed"][k]),
            }
            for k in keep
        ]

        def model_of(i: int, trained=trained, keep=keep) -> DiagonalNet:
            return DiagonalNet(trained["u"][keep[i]], trained["v"][keep[i]])

        found.append(
            _curvature.Population(
                name=name,
                model_of=model_of,
                batches_of=lambda i: batches,
                loss_fn=mse,
                gaps=gaps,
                keys=keys,
                axes=axes,
                metrics=("inv", "mix"),
                symmetries=rescale_geometry,
                context=lambda model: C.threads(1),  # tiny tensors: one thread is fastest
            )
        )
    return found
