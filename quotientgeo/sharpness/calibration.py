r"""Choosing the radius ``ρ``: the ball in which a measure's worst-case increase reaches a target.

Sharpness values depend on ``ρ`` as much as on the model: for small ``ρ`` a worst-case measure
is first order, ``≈ ρ ||grad L||`` (the curvature term, the point of geodesic sharpness, is
negligible), and only at larger ``ρ`` does the second-order term matter. Studies compare models
at one ``ρ`` per measure; :func:`calibrate_rho` finds, for a reference model, the ``ρ`` at which
the measure reaches a chosen loss increase (for example one nat), so that each measure is read
in the same regime.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn

from ..progress import progress_bar
from ..validation import positive_int, positive_real
from .measure import Measure

__all__ = ["Calibration", "calibrate_rho"]

CONSTRUCTORS = {
    "geodesic": Measure.geodesic,
    "adaptive": Measure.adaptive,
    "average": Measure.average,
}


@dataclasses.dataclass
class Calibration:
    """Outcome of :func:`calibrate_rho`.

    Attributes:
        rho: the radius found.
        value: the measure's value at ``rho`` (within ``rtol`` of ``target``).
        target: the value asked for.
        measure: the measure's name (``"geodesic"``, ``"adaptive"``, ``"average"``, ...).
        evaluations: every ``(rho, value)`` measured, in order.
    """

    rho: float
    value: float
    target: float
    measure: str
    evaluations: list[tuple[float, float]]


def calibrate_rho(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Any],
    batches: Iterable,
    *,
    target: float,
    measure: Measure | str = "geodesic",
    low: float = 1e-3,
    high: float = 1.0,
    rtol: float = 0.05,
    max_evals: int = 24,
    progress: bool = True,
    distributed: str = "batches",
    **measure_kwargs: Any,
) -> Calibration:
    """The ``ρ`` at which ``measure`` of ``model`` reaches ``target`` (a loss increase).

    Bisection in ``log ρ`` between a bracket ``[low, high]`` (widened by factors of 10 until
    it contains ``target``) until the value is within ``rtol · target``. Each step is one
    measurement, ``measure.with_rho(ρ).evaluate(...)``: ``measure`` is a
    :class:`~quotientgeo.Measure` with a ball (its own ``ρ`` is not used; a measure whose
    ``with_rho`` does not change it, relative flatness, is a ``ValueError``), or the name of a
    constructor
    (``"geodesic"``, ``"adaptive"``, ``"average"``) called with ``**measure_kwargs``, for
    example ``metric="inv"``, ``n_iter=20``; the worst case over a
    larger ball is larger, so the value grows with ``ρ`` (up to the maximiser's accuracy).
    ``batches`` is iterated once per measurement, so pass a list or a re-iterable loader (a
    generator or other iterator is refused: the first measurement would consume it);
    ``distributed`` is the measurements' (:meth:`~quotientgeo.Measure.evaluate`).

    Raises:
        TypeError: ``batches`` is an iterator.
        ValueError: bad arguments, or no ``ρ`` in ``[low / 10^k, high · 10^k]`` within
            ``max_evals`` measurements reaches ``target``.
    """
    if isinstance(measure, str):
        if measure not in CONSTRUCTORS:
            raise ValueError(f"measure must be one of {tuple(CONSTRUCTORS)}, got {measure!r}")
        chosen = CONSTRUCTORS[measure](1.0, **measure_kwargs)
    elif not isinstance(measure, Measure):
        raise TypeError(f"measure must be a Measure or a name, got {measure!r}")
    elif measure_kwargs:
        raise TypeError("pass keyword arguments of the measure to its constructor, not here")
    else:
        chosen = measure
    if isinstance(batches, Iterator):
        raise TypeError(
            f"batches is an iterator ({type(batches).__name__}): calibrate_rho measures "
            "several times, and the first measurement would consume it; pass a list or a "
            "re-iterable loader (a DataLoader)"
        )
    target = positive_real("target", target)
    low, high = positive_real("low", low), positive_real("high", high)
    if not low < high:
        raise ValueError(f"low must be smaller than high, got low={low}, high={high}")
    if chosen.with_rho(low) == chosen.with_rho(high):
        raise ValueError(f"measure {chosen.name!r} does not depend on ρ: nothing to calibrate")
    rtol = positive_real("rtol", rtol)
    max_evals = positive_int("max_evals", max_evals)
    evaluations: list[tuple[float, float]] = []
    bar = progress_bar(total=max_evals, desc=f"calibrating ρ ({chosen.name})", enabled=progress)

    def value(rho: float) -> float:
        if len(evaluations) >= max_evals:
            raise ValueError(
                f"no ρ reached target={target} within max_evals={max_evals} measurements: "
                f"(ρ, value) = {[(f'{r:.3g}', f'{v:.3g}') for r, v in evaluations]}"
            )
        m = chosen.with_rho(rho)
        v = m.evaluate(model, loss_fn, batches, progress=False, distributed=distributed).value
        evaluations.append((rho, v))
        bar.update(1)
        return v

    def close(v: float) -> bool:
        return abs(v - target) <= rtol * target

    with bar:
        v_low, v_high = value(low), value(high)
        while v_low > target and not close(v_low):
            low, high, v_high = low / 10, low, v_low
            v_low = value(low)
        while v_high < target and not close(v_high):
            low, v_low, high = high, v_high, high * 10
            v_high = value(high)
        for rho, v in ((low, v_low), (high, v_high)):
            if close(v):
                return Calibration(rho, v, target, chosen.name, evaluations)
        while True:
            mid = math.sqrt(low * high)
            v = value(mid)
            if close(v):
                return Calibration(mid, v, target, chosen.name, evaluations)
            if v < target:
                low = mid
            else:
                high = mid
