"""Independent oracles for Christoffel symbols: autodiff of a dense metric matrix (torch alone)
and geomstats' autodiff Christoffel symbols (geomstats on its pytorch backend, imported only
when called)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

Tensor = torch.Tensor
MetricMatrix = Callable[[Tensor], Tensor]

__all__ = ["autodiff_christoffel", "geomstats_christoffel", "gl_metric_matrix"]


def autodiff_christoffel(metric_matrix: MetricMatrix, x: Tensor, u: Tensor) -> Tensor:
    """``Γ(u, u) = M⁻¹ [DM[u] u - ½ ∇ₓ(uᵀ M u)]`` from a dense metric matrix ``M(x)``.

    ``metric_matrix`` maps a flat float64 point of length ``N`` to its ``N × N`` metric matrix;
    its derivative is taken by :func:`torch.autograd.functional.jacobian`, independently of the
    library's code paths. ``x`` and ``u`` are single (unbatched) points/vectors of any shape.
    """
    xf = x.detach().double().reshape(-1)
    uf = u.detach().double().reshape(-1)
    M = metric_matrix(xf)
    # J[i, j, k] = ∂M_ij / ∂x_k
    J = torch.autograd.functional.jacobian(metric_matrix, xf, vectorize=True)
    assert isinstance(J, Tensor)
    dMuu = torch.einsum("ijk,k,j->i", J, uf, uf)
    grad = torch.einsum("i,ijk,j->k", uf, J, uf)
    return torch.linalg.solve(M, dMuu - 0.5 * grad).reshape(u.shape)


def gl_metric_matrix(n: int, h: int, metric: str, eps: float = 0.0) -> MetricMatrix:
    """Dense flattened GL(h) metric (``"inv"`` or ``"mix"``) for a row-major flattened
    ``[G; H]`` with ``n`` rows in ``G``.

    ``tr(W η_Gᵀ ζ_G) = Σ_i η_{G,i} W ζ_{G,i}ᵀ`` over rows, so the G block is ``I_n ⊗ W``.
    """

    def metric_matrix(xf: Tensor) -> Tensor:
        x = xf.reshape(-1, h)
        G, H = x[:n], x[n:]
        eye = torch.eye(h, dtype=xf.dtype)
        P = G.T @ G + eps * eye
        Q = H.T @ H + eps * eye
        WG, WH = (torch.linalg.inv(P), torch.linalg.inv(Q)) if metric == "inv" else (Q, P)
        return torch.block_diag(
            torch.kron(torch.eye(G.shape[0], dtype=xf.dtype), WG.contiguous()),
            torch.kron(torch.eye(H.shape[0], dtype=xf.dtype), WH.contiguous()),
        )

    return metric_matrix


def geomstats_christoffel(metric_matrix: MetricMatrix, x: Tensor, u: Tensor) -> Tensor:
    """``Γ^k_ij u^i u^j`` from geomstats' autodiff Christoffel symbols of ``metric_matrix``.

    Needs geomstats on its pytorch backend (``GEOMSTATS_BACKEND=pytorch`` before geomstats is
    first imported): raises ``ImportError`` without geomstats and ``RuntimeError`` on
    another backend.
    """
    gs = importlib.import_module("geomstats.backend")  # resolved at run time by geomstats
    from geomstats.geometry.euclidean import Euclidean
    from geomstats.geometry.riemannian_metric import RiemannianMetric

    if not gs.__name__.endswith("pytorch"):
        raise RuntimeError(f"geomstats runs on {gs.__name__}, not its pytorch backend")

    class DenseMetric(RiemannianMetric):
        def metric_matrix(self, base_point=None):
            assert base_point is not None
            return metric_matrix(base_point)

    xf = x.detach().double().reshape(-1)
    uf = u.detach().double().reshape(-1)
    metric = DenseMetric(Euclidean(xf.numel(), equip=False))
    gamma = metric.christoffels(xf)  # [k, i, j], contravariant index first
    return torch.einsum("kij,i,j->k", gamma, uf, uf).reshape(u.shape)
