"""What the three curvature functions share: the operator, its progress bar, the settings."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..geometry import ParameterGeometry
from ..manifolds import BallDamping
from ..progress import progress_bar
from .operator import RiemannianHessian

Tensor = torch.Tensor

__all__ = ["measured", "settings_of"]


@contextlib.contextmanager
def measured(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batches: Iterable,
    *,
    symmetries: str | ParameterGeometry | None,
    metric: str | float | None,
    geometry: str,
    eps: float | BallDamping | None,
    progress: bool,
    description: str,
    product: str = "double_backward",
    step: float | None = None,
    plan: Callable[[int], list[int]] | None = None,
) -> Iterator[RiemannianHessian]:
    """The :class:`RiemannianHessian` of the arguments, with a progress bar over its batch
    passes. ``plan(D)``, where known, lists the columns of each product the caller will
    compute on the operator of size ``D`` (the bar's total follows from it)."""
    hessian = RiemannianHessian(
        model, loss_fn, batches, symmetries=symmetries, metric=metric, geometry=geometry, eps=eps,
        product=product, step=step,
    )  # fmt: skip
    total = None
    if plan is not None:
        columns = plan(hessian.dim)
        per_product = [2 * k if product == "finite_difference" else 1 for k in columns]
        total = sum(per_product) * len(hessian.batches)
    with progress_bar(total=total, desc=description, enabled=progress) as bar:
        hessian._advance = lambda: bar.update(1)
        try:
            yield hessian
        finally:
            hessian._advance = lambda: None


def settings_of(hessian: RiemannianHessian, metric, **extra: Any) -> dict[str, Any]:
    """The settings a result records: ``extra``, then the operator's."""
    g = hessian.geometry
    return {
        **extra,
        "geometry": hessian.geometry_kind,
        "step": hessian._step,
        "metric": metric if metric is not None else _declared(g.metrics),
        "dim": hessian.dim,
        "n_batches": len(hessian.batches),
        "symmetric_blocks": len(g.blocks),
        "dtype": str(hessian.dtype),
        "device": str(hessian.device),
        "symmetries": g.summary(),
    }


def _declared(metrics: tuple) -> str | float | list | None:
    if not metrics:
        return None
    return metrics[0] if len(metrics) == 1 else list(metrics)


def group_ids(hessian: RiemannianHessian) -> Tensor:
    """The group of every coordinate, ``(D,)``, positions in ``hessian.groups``."""
    ids = torch.empty(hessian.dim, dtype=torch.long, device=hessian.device)
    for i, group in enumerate(hessian.groups):
        ids[group.index] = i
    return ids
