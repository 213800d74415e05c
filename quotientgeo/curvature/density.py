r"""The spectral density of the Riemannian Hessian by stochastic Lanczos quadrature (ours).

For a unit probe ``v`` and the symmetric whitened operator ``A``, ``m`` Lanczos steps from
``v`` give an ``m × m`` tridiagonal ``T = Qᵀ A Q`` (``Q`` the orthonormal Krylov basis, here
re-orthogonalised in full against every earlier vector, twice). With ``T = Y diag(θ) Yᵀ`` the
nodes ``θ_j`` and weights ``w_j = Y_{0j}²`` are the Gauss quadrature of the measure
``Σ_i (u_iᵀ v)² δ(λ - λ_i)``: ``Σ_j w_j θ_j^k = vᵀ A^k v`` for ``k ≤ 2m - 1``. Rademacher
probes over ``√D`` have ``E[(u_iᵀ v)²] = 1/D``, so the mean over probes estimates the
density ``(1/D) Σ_i δ(λ - λ_i)`` (Lin, Saad & Yang 2016; Ghorbani, Krishnan & Xiao 2019;
Papyan 2020). All probes run as the columns of one product per step, sharing each batch's
forward and first backward pass.

A probe whose Krylov space closes early (``β_j`` below ``√ε`` of the largest ``β``, an invariant
subspace) continues with a zero vector: its nodes beyond are zeros of weight zero, and its
quadrature stays exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..geometry import ParameterGeometry
from ..manifolds import BallDamping
from ..validation import integer, positive_int
from .operator import _SymmetricOperator
from .result import BlockSpectrum, Spectrum, SpectrumResult
from .run import measured, settings_of

Tensor = torch.Tensor

__all__ = ["hessian_density", "lanczos_quadrature"]


def hessian_density(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batches: Iterable,
    *,
    n_probes: int = 4,
    n_steps: int = 64,
    seed: int = 0,
    per_block: bool = False,
    symmetries: str | ParameterGeometry | None = "auto",
    metric: str | float | None = None,
    geometry: str = "riemannian",
    eps: float | BallDamping | None = None,
    product: str = "double_backward",
    step: float | None = None,
    progress: bool = True,
) -> SpectrumResult:
    r"""The spectral density of the Riemannian Hessian of the batch-averaged loss on the
    quotient, by stochastic Lanczos quadrature (module docstring).

    The result holds each probe's nodes and weights (:class:`~quotientgeo.curvature.Spectrum`);
    :meth:`~quotientgeo.curvature.SpectrumResult.density` smooths them into a curve. The
    vertical directions contribute their mass at 0.

    Args:
        model: the network; read only (restored bit-exactly, also on errors).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        batches: an iterable of batches, read once; ``f`` is the mean loss over them.
        n_probes: Rademacher probes (Lanczos runs, all in the same products).
        n_steps: Lanczos steps per probe (``≤ D``): nodes per probe; the products computed are
            ``n_probes · n_steps``.
        seed: seed of the probes.
        per_block: also the density of each group's diagonal block (a layer's attention pairs,
            adapters, the rest): one more run per group, with ``min(n_steps, dim)`` steps.
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
        progress: a progress bar over the batch passes, on a terminal.
    """
    n_probes = positive_int("n_probes", n_probes)
    n_steps = positive_int("n_steps", n_steps)
    seed = integer("seed", seed)
    if not isinstance(per_block, bool):
        raise TypeError(f"per_block must be True or False, got {per_block!r}")
    t0 = time.perf_counter()
    with measured(
        model, loss_fn, batches, symmetries=symmetries, metric=metric, geometry=geometry,
        eps=eps, product=product, step=step, progress=progress,
        description="Hessian density (Lanczos)",
        plan=None if per_block else lambda dim: [n_probes] * min(n_steps, dim),
    ) as hessian:  # fmt: skip
        spectrum = lanczos_quadrature(hessian, n_probes, min(n_steps, hessian.dim), seed)
        per = None
        if per_block:
            per = []
            for g in hessian.groups:
                block = hessian.restricted(g)
                found = lanczos_quadrature(block, n_probes, min(n_steps, g.dim), seed)
                per.append(BlockSpectrum(g.name, g.layer, g.kind, g.dim, found))
    settings = settings_of(
        hessian,
        metric,
        product=product,
        measure="hessian_density",
        n_probes=n_probes,
        n_steps=n_steps,
        seed=seed,
    )
    return SpectrumResult(
        spectrum=spectrum,
        per_block=per,
        loss=hessian.loss,
        settings=settings,
        products=hessian.products,
        wall_time=time.perf_counter() - t0,
    )


def lanczos_quadrature(op: _SymmetricOperator, n_probes: int, n_steps: int, seed: int) -> Spectrum:
    """Nodes and weights of ``n_steps`` Lanczos steps from ``n_probes`` Rademacher probes of the
    symmetric operator ``op`` (module docstring), all probes in each product."""
    D, dtype, device = op.shape[0], op.dtype, op.device
    if n_steps > D:
        raise ValueError(f"n_steps={n_steps} exceeds the operator's size {D}")
    gen = torch.Generator(device=device).manual_seed(seed)
    v = torch.randint(0, 2, (D, n_probes), generator=gen, device=device).to(dtype) * 2 - 1
    v = v / math.sqrt(D)
    basis = torch.zeros(n_steps, D, n_probes, dtype=dtype, device=device)
    alpha = torch.zeros(n_steps, n_probes, dtype=dtype, device=device)
    beta = torch.zeros(n_steps, n_probes, dtype=dtype, device=device)
    tiny = math.sqrt(torch.finfo(dtype).eps)
    for j in range(n_steps):
        basis[j] = v
        w = op @ v
        alpha[j] = (w * v).sum(0)
        for _ in range(2):  # full re-orthogonalisation, twice ("twice is enough")
            Q = basis[: j + 1]
            w = w - (Q * (Q * w).sum(1, keepdim=True)).sum(0)
        if j == n_steps - 1:
            break
        beta[j] = torch.linalg.vector_norm(w, dim=0)
        scale = beta[: j + 1].amax(0).clamp_min(alpha[: j + 1].abs().amax(0))
        alive = beta[j] > tiny * scale
        beta[j] = torch.where(alive, beta[j], 0)
        v = torch.where(alive, w / torch.where(alive, beta[j], 1), 0)
    T = torch.diag_embed(alpha.T)
    if n_steps > 1:
        off = beta[:-1].T
        T = T + torch.diag_embed(off, offset=1) + torch.diag_embed(off, offset=-1)
    nodes, vectors = torch.linalg.eigh(T)
    weights = vectors[:, 0, :] ** 2
    return Spectrum(nodes=nodes, weights=weights, dim=D)
