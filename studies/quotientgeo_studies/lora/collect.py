"""The expensive part of the LoRA study: pretrain (or load) the base model, fine-tune (or load)
every member, check the adapters' symmetry blocks, calibrate every ball on the reference
member, then measure every member in both scopes."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quotientgeo import Measure, calibrate_rho

from .. import _common as C
from .. import _curvature, _finetune, _vit
from .analyse import AXES
from .config import Config
from .model import (
    FROZEN_ATTENTION,
    SCOPES,
    adapted,
    adapter_blocks,
    describe,
    load_trainable,
    scope,
    trainable_state,
)
from .records import Calibrated, Measurement, Member, Recipe, Records
from .training import train


def finetuned(
    config: Config,
    recipe: Recipe,
    base: dict,
    pre: _finetune.Pretraining,
    data: dict[str, torch.Tensor],
    cache: Path,
) -> dict[str, Any]:
    """``{"state", "metrics"}`` of member ``recipe``: the trainable parameters after
    fine-tuning (:func:`~.training.train`) on the pool with its noisy labels, and its errors
    (:class:`~.records.Member`); cached under ``cache`` by a hash of everything that decides
    them."""
    t = config.training
    x, y = data["x_train"], _finetune.noisy_labels(data["y_train"], t.noise, recipe.seed)

    def make() -> dict[str, Any]:
        model = adapted(base["state_dict"], pre, t.adapters, recipe.seed)
        run = train(
            model,
            recipe.arm,
            recipe.lr,
            x,
            y,
            steps=t.steps,
            batch_size=t.batch_size,
            seed=recipe.seed,
            settings=t.arms,
        )
        train_error = _vit.error(model, x, y)
        test_error = _vit.error(model, data["x_test"], data["y_test"])
        metrics = {
            "train_error": train_error,
            "test_error": test_error,
            "test_accuracy": 1.0 - test_error,
            "gap": test_error - train_error,
            "clean_train_error": _vit.error(model, x, data["y_train"]),
            "n_train": len(y),
            "n_test": len(data["y_test"]),
            **run,
        }
        return {"state": trainable_state(model), "metrics": metrics}

    key = _finetune.cache_key("lora", recipe, t, base["key"], len(data["y_train"]))
    blob, cached = _finetune.load_or_make(cache / f"lora-{key}.pt", make)
    return {"state": blob["state"], "metrics": {**blob["metrics"], "cached": cached}}


def measured_copy(
    base: dict, pre: _finetune.Pretraining, config: Config, recipe: Recipe, state: dict
) -> nn.Module:
    """Member ``recipe`` rebuilt from the base model and its fine-tuned ``state``, in the
    measures' dtype."""
    model = adapted(base["state_dict"], pre, config.training.adapters, recipe.seed)
    return load_trainable(model, state).to(getattr(torch, config.size.measure_dtype))


def calibrate(
    model: nn.Module, batches: list, config: Config, where: str, m: Measure
) -> Calibrated:
    """``ρ₁`` of measure ``m`` in scope ``where``: the radius at which ``model`` reaches
    ``config.target`` nats."""
    with scope(model, where), warnings.catch_warnings():
        warnings.filterwarnings("ignore", FROZEN_ATTENTION, UserWarning)
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


