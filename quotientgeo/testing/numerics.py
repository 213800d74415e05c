"""Numerical helpers of the test-suite: tolerances in machine epsilons, relative errors, seeded
generators and random matrices of a prescribed condition number.

Tolerances are stated in units of the dtype's machine epsilon (``tol(dtype, k)`` is
``k · eps``) and, where an operation involves a conditioned matrix, scaled by its condition
number, so that the same property is checked at the same strictness in float32 and float64.
Random matrices are built in float64 and cast at the end.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

__all__ = [
    "conditioned",
    "eps_of",
    "gen",
    "orthogonal",
    "randn",
    "rel",
    "rel_err",
    "relative_change",
    "tol",
    "well_conditioned",
]


def eps_of(dtype: torch.dtype) -> float:
    """Machine epsilon of ``dtype``."""
    return torch.finfo(dtype).eps


def tol(dtype: torch.dtype, k: float = 100.0) -> float:
    """``k`` machine epsilons of ``dtype``."""
    return k * eps_of(dtype)


def rel_err(a: Tensor, b: Tensor, event_dims: int = 2) -> float:
    """Largest (over batch entries) ``||a - b|| / ||b||``, computed in float64; the norms run
    over the last ``event_dims`` dimensions."""
    a, b = a.double(), b.double()
    dims = tuple(range(-event_dims, 0))
    num = torch.linalg.vector_norm(a - b, dim=dims)
    den = torch.linalg.vector_norm(b, dim=dims).clamp_min(torch.finfo(torch.float64).tiny)
    return (num / den).max().item()


def rel(a: Tensor, b: Tensor) -> float:
    """``||a - b|| / ||b||`` over the whole tensor (not per batch entry)."""
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def relative_change(a: float, b: float) -> float:
    """``|a - b| / |b|``."""
    return abs(a - b) / abs(b)


def gen(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed_gen: torch.Generator, dtype: torch.dtype = torch.float64) -> Tensor:
    """Standard normal entries drawn in float64 from ``seed_gen``, cast to ``dtype``: the same
    numbers (up to rounding) in every dtype."""
    return torch.randn(*shape, generator=seed_gen, dtype=torch.float64).to(dtype)


def orthogonal(*shape: int, g: torch.Generator) -> Tensor:
    """Random matrices with orthonormal columns, ``shape = (..., r, c)``, ``r >= c`` (float64)."""
    q, r = torch.linalg.qr(torch.randn(*shape, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)


def conditioned(
    batch: tuple[int, ...],
    rows: int,
    cols: int,
    cond: float,
    g: torch.Generator,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """``U diag(s) Vᵀ`` with log-spaced singular values from 1 down to ``1/cond`` (float64 build).

    The spectrum is rescaled to geometric mean 1 so that entries stay of order one.
    """
    k = min(rows, cols)
    U = orthogonal(*batch, rows, k, g=g)
    V = orthogonal(*batch, cols, k, g=g)
    if k > 1:
        s = torch.logspace(0.0, -math.log10(cond), k, dtype=torch.float64)
    else:
        s = torch.ones(1, dtype=torch.float64)
    s = s / s.log().mean().exp()
    return ((U * s) @ V.transpose(-1, -2)).to(dtype)


def well_conditioned(
    generator: torch.Generator, batch: tuple[int, ...], rows: int, cols: int
) -> Tensor:
    """``U diag(σ) Vᵀ`` with orthonormal ``U`` (rows×cols), ``σ ∈ [0.5, 2]``: condition ≤ 4
    (float64)."""
    U = torch.linalg.qr(torch.randn(*batch, rows, cols, generator=generator, dtype=torch.float64))[
        0
    ]
    V = torch.linalg.qr(torch.randn(*batch, cols, cols, generator=generator, dtype=torch.float64))[
        0
    ]
    sigma = 0.5 + 1.5 * torch.rand(*batch, 1, cols, generator=generator, dtype=torch.float64)
    return (U * sigma) @ V.transpose(-1, -2)
