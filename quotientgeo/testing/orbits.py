"""Moves of a model along the orbits of its symmetry blocks, by well-conditioned group elements.

A move along orbits changes the parameters but not the function the model computes; a measure
of sharpness defined on the quotient must not change either.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from ..geometry import ParameterGeometry, find_symmetries
from ..manifolds.groups import DEFAULT_CONDITION, check_condition, random_element

Tensor = torch.Tensor

__all__ = ["move_along_orbits_", "moved_along_orbits"]


def move_along_orbits_(
    geometry: ParameterGeometry,
    *,
    scale: float = 1.0,
    generator: torch.Generator | None = None,
    condition: float = DEFAULT_CONDITION,
) -> list:
    """Move every block of ``geometry.model`` along its orbit, in place: ``x ↦ g · x``.

    ``g = manifold.random_group(x, scale=scale, condition=condition)`` per kind (one element
    per head), applied with ``manifold.act``: this works for every manifold that defines
    ``act``. The shipped groups draw well-conditioned elements, ``cond(g) ≤ condition``:
    ``A = scale · U diag(σ) Vᵀ`` for GL(h) (``U``, ``V`` Haar-random orthogonal, ``σ``
    log-uniform in ``[c^{-1/2}, c^{1/2}]``), complex scalings of modulus in that range on rotary
    pairs, factors ``scale · a`` with ``a`` log-uniform in that range for (re-)scalings. A GL
    pair's Gram matrices ``GᵀG``, ``HᵀH`` then have condition numbers at most ``condition²``
    times the original ones. A product of overlapping blocks (a
    :class:`~quotientgeo.ProductQuotient` kind) moves along the whole product group: ``g`` is
    then a tuple of one element per part. A user's ``random_group`` without the ``condition``
    keyword is called without it.

    The moved points are checked with the manifold's point check (finite entries; for GL pairs
    ``cond(G)²``, ``cond(H)² < 1 / eps`` of the dtype): where one fails, the model is restored
    and a ``ValueError`` names the kind, the reason and what to do (compute in float64, or a
    smaller ``condition``). In float32 (``1 / eps ≈ 8.4e6``) a head whose Gram matrix already
    has condition ``κ`` moves safely only while ``κ · condition² ≪ 8.4e6``.

    Returns:
        The group elements, one per kind.
    """
    condition = check_condition(condition)
    points, _ = geometry.gather()
    manifolds = geometry.manifolds()
    elements = [
        random_element(m, x, generator=generator, scale=scale, condition=condition)
        for m, x in zip(manifolds, points, strict=True)
    ]
    moved = [m.act(x, g) for m, x, g in zip(manifolds, points, elements, strict=True)]
    for i, (m, x, y) in enumerate(zip(manifolds, points, moved, strict=True)):
        ok, reason = m._check_point_on_manifold(y.detach())
        if not ok:
            was_ok, _ = m._check_point_on_manifold(x.detach())
            before = "" if was_ok else " (the point was already refused before the move)"
            raise ValueError(
                f"moving kind {i} ({m!r}, points {tuple(x.shape)}, {x.dtype}) along its orbit with "
                f"condition={condition:g} gave points its geometry refuses{before}: {reason}; "
                "compute in float64 or pass a smaller condition"
            )
    geometry.assign_(moved)
    return elements


def moved_along_orbits(
    model: nn.Module,
    *,
    scale: float = 1.0,
    seed: int = 0,
    symmetries: Callable[[nn.Module], ParameterGeometry] | None = None,
    condition: float = DEFAULT_CONDITION,
) -> nn.Module:
    """A deep copy of ``model`` moved along the orbits of ``symmetries(copy)`` (default:
    :func:`~quotientgeo.find_symmetries`) by :func:`move_along_orbits_` with group elements of
    condition number at most ``condition`` (default 4), times ``scale``, drawn from ``seed``.
    ``scale < 0`` leaves the identity component (outside the group for positive scalings)."""
    model = copy.deepcopy(model)
    geometry = find_symmetries(model, warn=False) if symmetries is None else symmetries(model)
    move_along_orbits_(
        geometry,
        scale=scale,
        generator=torch.Generator().manual_seed(seed),
        condition=condition,
    )
    return model
