r"""The extreme eigenvalues of the Riemannian Hessian: Lanczos (ARPACK), LOBPCG, the lean
Lanczos recurrence, or dense.

The whitened operator is symmetric, with the quotient Hessian's eigenvalues on the horizontal
space and zeros on the vertical directions, so a Euclidean eigensolver on
:meth:`~quotientgeo.curvature.RiemannianHessian.to_scipy` finds them: SciPy's ``eigsh``
(implicitly restarted Lanczos, ARPACK) or ``lobpcg``; for models too large for ARPACK's vectors,
the three-term recurrence in torch with two vectors (:mod:`quotientgeo.curvature.lanczos`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from ..geometry import ParameterGeometry
from ..manifolds import BallDamping
from ..validation import integer, positive_int, positive_real
from .lanczos import lanczos_extreme
from .operator import _SymmetricOperator
from .result import BlockEigenvalues, EigenvalueResult
from .run import measured, settings_of

Tensor = torch.Tensor

__all__ = ["hessian_eigenvalues"]

METHODS = ("lanczos", "lobpcg", "exact", "lanczos_lean")
WHICH = ("largest", "smallest")
#: A group of at most this many coordinates is solved densely (``dim`` products).
DENSE_MAX = 64


def hessian_eigenvalues(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batches: Iterable,
    *,
    k: int = 1,
    which: str = "largest",
    method: str = "lanczos",
    tol: float = 1e-6,
    max_iter: int | None = None,
    seed: int = 0,
    per_block: bool = False,
    symmetries: str | ParameterGeometry | None = "auto",
    metric: str | float | None = None,
    geometry: str = "riemannian",
    eps: float | BallDamping | None = None,
    product: str = "double_backward",
    step: float | None = None,
    progress: bool = True,
) -> EigenvalueResult:
    r"""The ``k`` largest (or smallest) eigenvalues of the Riemannian Hessian of the
    batch-averaged loss on the quotient (:class:`~quotientgeo.curvature.RiemannianHessian`).

    Invariant under the symmetries of the declared blocks; ``geometry="euclidean"`` gives the
    eigenvalues of the plain ``∇²f`` (PyHessian's, hessian-eigenthings'), which are not. At a
    critical point worst-case geodesic sharpness is ``½ ρ² λ_max + O(ρ³)``. The vertical
    directions are zero eigenvalues: the smallest eigenvalues of a model at a minimum are
    zeros.

    Args:
        model: the network; read only (restored bit-exactly, also on errors).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        batches: an iterable of batches, read once; ``f`` is the mean loss over them.
        k: how many eigenvalues (``k < D`` for ``"lanczos"``, ``k = 1`` for
            ``"lanczos_lean"``).
        which: ``"largest"`` (algebraic, largest first) or ``"smallest"`` (smallest first).
        method: ``"lanczos"`` (``scipy.sparse.linalg.eigsh``), ``"lobpcg"``
            (``scipy.sparse.linalg.lobpcg``, ``k`` vectors per product) or ``"exact"`` (the
            dense ``D × D`` matrix: small models), or ``"lanczos_lean"``: the Lanczos
            three-term recurrence ``β_j v_{j+1} = A v_j - α_j v_j - β_{j-1} v_{j-1}`` in torch
            on the operator's device and dtype, not re-orthogonalised, with two vectors of
            size ``D`` alive (``v_j`` and ``v_{j-1}``, in which the finite-difference product
            forms ``A v_j - β_{j-1} v_{j-1}``; three for double backward) where ARPACK keeps
            ``max(2k + 1, 20)``; the tridiagonal ``T_j`` on the host. It stops when the
            extreme Ritz value ``θ`` (``T_j y = θ y``) has ``|β_j y_j| ≤ tol · |θ|``, the
            residual of its Ritz vector (an eigenvalue lies within it; the result's
            ``residual_bound``), or after ``max_iter`` products (a ``RuntimeWarning``).
            Without re-orthogonalisation converged values reappear as ghost copies in
            ``T_j``: the extreme one still converges, the inner ones are not reliable, so it
            gives ``k = 1`` only. For models whose vectors are large (a 1.1B model in
            float32: 4.4 GB a vector). SciPy not needed.
        tol: relative accuracy asked of the solver.
        max_iter: the solver's iteration limit (``None``: its default; ``min(D, 300)``
            products for ``"lanczos_lean"``).
        seed: seed of the starting vectors.
        per_block: also the eigenvalues of each group's diagonal block (a layer's attention
            pairs, adapters, the rest): one more solve per group (groups of at most
            ``DENSE_MAX`` coordinates densely).
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
    k = positive_int("k", k)
    if which not in WHICH:
        raise ValueError(f"which must be 'largest' or 'smallest', got {which!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}")
    if method == "lanczos_lean" and k != 1:
        raise ValueError(
            f"method='lanczos_lean' gives one eigenvalue (k=1), got k={k}: without "
            "re-orthogonalisation the inner Ritz values include ghost copies of converged ones; "
            "use method='lanczos' or 'lobpcg' for several"
        )
    tol = positive_real("tol", tol)
    if max_iter is not None:
        max_iter = positive_int("max_iter", max_iter)
    seed = integer("seed", seed)
    if not isinstance(per_block, bool):
        raise TypeError(f"per_block must be True or False, got {per_block!r}")
    t0 = time.perf_counter()
    with measured(
        model, loss_fn, batches, symmetries=symmetries, metric=metric, geometry=geometry,
        eps=eps, product=product, step=step, progress=progress,
        description=f"Hessian eigenvalues ({method})",
    ) as hessian:  # fmt: skip
        if k > hessian.dim or (method == "lanczos" and k >= hessian.dim):
            raise ValueError(
                f"k={k} eigenvalues of an operator of size {hessian.dim}: method='lanczos' "
                "needs k < D; use method='exact' for all of them"
            )
        values, bound = _solve(hessian, k, which, method, tol, max_iter, seed)
        per = None
        if per_block:
            per = []
            for g in hessian.groups:
                block = hessian.restricted(g)
                dense = method == "exact" or g.dim <= max(DENSE_MAX, k + 1)
                found, block_bound = _solve(
                    block, min(k, g.dim), which, "exact" if dense else method, tol, max_iter, seed
                )
                per.append(BlockEigenvalues(g.name, g.layer, g.kind, g.dim, found, block_bound))
    settings = settings_of(
        hessian, metric, product=product, measure="hessian_eigenvalues", k=k, which=which,
        method=method, tol=tol, max_iter=max_iter, seed=seed,
    )  # fmt: skip
    return EigenvalueResult(
        values=values,
        per_block=per,
        loss=hessian.loss,
        settings=settings,
        products=hessian.products,
        wall_time=time.perf_counter() - t0,
        residual_bound=bound,
    )


