"""The batch driver: one measure, one model, every batch; the model preserved throughout."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..geometry import ParameterGeometry
from ..geometry.perturbation import Perturbations
from ..options import Distributed, Norm, Perturbation
from ..progress import progress_bar
from .cases import AverageCase, WorstCase
from .checks import check_batches, check_loss_fn, check_model, warn_if_resolution
from .objective import Objective, Where
from .ranks import ranks_for
from .result import SharpnessResult
from .state import model_state_preserved

Tensor = torch.Tensor

__all__ = ["batch_seed", "run"]


def batch_seed(seed: int, index: int) -> int:
    """Seed of the random draws for the batch of global index ``index`` (split independent)."""
    return (seed * 1_000_003 + index) % 2**63


def _length(batches) -> int | None:
    """``len(batches)``, or ``None`` when it has none (a generator; a ``DataLoader`` over an
    ``IterableDataset``, whose ``len`` raises)."""
    try:
        return len(batches)
    except TypeError:
        return None


def run(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batches: Iterable,
    *,
    geometry: ParameterGeometry,
    case: WorstCase | AverageCase,
    rho: float,
    perturbation: Perturbation,
    norm: Norm,
    seed: int,
    settings: dict[str, Any],
    description: str,
    progress: bool,
    distributed: Distributed | str,
    return_perturbation: bool,
    compile: bool = False,
) -> SharpnessResult:
    """The measure ``case`` on the ball of radius ``rho`` of ``geometry`` (the map
    ``perturbation``, the metric ``norm``) of ``model`` over ``batches``; ``settings`` are
    recorded in the result, ``description`` names the progress bar; ``compile``: the adaptive
    rest's Gram pass and the step by compiled kernels (:mod:`quotientgeo.sharpness.fused`)."""
    check_model(model)
    check_loss_fn(loss_fn)
    check_batches(batches)
    if not isinstance(return_perturbation, bool):
        raise TypeError(f"return_perturbation must be True or False, got {return_perturbation!r}")
    if return_perturbation and not isinstance(case, WorstCase):
        raise ValueError("return_perturbation=True needs a worst-case measure")
    space = Perturbations(geometry, perturbation, norm, radius=rho)
    ranks = ranks_for(distributed, sharded=space.sharded)
    t0 = time.perf_counter()
    count = _length(batches)
    bar = progress_bar(
        total=None if count is None else count * case.steps,
        desc=description,
        enabled=progress and ranks.rank == 0,
    )
    offset = ranks.batch_offset(batches)
    records, failure = [], None
    params = {name: geometry.params[name] for name in space.order}
    with model_state_preserved(model, params) as x0, bar:
        try:
            worst = isinstance(case, WorstCase)
            with Objective(
                model, loss_fn, space, x0, ranks, worst_case=worst, compiled=compile
            ) as objective:
                gen = torch.Generator(device=objective.device)
                for i, batch in enumerate(batches):
                    gen.manual_seed(batch_seed(seed, offset + i))
                    records.append(
                        case.measure_batch(
                            objective,
                            batch,
                            Where(offset + i),
                            gen,
                            rho=rho,
                            first_order_map=perturbation == Perturbation.FIRST_ORDER,
                            return_perturbation=return_perturbation,
                            advance=lambda: bar.update(1),
                        )
                    )
        except Exception as err:  # raised here, or (distributed="batches") on every rank
            failure = ranks.failure(err)
    records = ranks.collect(records, failure)
    if not records:
        raise ValueError("batches is empty: nothing to measure sharpness on")
    warn_if_resolution(records, geometry)
    declared = geometry.metrics
    settings = {
        **settings,
        "metric": settings["metric"] if settings["metric"] is not None else _declared(declared),
        "n_batches": len(records),
        "distributed": ranks.mode.value,
        "world_size": ranks.world,
        "symmetric_blocks": len(geometry.blocks),
        "dtype": str(geometry.compute_dtype),
        "device": str(geometry.device),
        "geometry": geometry.summary(),
    }
    return SharpnessResult.from_records(
        records, settings, time.perf_counter() - t0, geometry.device
    )


def _declared(metrics: tuple) -> str | float | list | None:
    """The declared metric as settings record it: one name, a list of several, or ``None``."""
    if not metrics:
        return None
    return metrics[0] if len(metrics) == 1 else list(metrics)
