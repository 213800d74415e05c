r"""RK4 for the geodesic equation ``ẍ = a(x, ẋ)``, the rule that picks its step count, its check.

:func:`rk4` integrates a second-order ODE whose state is a tuple of tensors (one per factor);
:func:`steps_for` chooses the number of steps from the rate ``κ = max ||Γ(u, u)|| / ||u||``
of the velocity (metric norms at the base point, the maximum over the batch), the one
number that sets the time scale of ``ẍ = -Γ(ẋ, ẋ)``: RK4's relative error at ``t = 1``
behaves as ``c (κ / N)⁴``. Measured on the GL metrics over random points and horizontal and
general velocities of metric norm up to 3: ``c ≤ 0.15`` for ``inv``; for ``mix`` ``c ≤ 1.3``
on well-conditioned points and up to about 5 where a factor's condition number is 10 (the
rate grows along such paths). The rule ``N = ⌈κ (C / rtol)^{1/4}⌉`` with ``C = 16`` gives a
relative error of the end point (to the displacement ``γ(1) - x``) below ``rtol`` there:
``1e-8`` in float64, ``1e-5`` otherwise, on most paths; but the rate is read at the start
only, and on rare mix paths (7 of 1200 paths drawn as in the accuracy test of the
geodesics: factor condition numbers up to 10, metric norms up to 1.5) it grows enough along
the way that the rule's count misses ``rtol`` by up to tens of times. So an automatic count is
checked (:func:`controlled`): the end point is compared with a run of half the steps, and the
count grows until the estimated error is below ``rtol / 2``, or until the two runs agree to
their rounding (a displacement small against the point, in float32, cannot be resolved to
``rtol``: there more steps would add rounding, not accuracy). ``steps=`` (or ``exp_steps``)
fixes the count and skips the check.

Both the rate and the error estimate are metric norms at the start point, so the count is a
function of GL-invariant quantities: a point and its copy moved along the orbit (by a group
that acts linearly on the coordinates, as every shipped one does) take the same steps, and
their end points are equivariant to rounding, not merely to ``rtol``. The stated accuracy is
accordingly ``||γ(1) − γ_N(1)||_x ≤ rtol ||γ_N(1) − x||_x`` in the metric at ``x``. Only the
rounding floor is Euclidean (rounding happens in the coordinates); where it decides
differently at two points of an orbit, both runs agree to their rounding anyway.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch

Tensor = torch.Tensor

__all__ = ["MAX_STEPS", "RTOL", "LeftManifold", "controlled", "rk4", "rtol_for", "steps_for"]

RTOL = {torch.float64: 1e-8}
DEFAULT_RTOL = 1e-5
ERROR_CONSTANT = 16.0
MAX_STEPS = 1024


class LeftManifold(ValueError):
    """An RK4 run left the manifold (a factor lost rank) before its end time."""


def rtol_for(dtype: torch.dtype) -> float:
    """The stated relative accuracy of an automatic step count in ``dtype``."""
    return RTOL.get(dtype, DEFAULT_RTOL)


def steps_for(rate: float, dtype: torch.dtype) -> int:
    """``N = ⌈κ (C / rtol)^{1/4}⌉`` (at least 1) for the rate ``κ`` of a velocity (module doc).

    Raises a ``ValueError`` for a non-finite rate; warns and returns :data:`MAX_STEPS` above it.
    """
    if not math.isfinite(rate):
        raise ValueError(
            f"the tangent vector or the point is not finite (rate ||Γ(u, u)|| / ||u|| = {rate})"
        )
    n = max(1, math.ceil(rate * (ERROR_CONSTANT / rtol_for(dtype)) ** 0.25))
    if n > MAX_STEPS:
        warnings.warn(
            f"the geodesic needs {n} RK4 steps for its stated accuracy; using {MAX_STEPS} "
            "(a very long tangent vector: shorten it, or pass steps=)",
            RuntimeWarning,
            stacklevel=3,
        )
        return MAX_STEPS
    return n


def controlled(
    run: Callable[[int], tuple[Tensor, Tensor]],
    n: int,
    x: Tensor,
    ndim: int,
    norm: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """``run(N)`` (``(γ(t), γ'(t))`` in ``N`` RK4 steps) with ``N ≥ n`` large enough that the
    estimated relative error of the end point is below :func:`rtol_for` its dtype, or at the
    end point's rounding where that is larger.

    The error of ``y_N`` is estimated from a run with ``M = ⌊N/2⌋`` steps (Richardson; RK4's
    error goes as ``N⁻⁴``): ``e_N ≈ ||y_M − y_N||_x / ((N/M)⁴ − 1)``, relative to the
    displacement ``||y_N − x||_x``. ``norm(w)`` measures a displacement ``w`` per batch entry;
    a manifold passes its metric norm at the start point ``x``, so that the estimate, and with
    it every count, is the same at every point of an orbit of a group that acts linearly (``x``
    and ``g · x`` take the same steps, and the end points are equivariant to rounding, not to
    the integrator's error); the default is the Euclidean norm over the trailing ``ndim``
    dimensions. ``N`` is accepted where, for every point of the batch, ``e_N`` is below half
    the tolerance (the estimate is asymptotic) or the two runs differ by no more than their
    rounding, ``||y_M − y_N|| ≤ 4 √N ε ||y_N||`` (Euclidean norms over the trailing ``ndim``
    dimensions, the coordinates being what is rounded; ``ε`` the dtype's machine epsilon): a
    displacement that is small against the point, in float32 say, cannot be resolved to
    ``rtol``, and more steps would only add rounding. Where this floor decides differently at
    two points of an orbit, both end points are within rounding of each other. Else ``N`` grows
    by the factor ``(2 e_N / rtol)^{1/4}`` (with a margin) and the last run is the new
    reference. A run that leaves the manifold (:class:`LeftManifold`) is the integrator's error
    too (the exact geodesic may stay inside while a coarse RK4 path steps out near a singular
    point): ``N`` doubles and the run is repeated. The reference runs without gradient: the
    cost is ``1.5 N`` steps where the rule's count suffices. At :data:`MAX_STEPS` it warns with
    the estimated error and stops, or re-raises where a run whose count cannot double within
    the cap leaves the manifold.
    """
    rtol, dims = rtol_for(x.dtype), tuple(range(-ndim, 0))
    eps = torch.finfo(x.dtype).eps

    def euclidean(w: Tensor) -> Tensor:
        return torch.linalg.vector_norm(w, dim=dims)

    measure = euclidean if norm is None else norm
    n = min(max(n, 2), MAX_STEPS)
    m = n // 2
    while True:
        try:
            with torch.no_grad():
                reference = run(m)[0]
            break
        except LeftManifold:
            if n >= MAX_STEPS:
                raise
            m, n = n, min(MAX_STEPS, 2 * n)
    while True:
        try:
            out = run(n)
        except LeftManifold:
            if n >= MAX_STEPS:
                raise
            n = min(MAX_STEPS, 2 * n)
            continue
        with torch.no_grad():
            y = out[0]
            gap, moved = measure(y - reference), measure(y - x)
            ratio = gap / ((n / m) ** 4 - 1) / (0.5 * rtol * moved)
            rounding = euclidean(y - reference) <= 4 * math.sqrt(n) * eps * euclidean(y)
            ratio = torch.where((moved > 0) & ~rounding, ratio, 0.0)
            worst = float(ratio.max()) if ratio.numel() else 0.0
        if worst <= 1.0:
            return out
        if n >= MAX_STEPS or not math.isfinite(worst):
            warnings.warn(
                f"the geodesic's estimated relative error is {worst * rtol / 2:.1e} at {n} RK4 "
                f"steps, above {rtol:.0e} (a very long tangent vector: shorten it, or pass "
                "steps=)",
                RuntimeWarning,
                stacklevel=4,
            )
            return out
        reference, m = y.detach(), n
        n = min(MAX_STEPS, math.ceil(n * 1.2 * worst**0.25))


def rk4(
    acceleration: Callable[..., tuple[Tensor, ...]],
    y: tuple[Tensor, ...],
    v: tuple[Tensor, ...],
    t: Tensor | float,
    steps: int,
) -> tuple[Tensor, ...]:
    """Classical RK4 for ``ÿ = acceleration(*y, *v)`` over ``[0, t]`` in ``steps`` equal steps.

    ``y`` and ``v`` are tuples of tensors (position and velocity, one entry per factor) and
    ``acceleration`` returns a tuple like ``v``; ``t`` is a number or a tensor that broadcasts
    against them (per-point end times). Returns ``(*y(t), *v(t))``. A ``ValueError`` raised by
    ``acceleration`` (the path left the manifold) is re-raised as :class:`LeftManifold` with the
    step it happened in.
    """
    dt = t / steps

    def shifted(base, slope, scale):
        return tuple(b + scale * s for b, s in zip(base, slope, strict=True))

    for step in range(steps):
        try:
            a1 = acceleration(*y, *v)
            v2 = shifted(v, a1, 0.5 * dt)
            a2 = acceleration(*shifted(y, v, 0.5 * dt), *v2)
            v3 = shifted(v, a2, 0.5 * dt)
            a3 = acceleration(*shifted(y, v2, 0.5 * dt), *v3)
            v4 = shifted(v, a3, dt)
            a4 = acceleration(*shifted(y, v3, dt), *v4)
        except ValueError as err:
            raise LeftManifold(
                f"the geodesic left the manifold during RK4 step {step + 1}/{steps} (the "
                "tangent vector is too long for this point, or the step count too low): "
                "use a shorter vector or more steps"
            ) from err
        y = tuple(
            yi + (dt / 6) * (vi + 2 * v2i + 2 * v3i + v4i)
            for yi, vi, v2i, v3i, v4i in zip(y, v, v2, v3, v4, strict=True)
        )
        v = tuple(
            vi + (dt / 6) * (b1 + 2 * b2 + 2 * b3 + b4)
            for vi, b1, b2, b3, b4 in zip(v, a1, a2, a3, a4, strict=True)
        )
    return (*y, *v)