def _solve(
    op: _SymmetricOperator,
    k: int,
    which: str,
    method: str,
    tol: float,
    max_iter: int | None,
    seed: int,
) -> tuple[list[float], float | None]:
    """The ``k`` extreme eigenvalues of ``op``, largest first or smallest first, and the
    residual bound of ``"lanczos_lean"``'s (``None`` for the other methods)."""
    n = op.shape[0]
    if method == "lanczos_lean":
        found = lanczos_extreme(
            op, largest=which == "largest", tol=tol, max_iter=max_iter or min(n, 300), seed=seed
        )
        return [found.value], found.residual_bound
    if method == "exact":
        values = torch.linalg.eigvalsh(op.to_dense()).cpu().numpy()
    else:
        try:
            from scipy.sparse.linalg import eigsh, lobpcg
        except ImportError as err:
            raise ImportError(
                f"method={method!r} uses SciPy: pip install scipy (or "
                "'quotientgeo[curvature]'), or pass method='exact' for a small model"
            ) from err
        rng = np.random.default_rng(seed)
        A = op.to_scipy()
        if method == "lanczos":
            v0 = rng.standard_normal(n).astype(A.dtype)
            side = "LA" if which == "largest" else "SA"
            # scipy's annotation says tol: int; it is a float
            options: dict[str, Any] = {"tol": tol, "maxiter": max_iter, "v0": v0}
            values = eigsh(A, k=k, which=side, return_eigenvectors=False, **options)
        else:
            X = rng.standard_normal((n, k)).astype(A.dtype)
            largest = which == "largest"
            values, _ = lobpcg(A, X, largest=largest, tol=tol, maxiter=max_iter or 200)
    ordered = np.sort(np.asarray(values, dtype=float))
    chosen = ordered[::-1][:k] if which == "largest" else ordered[:k]
    return [float(v) for v in chosen], None
