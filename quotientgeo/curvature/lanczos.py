r"""The extreme eigenvalue of a symmetric operator by the Lanczos three-term recurrence, with
two vectors of the operator's size: for models whose vectors are too large to keep many.

From a random unit ``v_1`` (``β_0 = 0``), step ``j`` computes

    ``w = A v_j - β_{j-1} v_{j-1}``,  ``α_j = w·v_j``,  ``w ← w - α_j v_j``,
    ``β_j = ‖w‖``,  ``v_{j+1} = w / β_j``,

in torch on the operator's device and dtype (``v_{j-1}`` is dropped as soon as it is
subtracted), and the tridiagonal ``T_j`` (``α`` on the diagonal, ``β`` beside it) on the host in
float64. With ``T_j y = θ y`` (``‖y‖ = 1``, ``θ`` the extreme Ritz value), the Ritz vector
``x = V_j y`` has the residual ``‖A x - θ x‖ = |β_j y_j|`` (``y_j`` the last entry of ``y``):
an eigenvalue of ``A`` lies within it of ``θ``. The run stops when
``|β_j y_j| ≤ tol · |θ|``, when ``β_j`` vanishes (an invariant subspace: ``θ`` is exact), or
after ``max_iter`` products.

No vector is re-orthogonalised. In floating point the Lanczos vectors then lose their
orthogonality once a Ritz value converges, and the converged value reappears in ``T_j`` as
duplicate ("ghost") copies; the extreme Ritz value still converges to the extreme eigenvalue
and its residual bound stays valid up to ``O(ε ‖A‖)`` (Paige 1976; Parlett, *The Symmetric
Eigenvalue Problem*, ch. 13). The inner eigenvalues, among which the ghosts sit, are not
reliable: this solver gives one eigenvalue. Its memory is the operator's product and two
vectors (``v_j`` and ``v_{j-1}``, into which ``A v_j - β_{j-1} v_{j-1}`` is formed by the
operator's ``addmv_``: the finite-difference
:class:`~quotientgeo.curvature.RiemannianHessian` forms it there without a third vector),
against ARPACK's ``max(2k + 1, 20)``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from ..validation import integer, positive_int, positive_real
from .operator import _SymmetricOperator

Tensor = torch.Tensor

__all__ = ["LanczosEigenvalue", "lanczos_extreme"]


@dataclasses.dataclass(frozen=True)
class LanczosEigenvalue:
    """The extreme Ritz value of :func:`lanczos_extreme`.

    Attributes:
        value: ``θ``, the largest (or smallest) eigenvalue of ``T_j``.
        residual_bound: ``|β_j y_j|``, the residual of its Ritz vector: an eigenvalue of the
            operator lies within it of ``value``.
        iterations: products computed (``j``).
        converged: whether ``residual_bound ≤ tol · |value|`` (or the Krylov space closed).
    """

    value: float
    residual_bound: float
    iterations: int
    converged: bool


def lanczos_extreme(
    op: _SymmetricOperator,
    *,
    largest: bool = True,
    tol: float = 1e-6,
    max_iter: int = 300,
    seed: int = 0,
) -> LanczosEigenvalue:
    """The largest (or smallest) eigenvalue of the symmetric ``op`` by the Lanczos three-term
    recurrence without re-orthogonalisation (module docstring), from a standard normal start
    drawn with ``seed`` on ``op``'s device. Warns (``RuntimeWarning``) where ``max_iter``
    products do not reach ``tol``, and returns the value reached with its bound."""
    tol = positive_real("tol", tol)
    max_iter = positive_int("max_iter", max_iter)
    seed = integer("seed", seed)
    D, dtype, device = op.shape[0], op.dtype, op.device
    gen = torch.Generator(device=device).manual_seed(seed)
    v = torch.randn(D, generator=gen, dtype=dtype, device=device)
    v.div_(torch.linalg.vector_norm(v))
    previous: Tensor | None = None
    alphas: list[float] = []
    betas: list[float] = []  # β_1 … β_j
    # β_j below this (relative to ‖T_j‖) is an invariant subspace: the recurrence stops
    tiny = math.sqrt(torch.finfo(dtype).eps)
    theta, bound, converged = math.nan, math.inf, False
    for _ in range(max_iter):
        # A v_j - β_{j-1} v_{j-1} formed in v_{j-1}'s storage, where the operator can
        if previous is None:
            w = op.addmv_(torch.empty_like(v), v, beta=0.0)
        else:
            w = op.addmv_(previous, v, beta=-betas[-1])
            previous = None  # now w's storage
        alpha = torch.dot(w, v)
        w.addcmul_(v, alpha, value=-1)
        beta = torch.linalg.vector_norm(w)
        a, b = torch.stack([alpha, beta]).tolist()  # the step's one read on the host
        alphas.append(a)
        betas.append(b)
        theta, y_last = _extreme_ritz(alphas, betas[:-1], largest)
        bound = abs(b * y_last)
        scale = max(max(map(abs, alphas)), max(betas))
        if b <= tiny * scale:  # A v_j lies in the Krylov space: θ is an eigenvalue of A
            converged = True
            break
        if bound <= tol * abs(theta):
            converged = True
            break
        previous, v = v, w.div_(b)
    if not converged:
        warnings.warn(
            f"Lanczos did not reach tol={tol:g} in {len(alphas)} products: the eigenvalue "
            f"{theta:.6g} has the residual bound {bound:.3g} ({bound / abs(theta):.2g} "
            "relative); raise max_iter for more",
            RuntimeWarning,
            stacklevel=3,
        )
    return LanczosEigenvalue(theta, bound, len(alphas), converged)


def _extreme_ritz(alphas: list[float], betas: list[float], largest: bool) -> tuple[float, float]:
    """``(θ, y_j)``: the extreme eigenvalue of the tridiagonal ``T_j`` (diagonal ``alphas``,
    off-diagonal ``betas``) and the last entry of its unit eigenvector, in float64."""
    a = torch.tensor(alphas, dtype=torch.float64)
    b = torch.tensor(betas, dtype=torch.float64)
    T = torch.diag(a)
    if len(betas):
        T = T + torch.diag(b, 1) + torch.diag(b, -1)
    values, vectors = torch.linalg.eigh(T)
    i = -1 if largest else 0
    return float(values[i]), float(vectors[-1, i])
