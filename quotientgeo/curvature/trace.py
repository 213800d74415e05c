r"""The trace of the Riemannian Hessian: exact, Hutchinson, or curvlinops' Hutch++ and XTrace.

In whitened coordinates the operator ``A`` is symmetric and ``tr A = tr Hess f̄``, the sum of
the quotient Hessian's eigenvalues (the vertical directions add zeros). Hutchinson's estimator
``(1/n) Σ_p z_pᵀ A z_p`` over Rademacher probes ``z_p`` is unbiased with variance
``2 (‖A‖_F² - Σ_i A_ii²) / n``; ``std_error`` is the sample standard deviation over ``√n``.
The same probes estimate each group's diagonal-block trace ``Σ_{i∈g} A_ii`` by
``(1/n) Σ_p Σ_{i∈g} z_pi (A z_p)_i``, so ``per_block=True`` costs nothing more.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from ..geometry import ParameterGeometry
from ..manifolds import BallDamping
from ..validation import integer, positive_int
from .operator import RiemannianHessian
from .result import BlockTrace, TraceResult
from .run import group_ids, measured, settings_of

Tensor = torch.Tensor

__all__ = ["hessian_trace"]

METHODS = ("hutchinson", "exact", "hutch++", "xtrace")


def hessian_trace(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batches: Iterable,
    *,
    method: str = "hutchinson",
    n_probes: int = 100,
    seed: int = 0,
    per_block: bool = False,
    symmetries: str | ParameterGeometry | None = "auto",
    metric: str | float | None = None,
    geometry: str = "riemannian",
    eps: float | BallDamping | None = None,
    product: str = "double_backward",
    step: float | None = None,
    chunk_size: int = 16,
    progress: bool = True,
) -> TraceResult:
    r"""The trace of the Riemannian Hessian of the batch-averaged loss on the quotient,
    ``tr Hess f̄(x)`` (:class:`~quotientgeo.curvature.RiemannianHessian`).

    Invariant under the symmetries of the declared blocks; ``geometry="euclidean"`` gives the
    plain ``tr ∇²f`` that PyHessian reports, which is not.

    Args:
        model: the network; read only (restored bit-exactly, also on errors).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        batches: an iterable of batches, read once; ``f`` is the mean loss over them.
        method: ``"hutchinson"`` (Rademacher probes, ours), ``"exact"`` (``D`` products, the
            diagonal of the whole operator: small models), or curvlinops' ``"hutch++"``
            (Meyer et al. 2021) and ``"xtrace"`` (Epperly et al. 2024), which need the
            ``curvature`` extra (``pip install quotientgeo[curvature]``).
        n_probes: Hessian-vector products of the estimators (``hutch++``: a multiple of 3,
            ``xtrace``: even; both below ``D``).
        seed: seed of the probes.
        per_block: also the trace of each group's diagonal block (a layer's attention pairs,
            adapters, the rest; :mod:`quotientgeo.curvature.groups`): with ``"hutchinson"``
            and ``"exact"``.
        symmetries: the symmetries, as for :class:`~quotientgeo.curvature.RiemannianHessian`.
        metric: the quotient metric, as for :class:`~quotientgeo.curvature.RiemannianHessian`.
        geometry: ``"riemannian"`` or ``"euclidean"``, as for
            :class:`~quotientgeo.curvature.RiemannianHessian`.
        eps: the Gram relaxation, as for :class:`~quotientgeo.curvature.RiemannianHessian`.
        product: ``"double_backward"`` (exact) or ``"finite_difference"`` (central
            differences of gradients, two gradient passes per batch and product), as for
            :class:`~quotientgeo.curvature.RiemannianHessian`.
        step: the finite difference's relative step, as for
            :class:`~quotientgeo.curvature.RiemannianHessian` (``None``: its default).
        chunk_size: vectors per product (they share each batch's forward and first backward
            pass; memory grows with it).
        progress: a progress bar over the batch passes, on a terminal.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    n_probes = positive_int("n_probes", n_probes)
    seed = integer("seed", seed)
    chunk_size = positive_int("chunk_size", chunk_size)
    if not isinstance(per_block, bool):
        raise TypeError(f"per_block must be True or False, got {per_block!r}")
    if per_block and method not in ("hutchinson", "exact"):
        raise ValueError(
            f"per_block=True needs method='hutchinson' or 'exact' (one set of probes gives every "
            f"block's trace), got method={method!r}"
        )
    ours = method in ("hutchinson", "exact")
    plan = partial(_plan, method, n_probes, chunk_size) if ours else None
    t0 = time.perf_counter()
    with measured(
        model, loss_fn, batches, symmetries=symmetries, metric=metric, geometry=geometry,
        eps=eps, product=product, step=step, progress=progress,
        description=f"Hessian trace ({method})",
        plan=plan,
    ) as hessian:  # fmt: skip
        if method in ("hutch++", "xtrace"):
            value, error, blocks = _curvlinops(hessian, method, n_probes, seed), math.nan, None
        else:
            value, error, blocks = _diagonal_sums(hessian, method, n_probes, seed, chunk_size)
    per = None
    if per_block:
        assert blocks is not None
        per = [
            BlockTrace(g.name, g.layer, g.kind, g.dim, v, e)
            for g, (v, e) in zip(hessian.groups, blocks, strict=True)
        ]
    settings = settings_of(
        hessian, metric, product=product, measure="hessian_trace", method=method,
        n_probes=hessian.dim if method == "exact" else n_probes, seed=seed,
    )  # fmt: skip
    return TraceResult(
        value=value,
        std_error=error,
        per_block=per,
        loss=hessian.loss,
        settings=settings,
        products=hessian.products,
        wall_time=time.perf_counter() - t0,
    )