def measure(
    model: nn.Module, batches: list, config: Config, member: int, rho1: dict[tuple[str, str], float]
) -> list[Measurement]:
    """Every measure of ``model`` in both scopes at its calibrated radius; a measurement that
    raises ``ValueError`` (e.g. rank-deficient factors) is recorded as failed."""
    out = []
    for where in SCOPES:
        with scope(model, where), warnings.catch_warnings():
            warnings.filterwarnings("ignore", FROZEN_ATTENTION, UserWarning)
            for name, m in config.measures.items():
                rho = rho1[where, name]
                try:
                    result = m.with_rho(rho).evaluate(
                        model, _vit.cross_entropy, batches, progress=False, distributed="off"
                    )
                except ValueError as err:
                    reason = f"member {member}, {name} ({where}) at rho={rho:.4g}: {err}"
                    out.append(Measurement.failed(member, where, name, rho, reason))
                    continue
                out.append(Measurement(member, where, name, rho, result.value))
    return out


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
    """Train, check, calibrate and measure (module docstring), split over ``population``'s
    ranks; models are cached under ``out / "models"``."""
    started, timer, size, t = time.perf_counter(), _Timer(), config.size, config.training
    cache, seed = out / "models", config.seed
    data = _finetune.tasks(seed, t.pool)
    pre = _finetune.Pretraining(width=size.width, epochs=size.pretrain_epochs, seed=seed)
    recipes, reference = config.recipes(), config.reference
    dtype = getattr(torch, size.measure_dtype)
    show = config.progress and population.is_reporter
    share_of = len(population.mine(len(recipes)))

    def bar(desc: str, total: int):
        return C.counter(desc, total, enabled=show)

    def batches_of(k: int) -> list:
        """The measurement points with member ``k``'s noisy training labels, in ``dtype``."""
        labels = _finetune.noisy_labels(data["y_train"], t.noise, recipes[k].seed)
        batches = _finetune.sharpness_batches(data, size.n_batches, size.batch, labels)
        return [(x.to(dtype), y) for x, y in batches]

    def fine_tune() -> tuple[dict, list[dict]]:
        base = population.map(lambda _: _finetune.pretrained(pre, data, cache), [None])[0]
        with bar("members (fine-tuned or cached)", share_of) as b:
            fine = population.map(
                lambda r: finetuned(config, r, base, pre, data, cache), recipes, bar=b
            )
        return base, fine

    with C.threads(config.threads):
        base, fine = timer("training", fine_tune)

        def model_of(k: int) -> nn.Module:
            return measured_copy(base, pre, config, recipes[k], fine[k]["state"])

        reference_model = model_of(reference)
        adapter_blocks(reference_model, t.adapters.r)  # each adapter a GL(r) pair, or stop
        geometry = {}
        for where in SCOPES:
            with scope(reference_model, where):
                geometry[where] = describe(reference_model)
        balls = [(where, name) for where in SCOPES for name in config.measures]

        def calibrated() -> dict[tuple[str, str], Calibrated]:
            batches = batches_of(reference)
            with bar("calibrating ρ₁", len(population.mine(len(balls)))) as b:
                found = population.map(
                    lambda ball: calibrate(
                        reference_model, batches, config, ball[0], config.measures[ball[1]]
                    ),
                    balls,
                    bar=b,
                )
            return dict(zip(balls, found, strict=True))

        calibration = timer("calibration", calibrated)
        rho1 = {ball: c.rho for ball, c in calibration.items()}

        def one(k: int) -> list[Measurement]:
            if fine[k]["metrics"]["diverged"]:
                return [
                    Measurement.failed(k, where, name, rho1[where, name], f"member {k} diverged")
                    for where, name in balls
                ]
            return measure(model_of(k), batches_of(k), config, k, rho1)

        def measured() -> list[Measurement]:
            with bar("measuring", share_of) as b:
                per_member = population.map(one, list(range(len(recipes))), bar=b)
            return [record for records in per_member for record in records]

        measurements = timer("measuring", measured)
    return Records(
        members=[Member(r, f["metrics"]) for r, f in zip(recipes, fine, strict=True)],
        pretrained=base["metrics"],
        reference=reference,
        calibration=calibration,
        geometry=geometry,
        measurements=measurements,
        ranks=population.world,
        seconds=timer.seconds,
        started=started,
    )


ADAPTER_RADIUS = 0.1
"""The radius of the adapters' ``FrameDamping`` in the curvature rows (the Hessian has no ball
to take it from): the SAM arms' radius, fixed in advance."""


def damped_geometry(model: nn.Module, metric: str):
    """``find_symmetries(model)`` in ``metric``, each damping that waits for a ball's radius
    (the adapters' ``FrameDamping()``) given :data:`ADAPTER_RADIUS`; every other block as
    discovered."""
    import dataclasses

    from quotientgeo import find_symmetries
    from quotientgeo.manifolds.gl.damping import with_ball_filled

    geometry = find_symmetries(model, warn=False).with_metric(metric)  # a new geometry
    geometry.blocks = [
        dataclasses.replace(b, manifold=with_ball_filled(b.manifold, ADAPTER_RADIUS))
        for b in geometry.blocks
    ]
    return geometry


def curvature_populations(
    config: Config, population: C.Population, out: Path
) -> list[_curvature.Population]:
    """The population for the curvature rows, once per scope: fine-tuned (or loaded from
    ``out / "models"``) as :func:`collect` does, a float64 copy of each member on its
    sharpness batches, the Riemannian rows in ``mix`` (:func:`damped_geometry`); diverged
    members are left out."""
    import contextlib

    size, t, seed = config.size, config.training, config.seed
    cache = out / "models"
    data = _finetune.tasks(seed, t.pool)
    pre = _finetune.Pretraining(width=size.width, epochs=size.pretrain_epochs, seed=seed)
    recipes = config.recipes()
    dtype = getattr(torch, size.measure_dtype)
    show = config.progress and population.is_reporter
    with C.threads(config.threads):
        base = population.map(lambda _: _finetune.pretrained(pre, data, cache), [None])[0]
        share = len(population.mine(len(recipes)))
        with C.counter("members (fine-tuned or cached)", share, enabled=show) as b:
            fine = population.map(
                lambda r: finetuned(config, r, base, pre, data, cache), recipes, bar=b
            )

    def batches_of(k: int) -> list:
        labels = _finetune.noisy_labels(data["y_train"], t.noise, recipes[k].seed)
        batches = _finetune.sharpness_batches(data, size.n_batches, size.batch, labels)
        return [(x.to(dtype), y) for x, y in batches]

    def model_of(k: int) -> nn.Module:
        return measured_copy(base, pre, config, recipes[k], fine[k]["state"])

    def scoped(where: str):
        @contextlib.contextmanager
        def context(model: nn.Module):
            with scope(model, where), warnings.catch_warnings():
                warnings.filterwarnings("ignore", FROZEN_ATTENTION, UserWarning)
                yield model

        return context

    return [
        _curvature.Population(
            name=f"lora ({where})",
            model_of=model_of,
            batches_of=batches_of,
            loss_fn=_vit.cross_entropy,
            gaps=[f["metrics"]["gap"] for f in fine],
            keys=[r.axes() for r in recipes],
            axes=AXES,
            metrics=("mix",),
            symmetries=damped_geometry,
            context=scoped(where),
            skip=frozenset(k for k, f in enumerate(fine) if f["metrics"]["diverged"]),
        )
        for where in SCOPES
    ]
