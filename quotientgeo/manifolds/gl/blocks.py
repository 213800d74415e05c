"""Block arithmetic of GL points ``x = [G; H]``: the block-wise right multiplication
``(u_G W_G, u_H W_H)`` and the ``h × h`` products every metric's Christoffel coefficients are
formed from.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...linalg import matmul_add, transformed

Tensor = torch.Tensor

__all__ = ["Coefficients", "FactorCoefficients", "Products", "blockwise", "factor_products"]

FactorCoefficients = tuple[Tensor, Tensor, "Tensor | None"]
Coefficients = tuple[FactorCoefficients, FactorCoefficients]


class Products(NamedTuple):
    """The ``h × h`` products of a GL point and tangent vectors ``u``, ``v`` that every metric's
    Christoffel coefficients are formed from (``GLQuotient.gamma_coefficients``).

    ``uF = (u_Gᵀ G, u_Hᵀ H)``, ``vF = (v_Gᵀ G, v_Hᵀ H)``, ``uv = (u_Gᵀ v_G, u_Hᵀ v_H)``; the
    Gram matrices ``P = GᵀG + eps·I``, ``Q = HᵀH + eps·I`` and their inverses.
    """

    P: Tensor
    Q: Tensor
    P_inv: Tensor
    Q_inv: Tensor
    uF: tuple[Tensor, Tensor]
    vF: tuple[Tensor, Tensor]
    uv: tuple[Tensor, Tensor]


def blockwise(
    n: int, u: Tensor, W_G: Tensor, W_H: Tensor, add: Tensor | None = None, *, into: bool = False
) -> Tensor:
    """``(u_G W_G, u_H W_H)``, plus ``add`` if given, for ``h × h`` blocks ``W_G``, ``W_H`` and
    ``u = [u_G; u_H]`` with ``n`` rows in ``u_G``.

    ``into=True`` accumulates into ``add`` in place (a contiguous intermediate of the full
    shape that the caller owns) and returns it. Memory traffic, not arithmetic, dominates
    here: when ``G`` and ``H`` have the same shape, ``[G; H]`` is viewed as a batch of
    ``2·heads`` factors and the result is a single batched product with the addition fused
    in; otherwise the two row blocks are separate products: on an accelerator each written
    into its rows of the output (a strided batched product), on the CPU into a tensor of its
    own, the two concatenated (or added to ``add``'s rows).
    """
    rows, h = u.shape[-2:]
    shapes = [u.shape[:-2], W_G.shape[:-2], W_H.shape[:-2]]
    if add is not None:
        shapes.append(add.shape[:-2])
    # equal batch shapes are the common case; broadcast_shapes costs more than the product
    batch = shapes[0] if all(s == shapes[0] for s in shapes) else torch.broadcast_shapes(*shapes)
    u = u.expand(*batch, rows, h)
    W_G, W_H = W_G.expand(*batch, h, h), W_H.expand(*batch, h, h)
    if rows == 2 * n:
        W = torch.stack((W_G, W_H), dim=-3).reshape(-1, h, h)
        u = u.reshape(-1, n, h)
        if add is None:
            return torch.bmm(u, W).view(*batch, rows, h)
        if not into:
            add = add.expand(*batch, rows, h).reshape(-1, n, h)
            return torch.baddbmm(add, u, W).view(*batch, rows, h)
        add.view(-1, n, h).baddbmm_(u, W)
        return add
    if not _rows_written_in_place(u, W_G, W_H):
        uG, uH = u[..., :n, :], u[..., n:, :]
        if add is None:
            return torch.cat((uG @ W_G, uH @ W_H), dim=-2)
        if into:
            add[..., :n, :].add_(uG @ W_G)
            add[..., n:, :].add_(uH @ W_H)
            return add
        add = add.expand(*batch, rows, h)
        return torch.cat(
            (matmul_add(add[..., :n, :], uG, W_G), matmul_add(add[..., n:, :], uH, W_H)), -2
        )
    # each product into its rows of one output; a new one is not read (``beta = 0``), where two
    # products and their concatenation would write it twice
    beta = 1.0 if add is not None else 0.0
    if add is None:
        add = torch.empty_like(u, memory_format=torch.contiguous_format)
    elif not into:
        add = add.expand(*batch, rows, h).clone(memory_format=torch.contiguous_format)
    flat, u = add.view(-1, rows, h), u.reshape(-1, rows, h)
    flat[:, :n].baddbmm_(u[:, :n], W_G.reshape(-1, h, h), beta=beta)
    flat[:, n:].baddbmm_(u[:, n:], W_H.reshape(-1, h, h), beta=beta)
    return add


def _rows_written_in_place(*tensors: Tensor) -> bool:
    """Whether :func:`blockwise` writes a non-square point's two products into the rows of one
    output (strided batched products): on an accelerator, whose batched products take any
    batch stride. Not on the CPU, where ATen writes a strided output one dispatched matrix
    product at a time (up to four times slower than into new tensors and a concatenation),
    nor under ``torch.func``, which has no batching rule for writes into a tensor made inside
    the transform."""
    return tensors[0].device.type != "cpu" and not transformed(*tensors)


def factor_products(n: int, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(a_Gᵀ b_G, a_Hᵀ b_H)``, ``h × h`` per factor, for ``a = [a_G; a_H]`` and ``b`` with ``n``
    rows in the ``G`` block: one batched product over ``2·heads`` factors where ``a`` and ``b``
    have the same shape and ``G`` and ``H`` as many rows, else one per factor (broadcast)."""
    rows, h = a.shape[-2:]
    if a.shape == b.shape and rows == 2 * n:
        both = torch.bmm(a.reshape(-1, n, h).mT, b.reshape(-1, n, h))
        G, H = both.view(*a.shape[:-2], 2, h, h).unbind(-3)
        return G, H
    return a[..., :n, :].mT @ b[..., :n, :], a[..., n:, :].mT @ b[..., n:, :]
