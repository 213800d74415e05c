"""The expensive part of the transformers study: train (or load) the population, print its gap
spread over test-set noise, calibrate every ball on member 0, measure the τ(ρ) grid, then the
ablations at the fixed radius (and at the best one, for the random population)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quotientgeo import Measure

from .. import _common as C
from .. import _curvature, _finetune, _vit
from .analyse import best_factor, gap_spread_over_noise, grid_tau
from .config import FIXED_FACTOR, MEASURES, Config
from .records import Calibrated, Measurement, Member, Records, Row

Plan = list[tuple[str, float, Row]]  # (row, factor, measure at its radius)


def measure(model, batches, member: int, row: str, factor: float, m: Row) -> Measurement:
    """One measurement of ``model``, or a failed one if it raised ``ValueError``; relative
    flatness has no radius nor first-order value (NaN)."""
    try:
        result = m.evaluate(model, _vit.cross_entropy, batches, progress=False, distributed="off")
    except ValueError as err:
        rho = m.settings().get("rho")
        where = "" if rho is None else f" at rho={rho:.4g}"
        return Measurement.failed(member, row, factor, m, f"{row}{where}: {err}")
    first_order = getattr(result, "first_order_value", float("nan"))
    return Measurement(member, row, factor, m, result.value, first_order)


def calibrate(model, batches, config: Config, m: Measure) -> Calibrated:
    """``ρ₁`` of measure ``m``: where ``model`` reaches ``config.target`` nats."""
    from quotientgeo import calibrate_rho

    cal = calibrate_rho(
        model,
        _vit.cross_entropy,
        batches,
        target=config.target,
        measure=m,
        low=0.01,
        high=1.0,
        rtol=config.size.calibration_rtol,
        max_evals=config.size.calibration_evals,
        progress=False,
        distributed="off",
    )
    return Calibrated(cal.rho, cal.value, len(cal.evaluations))


def grid_plan(config: Config, rho1: dict[str, float]) -> Plan:
    """The τ(ρ) grid of every member: each studied measure at every grid factor."""
    return [(m, f, config.measure(m, f, rho1)) for m in MEASURES for f in config.size.grid]


def ablation_plan(config: Config, rho1: dict[str, float], factors, done: Plan) -> Plan:
    """The ablation rows at ``factors`` whose measure ``done`` does not hold: rows with a ball
    of their own first, then those sharing one; a measure two rows share is measured once."""
    own = [row for row in config.calibrated if row not in MEASURES]
    shared = [row for row in config.measures if row not in config.calibrated]
    seen = {m for *_, m in done}
    plan: Plan = []
    for f in factors:
        for row in own + shared:
            m = config.measure(row, f, rho1)
            if m not in seen:
                seen.add(m)
                plan.append((row, f, m))
    return plan


class _Timer:
    """Wall time of the phases, ``seconds[name]``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        tick = time.perf_counter()
        value = fn()
        self.seconds[name] = time.perf_counter() - tick
        return value


