"""Sharpness during training: a measure evaluated every ``N`` steps on fixed batches.

A training loop calls the tracker after each optimizer step; on the steps that are multiples
of ``every`` it evaluates the measure (any :class:`~quotientgeo.Measure`: geodesic, adaptive
or average sharpness, relative flatness) on the same batches and records the value::

    tracker = SharpnessTracker(Measure.geodesic(0.05, n_iter=10), loss_fn, batches, every=100)
    for step in range(1, n_steps + 1):
        ...  # forward, backward, optimizer.step()
        tracker(model, step)
    tracker.history  # [TrackedSharpness(step=100, value=..., result=...), ...]

The measures restore the model bit-exactly (weights, buffers, ``.grad``, train/eval mode) and
draw their random directions from their own seeded generator, so the training run is the same
with and without the tracker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..options import Distributed
from ..validation import positive_int
from .measure import Measure, MeasureResult

Tensor = torch.Tensor

__all__ = ["SharpnessTracker", "TrackedSharpness"]


@dataclasses.dataclass(frozen=True)
class TrackedSharpness:
    """One evaluation of a tracked measure.

    Attributes:
        step: the training step after which it was measured.
        value: the measure's value (``result.value``).
        result: the full result of :meth:`Measure.evaluate
            <quotientgeo.Measure.evaluate>`.
    """

    step: int
    value: float
    result: MeasureResult


class SharpnessTracker:
    """Evaluate ``measure`` on fixed ``batches`` at every step that is a multiple of ``every``.

    Args:
        measure: what to measure: a :class:`~quotientgeo.Measure` (geodesic, adaptive or
            average sharpness, relative flatness).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``, as for :meth:`Measure.evaluate
            <quotientgeo.Measure.evaluate>`.
        batches: the measurement batches; read once into a list here, so every evaluation
            sees the same batches in the same order.
        every: evaluate at steps ``0, every, 2·every, ...`` (a positive integer).
        name: the key of the value in logs; default ``"sharpness/<measure.name>"``.
        distributed: passed to :meth:`Measure.evaluate <quotientgeo.Measure.evaluate>` in an
            initialised process group (every rank must call the tracker).

    Calling the tracker with ``(model, step)`` returns the new :class:`TrackedSharpness` on a
    due step (and appends it to :attr:`history`), else ``None``.
    """

    def __init__(
        self,
        measure: Measure,
        loss_fn: Callable[[nn.Module, Any], Tensor],
        batches: Iterable,
        *,
        every: int,
        name: str | None = None,
        distributed: Distributed | str = Distributed.BATCHES,
    ) -> None:
        if not isinstance(measure, Measure):
            raise TypeError(
                "measure must be a quotientgeo.Measure (Measure.geodesic, .adaptive, .average, "
                f".relative_flatness), got {type(measure).__name__}"
            )
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable: loss_fn(model, batch) -> scalar tensor")
        self.measure = measure
        self.loss_fn = loss_fn
        self.batches: list = list(batches)
        if not self.batches:
            raise ValueError("batches is empty: give at least one measurement batch")
        self.every = positive_int("every", every, "evaluate every that many steps")
        self.name = f"sharpness/{measure.name}" if name is None else str(name)
        self.distributed = distributed
        self.history: list[TrackedSharpness] = []

    def due(self, step: int) -> bool:
        """Whether ``step`` is a multiple of :attr:`every`."""
        return step % self.every == 0

    def measure_now(self, model: nn.Module, step: int) -> TrackedSharpness:
        """Evaluate the measure on ``model`` now, record it under ``step`` and return it."""
        result = self.measure.evaluate(
            model, self.loss_fn, self.batches, progress=False, distributed=self.distributed
        )
        tracked = TrackedSharpness(step=step, value=float(result.value), result=result)
        self.history.append(tracked)
        return tracked

    def __call__(self, model: nn.Module, step: int) -> TrackedSharpness | None:
        return self.measure_now(model, step) if self.due(step) else None

    def __repr__(self) -> str:
        return (
            f"SharpnessTracker(name={self.name!r}, every={self.every}, "
            f"batches={len(self.batches)}, evaluations={len(self.history)})"
        )
