"""Where symmetry blocks live in a model: parameter sources, their regions and coverage.

A :class:`Source` names a region ``V[rows, cols]`` of one parameter seen as a 2-D matrix
``V``; :class:`Layout` resolves sources against a model (:class:`Region`) and records which
regions blocks cover, so that overlapping declarations are refused (unless they form a product
of groups).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

Tensor = torch.Tensor

__all__ = ["Layout", "Region", "Source", "View", "overlaps"]


@dataclass(frozen=True)
class Source:
    """Where one parameter contributes rows to a factor of a symmetry block.

    The parameter is seen as a 2-D matrix ``V`` (1-D parameters of length ``L`` as ``(L, 1)``,
    2-D ones as they are, anything else through ``view``), and the region ``V[rows, cols]``
    belongs to the block. For a block with ``heads`` heads of width ``h``:

    - ``axis=0`` (the ``nn.Linear`` weight convention ``x Wᵀ``): the region's rows are the heads'
      features, ``heads·h`` of them; head ``i`` contributes ``V[rows][i·h:(i+1)·h, cols]ᵀ``, i.e.
      ``len(cols)`` rows of its factor. A bias ``b`` (``axis=0``) contributes one row ``b_i``.
    - ``axis=1`` (an output projection ``W_o[:, head columns]``): the region's columns are the
      heads' features; head ``i`` contributes ``V[rows, cols][:, i·h:(i+1)·h]``.

    ``group=r`` stacks ``r`` consecutive heads of the region into one point (grouped-query
    attention: the ``r`` query heads that share a key/value head): the region then holds
    ``heads·r·h`` features and head ``g`` contributes the parts of heads ``g·r, …, g·r+r-1``,
    stacked along rows (``r·len(cols)`` rows for ``axis=0``).

    ``interleave=(units, parts)`` reads the parameter with its view's rows regrouped from
    ``(units, parts, rest)`` order to ``(parts, units, rest)``: GPT-NeoX's ``query_key_value``
    holds ``[q_i; k_i; v_i]`` per head ``i`` and, with ``interleave=(heads, 3)``, is seen as
    ``[q; k; v]`` so that ``rows`` selects the query rows of every head. All sources on one
    parameter must view it alike.
    """

    param: str
    axis: int = 0
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None
    view: tuple[int, int] | None = None
    group: int = 1
    interleave: tuple[int, int] | None = None


@dataclass(frozen=True)
class View:
    """How a parameter is seen as a matrix: ``shape`` ``(R, C)``, rows optionally regrouped
    (``interleave=(units, parts)``: ``(units, parts, rest)`` order becomes ``(parts, units,
    rest)``, a permutation of the rows)."""

    shape: tuple[int, int]
    interleave: tuple[int, int] | None = None

    def matrix(self, param: Tensor) -> Tensor:
        """``param`` as the ``(R, C)`` matrix (a view unless rows are regrouped)."""
        m = param.reshape(self.shape)
        if self.interleave is None:
            return m
        units, parts = self.interleave
        R, C = self.shape
        return m.reshape(units, parts, R // (units * parts), C).transpose(0, 1).reshape(R, C)

    def restore(self, matrix: Tensor) -> Tensor:
        """Inverse of :meth:`matrix` for ``(..., R, C)``: the parameter's entries in its own order
        (reshape the result to the parameter's shape)."""
        if self.interleave is None:
            return matrix
        units, parts = self.interleave
        *lead, R, C = matrix.shape
        m = matrix.reshape(*lead, parts, units, R // (units * parts), C)
        return m.transpose(-4, -3).reshape(*lead, R, C)

    def edit_(self, param: Tensor, change: Callable[[Tensor], object]) -> None:
        """Change ``param`` in place through its matrix: ``change(matrix)`` writes into the
        ``(R, C)`` matrix, a view of ``param`` where one exists (contiguous, rows in order),
        else a copy that is written back."""
        if self.interleave is None and param.is_contiguous():
            change(param.view(self.shape))
            return
        matrix = self.matrix(param).clone()
        change(matrix)
        param.copy_(self.restore(matrix).reshape(param.shape))


@dataclass(frozen=True)
class Region:
    """A :class:`Source` resolved against a model: ``V[rows[0]:rows[1], cols[0]:cols[1]]``.

    Each of the block's heads reads a ``(k × width)`` matrix from it.
    """

    source: Source
    name: str  # canonical parameter name
    view: View
    rows: tuple[int, int]
    cols: tuple[int, int]
    k: int  # factor rows per head (group · rows or columns of the region)
    width: int  # head width h

    @property
    def axis(self) -> int:
        return self.source.axis

    @property
    def group(self) -> int:
        return self.source.group

    def of(self, param: Tensor) -> Tensor:
        """The region of ``param``."""
        return self.of_matrix(self.view.matrix(param))

    def of_matrix(self, matrix: Tensor) -> Tensor:
        """The region of a matrix already in the view's shape and row order."""
        return matrix[self.rows[0] : self.rows[1], self.cols[0] : self.cols[1]]

    def to_factor(self, region: Tensor, heads: int) -> Tensor:
        """Region ``(heads·r·h, c)`` (axis 0) or ``(c, heads·r·h)`` (axis 1) -> ``(heads, k, h)``
        with ``k = r·c`` (``r`` the group)."""
        r, h = self.group, self.width
        if self.axis == 0:
            c = region.shape[1]
            parts = region.reshape(heads, r, h, c).transpose(-1, -2)
        else:
            c = region.shape[0]
            parts = region.reshape(c, heads, r, h).permute(1, 2, 0, 3)
        return parts.reshape(heads, r * c, h)

    def factor_parts(self, region: Tensor, heads: int) -> Tensor:
        """:meth:`to_factor` before its last reshape, ``(heads, r, c, h)``: a view of
        ``region`` (whose rows are contiguous), where :meth:`to_factor` may copy."""
        r, h = self.group, self.width
        if self.axis == 0:
            return region.reshape(heads, r, h, region.shape[1]).transpose(-1, -2)
        return region.reshape(region.shape[0], heads, r, h).permute(1, 2, 0, 3)

    def from_factor(self, piece: Tensor) -> Tensor:
        """Inverse of :meth:`to_factor`: ``(..., heads, k, h)`` -> ``(..., *region)``."""
        *lead, heads, k, h = piece.shape
        r = self.group
        parts = piece.reshape(*lead, heads, r, k // r, h)
        if self.axis == 0:
            return parts.transpose(-1, -2).reshape(*lead, heads * r * h, k // r)
        return parts.movedim(-2, -4).reshape(*lead, k // r, heads * r * h)


class Layout:
    """The trainable parameters of a model and the regions that symmetry blocks cover.

    Keeps, across declarations, the claimed regions of each covered parameter (rectangles of
    its 2-D view, so the bookkeeping costs nothing per entry) and the view each parameter is
    seen through. :meth:`claim` costs only the new block's regions against the parameter's
    earlier ones, and a refused claim leaves the layout untouched.
    """

    def __init__(self, model: nn.Module):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.all: dict[str, nn.Parameter] = dict(model.named_parameters(remove_duplicate=False))
        canonical = {id(p): name for name, p in model.named_parameters()}
        self.canonical: dict[str, str] = {name: canonical[id(p)] for name, p in self.all.items()}
        self.params: dict[str, nn.Parameter] = {
            name: p for name, p in model.named_parameters() if p.requires_grad
        }
        self.regions: dict[str, tuple[Region, ...]] = {}  # claimed, by canonical name
        self.views: dict[str, View] = {}

    def copy(self) -> Layout:
        """An independent copy: the same parameters, its own regions and views."""
        new = copy.copy(self)
        new.regions = dict(self.regions)
        new.views = dict(self.views)
        return new

    def uncovered(self, name: str) -> Tensor | None:
        """The host boolean mask of the entries of ``name`` (over its view) that no claimed
        region covers, or ``None`` when they cover it all."""
        mask = torch.ones(self.views[name].shape, dtype=torch.bool)
        for r in self.regions[name]:
            mask[r.rows[0] : r.rows[1], r.cols[0] : r.cols[1]] = False
        return mask if bool(mask.any()) else None

    def resolve(self, src: Source, heads: int, label: str) -> Region:
        """The region of ``src`` for a block of ``heads`` heads named ``label``."""
        if src.param not in self.all:
            raise KeyError(f"{label}: the model has no parameter named {src.param!r}")
        name = self.canonical[src.param]
        if name not in self.params:
            raise ValueError(
                f"{label}: parameter {src.param!r} is frozen (requires_grad=False); "
                "only trainable parameters can form symmetry blocks"
            )
        p = self.params[name]
        view: tuple[int, int]
        if src.view is not None:
            sizes = tuple(int(s) for s in src.view)
            if math.prod(sizes) != p.numel() or len(sizes) != 2:
                raise ValueError(
                    f"{label}: view {src.view} does not fit parameter {name!r} of shape "
                    f"{tuple(p.shape)}"
                )
            view = (sizes[0], sizes[1])
        elif p.dim() in (1, 2):
            view = (p.shape[0], 1) if p.dim() == 1 else (p.shape[0], p.shape[1])
        else:
            raise ValueError(
                f"{label}: parameter {name!r} has shape {tuple(p.shape)}; "
                "give Source(view=(rows, cols))"
            )
        if src.interleave is not None:
            units, parts = (int(v) for v in src.interleave)
            if units < 1 or parts < 1 or view[0] % (units * parts):
                raise ValueError(
                    f"{label}: interleave {src.interleave} does not split the {view[0]} rows of "
                    f"{name!r}"
                )
            arranged = View(view, (units, parts))
        else:
            arranged = View(view)
        group = src.group
        if not isinstance(group, int) or isinstance(group, bool) or group < 1:
            raise ValueError(f"{label}: Source.group must be a positive int, got {group!r}")

        def bounds(span, size, what):
            start, stop = (0, size) if span is None else (int(span[0]), int(span[1]))
            if not 0 <= start < stop <= size:
                raise ValueError(
                    f"{label}: {what} {span} out of range for {name!r} viewed as {view}"
                )
            return start, stop

        rows, cols = bounds(src.rows, view[0], "rows"), bounds(src.cols, view[1], "cols")
        if src.axis not in (0, 1):
            raise ValueError(f"{label}: Source.axis must be 0 or 1, got {src.axis}")
        R, C = rows[1] - rows[0], cols[1] - cols[0]
        features, k = (R, C) if src.axis == 0 else (C, R)
        if features % (heads * group):
            what = f"{heads} heads" + (f" of {group} grouped heads" if group > 1 else "")
            raise ValueError(
                f"{label}: {features} head features of {name!r} do not split into {what}"
            )
        return Region(src, name, arranged, rows, cols, group * k, features // (heads * group))

    def claim(
        self, regions: tuple[Region, ...], label: str, *, shared: bool = False
    ) -> Callable[[], None]:
        """Mark ``regions`` as covered, or raise with nothing marked; returns a function that
        undoes the claim.

        ``shared=False`` refuses entries that another block covers already; ``shared=True``
        (a part of a product of groups) accepts them. Either way a block may not cover an
        entry twice, and every block views a parameter alike.
        """
        regions_before, views_before = dict(self.regions), dict(self.views)

        def undo() -> None:
            self.regions, self.views = dict(regions_before), dict(views_before)

        try:
            if shared:
                _refuse_self_overlap(regions, label)
            for r in regions:
                earlier = self.regions.get(r.name, ())
                if not shared and any(overlaps(r, q) for q in earlier):
                    raise ValueError(
                        f"{label}: rows {r.rows}, cols {r.cols} of {r.name!r} already belong to "
                        "another block (declare it with product=True to measure the quotient "
                        "by the product of the groups, when their actions commute)"
                    )
                self.regions[r.name] = (*earlier, r)
                view = self.views.setdefault(r.name, r.view)
                if view != r.view:
                    raise ValueError(
                        f"{label}: parameter {r.name!r} is viewed as {view} by another block "
                        f"and as {r.view} here"
                    )
        except Exception:
            undo()
            raise
        return undo


def overlaps(a: Region, b: Region) -> bool:
    """Do two regions share an entry (the same parameter, intersecting rows and columns)?"""
    return (
        a.name == b.name
        and a.rows[0] < b.rows[1]
        and b.rows[0] < a.rows[1]
        and a.cols[0] < b.cols[1]
        and b.cols[0] < a.cols[1]
    )


def _refuse_self_overlap(regions: tuple[Region, ...], label: str) -> None:
    for i, a in enumerate(regions):
        for b in regions[:i]:
            if overlaps(a, b):
                raise ValueError(
                    f"{label}: rows {a.rows}, cols {a.cols} of {a.name!r} are covered twice by "
                    "this block"
                )
