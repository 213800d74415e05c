"""Helpers shared by tests, examples, experiments and docs: a tiny transformer classifier and
moves of a model along the orbits of its symmetry blocks.

A move along orbits changes the parameters but not the function the model computes; a
measure of sharpness defined on the quotient must not change either.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .geometry import ParameterGeometry, find_symmetries

Tensor = torch.Tensor

__all__ = [
    "TinyTransformerClassifier",
    "cross_entropy",
    "move_along_orbits_",
    "moved_along_orbits",
    "random_batches",
]


class TinyTransformerClassifier(nn.Module):
    """``nn.TransformerEncoder`` (``layers`` × ``heads`` heads of width ``d / heads``, feed-forward
    width ``dim_feedforward``, default ``2d``), mean pooling over the sequence and a linear
    head: inputs ``(batch, seq, d)``, logits ``(batch, classes)``."""

    def __init__(
        self,
        d: int = 32,
        heads: int = 4,
        layers: int = 2,
        classes: int = 3,
        *,
        dim_feedforward: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d, heads, dim_feedforward or 2 * d, dropout=dropout, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(x).mean(dim=1))


def cross_entropy(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """``loss_fn(model, (x, y))`` of a classifier: mean cross-entropy."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def random_batches(
    n: int,
    *,
    batch: int = 16,
    seq: int = 8,
    d: int = 32,
    classes: int = 3,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> list[tuple[Tensor, Tensor]]:
    """``n`` batches of Gaussian inputs ``(batch, seq, d)`` and uniform labels."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, seq, d, generator=gen, dtype=dtype),
            torch.randint(0, classes, (batch,), generator=gen),
        )
        for _ in range(n)
    ]


def move_along_orbits_(
    geometry: ParameterGeometry,
    *,
    scale: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[Tensor]:
    """Move every block of ``geometry.model`` along its orbit, in place: ``x ↦ g · x``.

    ``g = manifold.random_group(x, scale=scale)`` per kind (one element per head), applied with
    ``manifold.act``: this works for every manifold that defines ``act``. A product of
    overlapping blocks (a :class:`~quotientgeo.ProductQuotient` kind) moves along the whole
    product group: ``g`` is then a tuple of one element per part. Returns the group
    elements.
    """
    points, _ = geometry.gather()
    manifolds = geometry.manifolds()
    elements = [
        m.random_group(x, generator=generator, scale=scale)
        for m, x in zip(manifolds, points, strict=True)
    ]
    geometry.assign_([m.act(x, g) for m, x, g in zip(manifolds, points, elements, strict=True)])
    return elements


def moved_along_orbits(
    model: nn.Module,
    *,
    scale: float = 1.0,
    seed: int = 0,
    symmetries: Callable[[nn.Module], ParameterGeometry] | None = None,
) -> nn.Module:
    """A deep copy of ``model`` moved along the orbits of ``symmetries(copy)`` (default:
    :func:`~quotientgeo.find_symmetries`) by :func:`move_along_orbits_`."""
    model = copy.deepcopy(model)
    geometry = find_symmetries(model, warn=False) if symmetries is None else symmetries(model)
    move_along_orbits_(geometry, scale=scale, generator=torch.Generator().manual_seed(seed))
    return model
