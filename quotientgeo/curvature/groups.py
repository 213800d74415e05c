"""The blocks of the curvature figures: coordinates grouped by layer and by kind of block.

The operator's coordinates are the points of each kind of symmetry blocks (flattened head by
head, kind after kind) and then the adaptive rest ``w``. A group collects, for one layer, the
coordinates of one kind of block:

- ``"attention"``: the QK and VO pairs that discovery declares (labels ending in ``.QK`` or
  ``.VO``);
- ``"adapter"``: LoRA adapters (labels with a ``.lora`` component);
- ``"scale"``: the scalings of normalized query/key heads (labels ending in ``_scale``);
- ``"symmetry"``: any other declared block (your own ``ParameterGeometry.add``);
- ``"rest"``: the adaptive rest, by the parameter its entries belong to.

The layer is the first numeric component of the block's label or the parameter's name
(``encoder.layers.3.self_attn.QK`` → 3), ``None`` where there is none (an embedding, the
classifier): those form one group per kind of their own.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from ..geometry import ParameterGeometry

Tensor = torch.Tensor

__all__ = ["KINDS", "Group", "groups_of"]

#: The kinds of block, in the order the figures list them.
KINDS = ("attention", "adapter", "scale", "symmetry", "rest")

_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclasses.dataclass(frozen=True, eq=False)
class Group:
    """The coordinates of one kind of block in one layer.

    Attributes:
        name: ``"layer 3 attention"``, or the kind alone where there is no layer.
        layer: the layer index, or ``None``.
        kind: one of ``KINDS``.
        index: the group's coordinates (positions in the operator's vectors), ascending.
    """

    name: str
    layer: int | None
    kind: str
    index: Tensor

    @property
    def dim(self) -> int:
        """Number of coordinates."""
        return self.index.numel()


def _kind_of(label: str) -> str:
    if label.endswith((".QK", ".VO")):
        return "attention"
    if ".lora" in f".{label}":
        return "adapter"
    if label.endswith("_scale"):
        return "scale"
    return "symmetry"


def _layer_of(name: str) -> int | None:
    match = _LAYER.search(name)
    return None if match is None else int(match.group(1))


def groups_of(geometry: ParameterGeometry, device: torch.device) -> list[Group]:
    """The groups of ``geometry``'s coordinates (module docstring), by layer (``None`` last),
    then in the order of ``KINDS``."""
    ranges: dict[tuple[int | None, str], list[tuple[int, int]]] = {}
    offset = 0
    for ki, kind in enumerate(geometry.kinds):
        size = math.prod(kind.shape)
        for i in range(kind.batch):
            where = geometry.locate(ki, i)
            key = (where.layer, _kind_of(where.label))
            ranges.setdefault(key, []).append((offset + i * size, offset + (i + 1) * size))
        offset += kind.batch * size
    plan = geometry.plan
    for name, size in zip(plan.rest_names, plan.adaptive_sizes, strict=True):
        ranges.setdefault((_layer_of(name), "rest"), []).append((offset, offset + size))
        offset += size

    def order(key: tuple[int | None, str]) -> tuple:
        layer, kind = key
        return (layer is None, -1 if layer is None else layer, KINDS.index(kind))

    out = []
    for key in sorted(ranges, key=order):
        layer, kind = key
        index = torch.cat([torch.arange(a, b, device=device) for a, b in ranges[key]])
        name = kind if layer is None else f"layer {layer} {kind}"
        out.append(Group(name, layer, kind, index))
    return out
