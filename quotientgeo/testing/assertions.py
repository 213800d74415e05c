"""Assertions of the test-suite: geodesic sharpness invariant along orbits, exact
gather/scatter round trips, a model's state untouched, perturbation parts that read and write
like the geometry.

Each raises :class:`AssertionError` with the offending values; none needs pytest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..geometry import ParameterGeometry
from .numerics import relative_change

Tensor = torch.Tensor

__all__ = [
    "ORBIT_CONDITION",
    "SHARPNESS_RTOL",
    "assert_parts_read_and_write_like_the_geometry",
    "assert_roundtrip_exact",
    "assert_same",
    "assert_sharpness_invariance",
    "snapshot",
]

#: Condition number of the group elements of the orbit moves in
#: :func:`assert_sharpness_invariance`: far from the identity (a scalar multiple of the
#: identity leaves adaptive sharpness unchanged too), well inside float64.
ORBIT_CONDITION = 100.0

#: Relative change of geodesic sharpness allowed along an orbit in float64. Measured changes
#: are below 1e-11 (mostly 0 to 7e-13); the moved point rounded to float32 in the perturbation
#: gives changes of 1.5e-9 to 1.5e-6 in the suite's float64 cases, which this bound catches.
SHARPNESS_RTOL = 1e-9


def assert_sharpness_invariance(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batches: Any,
    outputs: Callable[[nn.Module], Tensor],
    *,
    rho: float,
    n_iter: int,
    scales: Sequence[float],
    output_tol: dict[str, float] | None = None,
    adaptive_min: float,
    condition: float = ORBIT_CONDITION,
    rtol: float = SHARPNESS_RTOL,
) -> None:
    """Moving ``model`` along its orbits keeps its function and geodesic sharpness, not
    adaptive sharpness.

    ``model`` is moved by :func:`~quotientgeo.testing.moved_along_orbits` with each of
    ``scales``, group elements of condition number up to ``condition``. Asserted: the move keeps
    ``outputs(model)`` (to ``output_tol``, keyword arguments of
    :func:`torch.testing.assert_close`, default float64 exact: ``rtol=1e-9, atol=1e-10``) and
    geodesic sharpness for both metrics (to ``rtol`` relative, default
    ``SHARPNESS_RTOL``), while adaptive sharpness changes by more than ``adaptive_min``
    relative for at least one scale.
    """
    from .. import adaptive_sharpness, geodesic_sharpness
    from .orbits import moved_along_orbits

    def measures(m: nn.Module) -> dict[str, float]:
        kw: dict[str, Any] = dict(rho=rho, n_iter=n_iter, progress=False)
        return {
            "mix": geodesic_sharpness(m, loss_fn, batches, metric="mix", **kw).value,
            "inv": geodesic_sharpness(m, loss_fn, batches, metric="inv", **kw).value,
            "adaptive": adaptive_sharpness(m, loss_fn, batches, **kw).value,
        }

    tolerance: dict[str, Any] = dict(rtol=1e-9, atol=1e-10) if output_tol is None else output_tol
    reference = measures(model)
    assert all(v > 0 for v in reference.values()), reference
    adaptive_changes = []
    for i, scale in enumerate(scales):
        moved = moved_along_orbits(model, scale=scale, seed=i, condition=condition)
        torch.testing.assert_close(outputs(moved), outputs(model), **tolerance)
        values = measures(moved)
        for metric in ("mix", "inv"):
            change = relative_change(values[metric], reference[metric])
            assert change <= rtol, (
                f"geodesic sharpness ({metric}) changed by {change:.3g} relative (> {rtol:g}) "
                f"along the orbit at scale {scale}: {values[metric]!r} vs {reference[metric]!r}"
            )
        adaptive_changes.append(relative_change(values["adaptive"], reference["adaptive"]))
    assert max(adaptive_changes) > adaptive_min, adaptive_changes


def assert_roundtrip_exact(geometry: ParameterGeometry) -> None:
    """Scatter of the gathered points rebuilds every parameter bit-exactly, and the
    layer-batched scatter agrees with the per-block one."""
    points, w = geometry.gather()
    out = geometry.scatter(points, w)
    assert set(out) == set(geometry.params)
    for name, p in geometry.params.items():
        assert out[name].dtype == p.dtype and out[name].shape == p.shape
        assert torch.equal(out[name], p), name
    if geometry.plan.stacks is not None:  # the layer-batched and the per-block paths agree
        plan = geometry.plan
        try:
            moved = [x + torch.randn_like(x) for x in points]
            geometry._plan = dataclasses.replace(plan, stacks=None)
            per_block = geometry.scatter(moved, w)
        finally:
            geometry._plan = plan
        for name, value in geometry.scatter(moved, w).items():
            assert torch.equal(value, per_block[name]), name


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Identity and a copy of every parameter, buffer and ``.grad``, and every module's mode."""
    return {
        "params": {n: (id(p), p.detach().clone()) for n, p in model.named_parameters()},
        "buffers": {n: (id(b), b.clone()) for n, b in model.named_buffers()},
        "grads": {
            n: None if p.grad is None else (id(p.grad), p.grad.clone())
            for n, p in model.named_parameters()
        },
        "modes": [m.training for m in model.modules()],
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Equal :func:`snapshot` s: the same objects with bit-equal values (NaNs in the same
    places)."""
    assert a["modes"] == b["modes"]
    for key in ("params", "buffers", "grads"):
        assert a[key].keys() == b[key].keys()
        for n in a[key]:
            if a[key][n] is None:
                assert b[key][n] is None, (key, n)
                continue
            (ia, ta), (ib, tb) = a[key][n], b[key][n]
            assert ia == ib and ta.dtype == tb.dtype, (key, n)
            assert torch.equal(ta.isnan(), tb.isnan()), (key, n)
            same = torch.equal(ta.masked_fill(ta.isnan(), 0), tb.masked_fill(tb.isnan(), 0))
            assert same, (key, n)


def assert_parts_read_and_write_like_the_geometry(
    geometry: ParameterGeometry, seed: int = 1
) -> None:
    """The parts of :class:`~quotientgeo.geometry.perturbation.Perturbations` (chunks of symmetry
    blocks, one block per chunk or all together, and pieces of the adaptive rest) read the
    points and the adaptive entries of ``geometry.gather()`` bit for bit, write random points
    back exactly as ``geometry.scatter`` places them, and cut one random draw of the kinds and
    of ``w`` into parts exactly as ``scatter`` places that draw."""
    from ..geometry.perturbation import Perturbations

    dtype = geometry.compute_dtype
    points, w = geometry.gather()
    g = torch.Generator().manual_seed(seed)
    new = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in points]
    new_w = torch.randn(w.shape, generator=g, dtype=w.dtype)
    expected = geometry.scatter(new, new_w)
    for chunk_bytes in (None, 1):
        space = Perturbations(geometry, "second_order", chunk_bytes=chunk_bytes)
        params = space.local()
        for ki, chunks in enumerate(space.chunks):
            got = torch.cat([c.read(params, dtype) for c in chunks])
            assert torch.equal(got, points[ki]) and got.dtype == points[ki].dtype
        if chunk_bytes == 1:  # one block (or one product) per chunk
            assert all(len(c.blocks) == 1 or c.heads == 1 for c in space.all_chunks())
        rest = [p.read(params, dtype) for p in space.rest]
        assert sum(r.numel() for r in rest) == w.numel()
        targets = {n: torch.zeros_like(t) for n, t in params.items()}
        for ki, chunks in enumerate(space.chunks):
            for c in chunks:
                c.write_(targets, new[ki][c.offset : c.offset + c.heads])
        for piece in space.rest:
            piece.write_(targets, piece.read(expected, dtype))
        for name, value in expected.items():
            assert torch.equal(targets[name], value), name
        # one draw per kind, then one over w, cut into the parts
        draws = list(space.random_parts(torch.Generator().manual_seed(seed)))
        g = torch.Generator().manual_seed(seed)
        kinds = [torch.randn(p.shape, generator=g, dtype=dtype) for p in points]
        flat = torch.randn(w.shape, generator=g, dtype=dtype) if w.numel() else w
        placed = geometry.scatter(kinds, flat)
        targets = {n: torch.zeros_like(t) for n, t in params.items()}
        for part, e in draws:
            part.write_(targets, e)
        for name, value in placed.items():
            assert torch.equal(targets[name], value), name