def _plan(method: str, n_probes: int, chunk_size: int, dim: int) -> list[int]:
    """Columns of each product of the exact or Hutchinson trace of an operator of size ``dim``."""
    n = dim if method == "exact" else n_probes
    return [min(chunk_size, n - start) for start in range(0, n, chunk_size)]


def _diagonal_sums(
    hessian: RiemannianHessian, method: str, n_probes: int, seed: int, chunk_size: int
) -> tuple[float, float, list[tuple[float, float]]]:
    """Exact or Hutchinson trace, with each group's: ``(value, std_error, per group)``."""
    D, dtype, device = hessian.dim, hessian.dtype, hessian.device
    ids = group_ids(hessian)
    n_groups = len(hessian.groups)
    if method == "exact":
        sums = torch.zeros(n_groups, dtype=dtype, device=device)
        for start in range(0, D, chunk_size):
            stop = min(D, start + chunk_size)
            E = torch.zeros(D, stop - start, dtype=dtype, device=device)
            cols = torch.arange(stop - start, device=device)
            E[start + cols, cols] = 1
            AE = hessian @ E
            sums.index_add_(0, ids[start:stop], AE[start + cols, cols])
        values = [float(s) for s in sums]
        return float(sums.sum()), 0.0, [(v, 0.0) for v in values]
    gen = torch.Generator(device=device).manual_seed(seed)
    samples = torch.zeros(n_groups, n_probes, dtype=dtype, device=device)
    for start in range(0, n_probes, chunk_size):
        k = min(chunk_size, n_probes - start)
        Z = torch.randint(0, 2, (D, k), generator=gen, device=device).to(dtype) * 2 - 1
        samples[:, start : start + k].index_add_(0, ids, Z * (hessian @ Z))
    total = samples.sum(0)

    def mean_error(x: Tensor) -> tuple[float, float]:
        error = float(x.std() / math.sqrt(n_probes)) if n_probes > 1 else math.inf
        return float(x.mean()), error

    value, error = mean_error(total)
    return value, error, [mean_error(row) for row in samples]


def _curvlinops(hessian: RiemannianHessian, method: str, n_probes: int, seed: int) -> float:
    """curvlinops' ``hutchpp_trace`` or ``xtrace`` on the operator (its probes from torch's
    global generator, seeded with ``seed`` inside a forked RNG state)."""
    try:
        from curvlinops import (  # pyright: ignore[reportMissingImports] (an optional extra)
            hutchpp_trace,
            xtrace,
        )
    except ImportError as err:
        raise ImportError(
            f"method={method!r} uses curvlinops (curvlinops-for-pytorch): "
            "pip install 'quotientgeo[curvature]'"
        ) from err
    estimator = hutchpp_trace if method == "hutch++" else xtrace
    devices = [hessian.device] if hessian.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return float(estimator(hessian, n_probes))  # pyright: ignore[reportArgumentType]