def collect(config: Config, population: C.Population, out: Path) -> Records:
    """Train, calibrate and measure (module docstring), split over ``population``'s ranks;
    models are cached under ``out / "models"``."""
    started, timer, size = time.perf_counter(), _Timer(), config.size
    cache, seed = out / "models", config.seed
    data = _finetune.tasks(seed, config.pool)
    pre = _finetune.Pretraining(width=size.width, epochs=size.pretrain_epochs, seed=seed)
    recipes = config.recipes()

    def batches_of(k: int) -> list:
        """The fixed measurement points with member ``k``'s training labels."""
        labels = _finetune.training_labels(recipes[k], data["y_train"])
        return _finetune.sharpness_batches(data, size.n_batches, size.batch, labels)

    share_of = len(population.mine(size.n_models))
    show = config.progress and population.is_reporter

    def bar(desc: str, total: int):
        return C.counter(desc, total, enabled=show)

    def train() -> tuple[dict, list]:
        base = population.map(lambda _: _finetune.pretrained(pre, data, cache), [None])[0]
        with bar("models (fine-tuned or cached)", share_of) as b:
            fine = population.map(
                lambda r: _finetune.finetuned(r, base, pre, data, cache), recipes, bar=b
            )
        return base, fine

    def calibrated(model) -> dict[str, Calibrated]:
        names, batches = config.calibrated, batches_of(0)
        balls = [config.measures[n] for n in names]
        with bar("calibrating ρ₁", len(population.mine(len(names)))) as b:
            found = population.map(lambda m: calibrate(model, batches, config, m), balls, bar=b)
        return dict(zip(names, found, strict=True))

    def measured(models: list, plan: Plan, desc: str) -> list[Measurement]:
        def one(item: tuple[int, Any]) -> list[Measurement]:
            k, model = item
            batches = batches_of(k)
            return [measure(model, batches, k, row, f, m) for row, f, m in plan]

        with bar(desc, share_of) as b:
            per_member = population.map(one, list(enumerate(models)), bar=b)
        return [record for records in per_member for record in records]

    with C.threads(config.threads):
        base, fine = timer("training", train)
        models = [model for model, _ in fine]
        if population.is_reporter:  # before any sharpness: can this population answer?
            spread = gap_spread_over_noise([metrics for _, metrics in fine])
            print(f"gap spread over test-set noise: {spread:.2f}", flush=True)
        calibration = timer("calibration", lambda: calibrated(models[0]))
        rho1 = {row: c.rho for row, c in calibration.items()}
        grid = grid_plan(config, rho1)
        on_grid = timer("grid", lambda: measured(models, grid, "τ(ρ) grid"))
        gap = [metrics["gap"] for _, metrics in fine]
        factors = [FIXED_FACTOR]
        if size.best_radius:
            best = best_factor(grid_tau(config, rho1, gap, on_grid), config.size.grid)
            factors = sorted({FIXED_FACTOR, best})
        extra = ablation_plan(config, rho1, factors, grid)
        desc = f"ablations at f = {', '.join(f'{f:.3g}' for f in factors)}"
        ablations = timer("ablations", lambda: measured(models, extra, desc))
    return Records(
        members=[Member(r, metrics) for r, (_, metrics) in zip(recipes, fine, strict=True)],
        pretrained=base["metrics"],
        calibration=calibration,
        measurements=on_grid + ablations,
        ranks=population.world,
        seconds=timer.seconds,
        started=started,
    )


def curvature_populations(
    config: Config, population: C.Population, out: Path
) -> list[_curvature.Population]:
    """The population for the curvature rows: fine-tuned (or loaded from ``out / "models"``)
    as :func:`collect` does, measured on each member's sharpness batches, the Riemannian rows
    in ``inv`` and ``mix`` (``symmetries="auto"``)."""
    size, cache, seed = config.size, out / "models", config.seed
    data = _finetune.tasks(seed, config.pool)
    pre = _finetune.Pretraining(width=size.width, epochs=size.pretrain_epochs, seed=seed)
    recipes = config.recipes()
    show = config.progress and population.is_reporter
    with C.threads(config.threads):
        base = population.map(lambda _: _finetune.pretrained(pre, data, cache), [None])[0]
        share = len(population.mine(size.n_models))
        with C.counter("models (fine-tuned or cached)", share, enabled=show) as b:
            fine = population.map(
                lambda r: _finetune.finetuned(r, base, pre, data, cache), recipes, bar=b
            )

    def batches_of(k: int) -> list:
        labels = _finetune.training_labels(recipes[k], data["y_train"])
        return _finetune.sharpness_batches(data, size.n_batches, size.batch, labels)

    return [
        _curvature.Population(
            name=config.population,
            model_of=lambda k: fine[k][0],
            batches_of=batches_of,
            loss_fn=_vit.cross_entropy,
            gaps=[metrics["gap"] for _, metrics in fine],
            keys=[{**{a: getattr(r, a) for a in config.axes}, "seed": r.seed} for r in recipes],
            axes=config.axes,
            metrics=("inv", "mix"),
        )
    ]
