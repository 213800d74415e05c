"""The frozen plan of a parameter geometry: blocks, kinds, and how parameters are reassembled.

Built once from the declared blocks (:func:`build_plan`, linear in their number); gather and
scatter only read it.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from dataclasses import dataclass

import torch

from ..manifolds import QuotientManifold
from .layout import Layout, Region, Source, View
from .product import Product, Span

Tensor = torch.Tensor

__all__ = [
    "Block",
    "Concat",
    "HeadLocation",
    "Kind",
    "Patch",
    "Piece",
    "Plan",
    "Segment",
    "Stack",
    "build_plan",
]

# a numeric component of a module path (``encoder.layer.3.attention``): the layer index
_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True, eq=False)
class Block:
    """A declared symmetry: ``heads`` points of shape ``shape`` on ``manifold``.

    ``factors`` are the sources as declared (each a tuple stacked as rows); ``regions`` the
    same sources resolved, in row order: head ``i``'s point stacks ``region.to_factor`` of
    every region along rows.
    """

    label: str
    manifold: QuotientManifold
    heads: int
    factors: tuple[tuple[Source, ...], ...]
    regions: tuple[Region, ...]

    @property
    def shape(self) -> tuple[int, int]:
        """Point shape of one head, ``(Σ k, h)``."""
        return sum(r.k for r in self.regions), self.regions[0].width

    def layout_key(self) -> tuple:
        """Equal for blocks that read the same regions of same-shaped parameters."""
        return self.heads, tuple(
            (r.axis, r.group, r.k, r.rows, r.cols, r.view) for r in self.regions
        )


@dataclass(frozen=True)
class Kind:
    """Blocks on equal manifolds with equal point shapes, stored as one batched tensor.

    With ``product`` set, the kind is a product of overlapping blocks instead: one point
    ``(1, D)`` holding the union of their entries, on ``product.manifold``.
    """

    manifold: QuotientManifold
    shape: tuple[int, ...]  # point shape of one head
    blocks: tuple[int, ...]  # indices into Plan.blocks
    sizes: tuple[int, ...]  # heads contributed by each block
    product: Product | None = None

    @property
    def batch(self) -> int:
        return 1 if self.product is not None else sum(self.sizes)

    def describe(self) -> str:
        group = self.manifold.group_name(self.shape)
        return f"{group} on {self.manifold!r}, point {(self.batch, *self.shape)}"


@dataclass(frozen=True)
class HeadLocation:
    """Where one batch entry (head) of a kind's points lives in the model.

    ``kind`` and ``index``: the entry, ``points[kind][index]``; ``block``: the index of its
    block in ``Plan.blocks``, ``label`` that block's label and ``head`` the head within
    it; ``layer``: the first numeric component of the label's module path
    (``encoder.layer.3.attention.self.QK`` -> 3), ``None`` when it has none; ``params``: the
    canonical names of the parameters that hold the entry (or the requested rows of it), in
    row order.
    """

    kind: int
    index: int
    block: int
    label: str
    head: int
    layer: int | None
    params: tuple[str, ...]

    def __str__(self) -> str:
        layer = "" if self.layer is None else f" (layer {self.layer})"
        return f"{self.label}{layer}, head {self.head}"


@dataclass(frozen=True)
class Piece:
    """Region ``index`` of block ``block``."""

    block: int
    index: int
    region: Region


@dataclass(frozen=True)
class Concat:
    """A parameter tiled by regions along ``dim`` of its view: one concatenation."""

    dim: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Segment:
    """The entries ``span`` of a parameter in the point of product kind ``kind``."""

    kind: int
    span: Span


@dataclass(frozen=True)
class Patch:
    """A parameter partly covered (or in a pattern that is no tiling): slice scatters of
    ``pieces``, then masked scatters of product ``segments``."""

    pieces: tuple[Piece, ...]
    segments: tuple[Segment, ...] = ()


@dataclass(frozen=True)
class Stack:
    """Parameters of all layers from one concatenation along ``dim`` of per-layer regions.

    ``sources`` are ``(kind, region index)`` pairs; ``names[i]`` is the parameter of the
    ``i``-th block of those kinds.
    """

    dim: int
    sources: tuple[tuple[int, int], ...]
    names: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    """Everything gather and scatter need, fixed when the blocks are.

    ``assembly`` says how each covered parameter is rebuilt; ``stacks`` (or ``None``) the same
    batched over layers, for the parameters that no product touches (``product_names`` are
    those that only products cover); ``adaptive_names`` are the wholly uncovered parameters
    and ``partial`` the masks of uncovered entries of partly covered ones (over their views,
    on the parameter's device); ``segments`` lists, per product kind, where its point's
    entries go, and ``segment_masks`` holds the masks of the segments that cover a parameter
    partly (on the parameter's device), by ``(kind, name)``.
    """

    blocks: tuple[Block, ...]
    kinds: tuple[Kind, ...]
    assembly: dict[str, Concat | Patch]
    stacks: tuple[Stack, ...] | None
    adaptive_names: tuple[str, ...]
    partial: dict[str, Tensor]
    adaptive_sizes: tuple[int, ...]
    views: dict[str, View]
    segments: dict[int, tuple[Segment, ...]]
    segment_masks: dict[tuple[int, str], Tensor]
    product_names: tuple[str, ...]

    @property
    def rest_names(self) -> tuple[str, ...]:
        """The parameters of the adaptive vector ``w`` in its order, one per entry of
        :attr:`adaptive_sizes`: the wholly adaptive ones, then the partly covered ones."""
        return self.adaptive_names + tuple(self.partial)

    def locate(self, kind: int, index: int, rows: tuple[int, int] | None = None) -> HeadLocation:
        """The block, head and parameters of entry ``index`` of kind ``kind``'s points.

        A kind's points stack the heads of its blocks in :attr:`Kind.blocks` order. ``rows``
        (``(start, stop)`` rows of the entry's point, e.g. the ``G`` rows of a GL pair)
        restricts :attr:`HeadLocation.params` to the parameters holding those rows.
        """
        k = self.kinds[kind]
        if not 0 <= index < k.batch:
            raise IndexError(f"kind {kind} has {k.batch} entries, got index {index}")
        starts = list(itertools.accumulate(k.sizes, initial=0))
        position = bisect.bisect_right(starts, index) - 1
        bi = k.blocks[position]
        block = self.blocks[bi]
        start, stop = (0, block.shape[0]) if rows is None else rows
        names, offset = [], 0
        for r in block.regions:
            if offset < stop and start < offset + r.k and r.name not in names:
                names.append(r.name)
            offset += r.k
        match = _LAYER.search(block.label)
        layer = None if match is None else int(match.group(1))
        return HeadLocation(
            kind, index, bi, block.label, index - starts[position], layer, tuple(names)
        )


def build_plan(layout: Layout, blocks: list[Block], products: tuple[Product, ...] = ()) -> Plan:
    """Group ``blocks`` into kinds and plan the reassembly of every parameter.

    The parts of ``products`` form no kinds of their own: each product is one kind.
    """
    part_of = {b: product for product in products for b in product.parts}
    members: dict[tuple, list[int]] = {}
    for bi, block in enumerate(blocks):
        if bi in part_of:
            key = ("product", id(part_of[bi]))
        else:
            key = (block.manifold.geometry_key(), block.shape)
        members.setdefault(key, []).append(bi)
    kinds = []
    for bis in members.values():
        product = part_of.get(bis[0])
        if product is None:
            first = blocks[bis[0]]
            kinds.append(
                Kind(first.manifold, first.shape, tuple(bis), tuple(blocks[b].heads for b in bis))
            )
        else:
            kinds.append(
                Kind(
                    product.manifold,
                    (product.size,),
                    product.parts,
                    tuple(blocks[b].heads for b in product.parts),
                    product,
                )
            )
    kinds = tuple(kinds)
    adaptive_names = tuple(n for n in layout.params if n not in layout.regions)
    holes = {n: layout.uncovered(n) for n in layout.regions}
    uncovered = {n: mask for n, mask in holes.items() if mask is not None}
    adaptive_sizes = tuple(layout.params[n].numel() for n in adaptive_names) + tuple(
        int(mask.sum()) for mask in uncovered.values()
    )
    # the masks live on their parameter's device: gather/scatter index with them on every call
    partial = {n: m.to(layout.params[n].device) for n, m in uncovered.items()}
    pieces: dict[str, list[Piece]] = {}
    for bi, block in enumerate(blocks):
        if bi in part_of:
            continue
        for j, region in enumerate(block.regions):
            pieces.setdefault(region.name, []).append(Piece(bi, j, region))
    segments: dict[int, tuple[Segment, ...]] = {}
    by_name: dict[str, list[Segment]] = {}
    segment_masks: dict[tuple[int, str], Tensor] = {}
    for ki, kind in enumerate(kinds):
        if kind.product is None:
            continue
        segments[ki] = tuple(Segment(ki, span) for span in kind.product.spans)
        for seg in segments[ki]:
            by_name.setdefault(seg.span.name, []).append(seg)
            if seg.span.mask is not None:
                device = layout.params[seg.span.name].device
                segment_masks[ki, seg.span.name] = seg.span.mask.to(device)
    assembly: dict[str, Concat | Patch] = {}
    for name in layout.views:
        ps, segs = pieces.get(name, []), tuple(by_name.get(name, ()))
        view = layout.views[name].shape
        by_rows = sorted(ps, key=lambda p: p.region.rows)
        by_cols = sorted(ps, key=lambda p: p.region.cols)
        if not segs and name not in partial and _tiles(by_rows, 0, view):
            assembly[name] = Concat(0, tuple(by_rows))
        elif not segs and name not in partial and _tiles(by_cols, 1, view):
            assembly[name] = Concat(1, tuple(by_cols))
        else:
            assembly[name] = Patch(tuple(ps), segs)
    product_names = tuple(
        n for n, how in assembly.items() if isinstance(how, Patch) and not how.pieces
    )
    return Plan(
        blocks=tuple(blocks),
        kinds=kinds,
        assembly=assembly,
        stacks=_stack_layers(blocks, kinds, assembly, product_names),
        adaptive_names=adaptive_names,
        partial=partial,
        adaptive_sizes=adaptive_sizes,
        views=dict(layout.views),
        segments=segments,
        segment_masks=segment_masks,
        product_names=product_names,
    )


def _tiles(pieces: list[Piece], axis: int, view: tuple[int, int]) -> bool:
    """Do the regions, sorted along ``axis``, tile the matrix as full slabs along ``axis``?"""
    other = 1 - axis
    pos = 0
    for p in pieces:
        r = p.region
        span, full = (r.rows, r.cols) if axis == 0 else (r.cols, r.rows)
        if span[0] != pos or full != (0, view[other]):
            return False
        pos = span[1]
    return pos == view[axis]


def _stack_layers(blocks, kinds, assembly, product_names=()) -> tuple[Stack, ...] | None:
    """The scatter batched over layers, or ``None`` (then scatter goes block by block).

    Possible when every kind is homogeneous (all its blocks lay out the same regions of
    same-shaped parameters) and every covered parameter is a concatenation of regions taken
    at one block position: then each (kind, region) is formed for all layers at once, and the
    parameters of all layers come from one ``cat`` and ``unbind``. Product kinds and the
    parameters only they cover (``product_names``) are left aside: scatter fills those from
    the products' points.
    """
    position = {}
    for ki, kind in enumerate(kinds):
        if kind.product is not None:
            continue
        if len({blocks[b].layout_key() for b in kind.blocks}) != 1:
            return None
        for i, b in enumerate(kind.blocks):
            position[b] = (ki, i)
    groups: dict[tuple, dict[int, str]] = {}
    for name, how in assembly.items():
        if name in product_names:
            continue
        at = {position[p.block][1] for p in how.pieces}
        if isinstance(how, Patch) or len(at) != 1:
            return None
        key = (how.dim, tuple((position[p.block][0], p.index) for p in how.pieces))
        groups.setdefault(key, {})[at.pop()] = name
    stacks = []
    for (dim, sources), names in groups.items():
        n = len(names)
        if sorted(names) != list(range(n)):
            return None
        if any(len(kinds[ki].blocks) != n for ki, _ in sources):
            return None
        stacks.append(Stack(dim, sources, tuple(names[i] for i in range(n))))
    return tuple(stacks)


def n_entries(kinds: tuple[Kind, ...]) -> int:
    """Parameter entries covered by the kinds (a product's shared entries once)."""
    return sum(k.batch * math.prod(k.shape) for k in kinds)
