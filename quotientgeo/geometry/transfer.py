"""Gather points from parameters and scatter (perturbed) points back, following a :class:`Plan`.

:func:`gather` and :func:`scatter` move every kind at once: scatter uses differentiable
views, transposes and concatenations only (slice scatters where blocks cover parameters
partially) and never writes to the model. :func:`gather_blocks` and :func:`write_blocks_` move
some blocks of one kind, reading from and writing into tensors in parameter layout in place:
the chunks that the maximiser and the optimizer work on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch

from .layout import View
from .plan import Block, Concat, Plan, Segment
from .product import span_values

Tensor = torch.Tensor

__all__ = [
    "StackedLayout",
    "block_views",
    "gather",
    "gather_blocks",
    "scatter",
    "stacked_layout",
    "write_blocks_",
]


def _mask(plan: Plan, name: str, device: torch.device) -> Tensor:
    """Mask of the uncovered entries of ``name`` on ``device``; moved (and kept there) only
    when the model has moved since the plan was built, so steady-state calls copy nothing."""
    mask = plan.partial[name]
    if mask.device != device:
        mask = plan.partial[name] = mask.to(device)
    return mask


def _segment_mask(plan: Plan, seg: Segment, device: torch.device) -> Tensor | None:
    """Mask of a product segment's entries on ``device`` (``None``: the whole parameter)."""
    if seg.span.mask is None:
        return None
    key = seg.kind, seg.span.name
    mask = plan.segment_masks[key]
    if mask.device != device:
        mask = plan.segment_masks[key] = mask.to(device)
    return mask


def gather(
    plan: Plan,
    params: Mapping[str, Tensor],
    dtype: torch.dtype,
    device: torch.device,
    rest_dtype: torch.dtype | None = None,
) -> tuple[list[Tensor], Tensor]:
    """``(points, w)``: one ``(batch, *shape)`` tensor per kind and the flat adaptive vector,
    in ``dtype`` (``w`` in ``rest_dtype`` where given)."""

    wanted = rest_dtype or dtype
    points = [
        gather_blocks(plan, ki, range(len(kind.blocks)), params, dtype)
        for ki, kind in enumerate(plan.kinds)
    ]
    flat = [params[n].detach().reshape(-1) for n in plan.adaptive_names]
    for name in plan.partial:
        value = params[name].detach()
        mask = _mask(plan, name, value.device)
        flat.append(plan.views[name].matrix(value)[mask])
    if not flat:
        return points, torch.zeros(0, dtype=wanted, device=device)
    if all(t.dtype == wanted for t in flat):
        return points, torch.cat(flat)
    # converted into one buffer: no converted copy of each tensor besides
    w = torch.empty(sum(t.numel() for t in flat), dtype=wanted, device=flat[0].device)
    torch._foreach_copy_(list(w.split([t.numel() for t in flat])), flat)  # pyright: ignore[reportPrivateImportUsage]
    return points, w


def gather_blocks(
    plan: Plan,
    kind: int,
    blocks: range,
    tensors: Mapping[str, Tensor],
    dtype: torch.dtype,
    out: Tensor | None = None,
) -> Tensor:
    """The points of blocks ``plan.kinds[kind].blocks[i]`` for ``i`` in ``blocks``, read from
    ``tensors`` (whole tensors by parameter name) in ``dtype``: ``(Σ heads, *shape)``, a new
    tensor, or ``out`` (of that shape and ``dtype``) written in place. A product kind is read
    whole (its point ``(1, D)``), whatever ``blocks`` says."""
    if out is not None:
        congruent = None if plan.kinds[kind].product else _congruent(plan, kind, blocks, tensors)
        if congruent is not None:
            return _gather_stacked(congruent, tensors, dtype, out)
        return out.copy_(gather_blocks(plan, kind, blocks, tensors, dtype))
    k = plan.kinds[kind]
    if k.product is not None:  # the union of the parts' entries, each once
        values = []
        for seg in plan.segments[kind]:
            value = tensors[seg.span.name].detach()
            mask = _segment_mask(plan, seg, value.device)
            values.append(span_values(seg.span, value, mask).to(dtype))
        return torch.cat(values).unsqueeze(0)  # a copy, never a view of a parameter
    congruent = _congruent(plan, kind, blocks, tensors)
    if congruent is not None:
        return _gather_stacked(congruent, tensors, dtype)
    parts = []
    for i in blocks:
        block = plan.blocks[k.blocks[i]]
        rows = [
            r.to_factor(r.of(tensors[r.name].detach()), block.heads).to(dtype)
            for r in block.regions
        ]
        parts.append(torch.cat(rows, dim=1))  # a copy, never a view of a parameter
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


@torch.no_grad()
def write_blocks_(
    plan: Plan, kind: int, blocks: range, points: Tensor, tensors: Mapping[str, Tensor]
) -> None:
    """Write ``points`` of the blocks that :func:`gather_blocks` reads into ``tensors`` (whole
    tensors by parameter name), in place and cast to each tensor's dtype; entries the blocks do
    not cover keep their values."""
    k = plan.kinds[kind]
    # per parameter: its view, and the writes into its (R, C) matrix
    edits: dict[str, tuple[View, list[Callable[[Tensor], object]]]] = {}
    if k.product is not None:
        flat = points.reshape(-1)
        for seg in plan.segments[kind]:
            part = flat[seg.span.offset : seg.span.offset + seg.span.size]
            mask = _segment_mask(plan, seg, part.device)
            if mask is None:
                put = lambda m, v=part: m.view(-1).copy_(v)  # noqa: E731
            else:
                put = lambda m, v=part, mask=mask: m.masked_scatter_(mask, v.to(m.dtype))  # noqa: E731
            edits.setdefault(seg.span.name, (seg.span.view, []))[1].append(put)
    elif (congruent := _congruent(plan, kind, blocks, tensors)) is not None:
        _write_stacked(congruent, points, tensors)
        return
    else:
        sizes = [k.sizes[i] for i in blocks]
        chunks = torch.split(points, sizes) if len(sizes) > 1 else (points,)
        for i, chunk in zip(blocks, chunks, strict=True):
            block = plan.blocks[k.blocks[i]]
            for r, value in zip(block.regions, _split_regions(chunk, block), strict=True):
                put = lambda m, v=value, r=r: r.of_matrix(m).copy_(v)  # noqa: E731
                edits.setdefault(r.name, (r.view, []))[1].append(put)
    for name, (view, puts) in edits.items():
        view.edit_(tensors[name], lambda m, puts=puts: [put(m) for put in puts])


def block_views(
    plan: Plan, points: Sequence[Tensor], tensors: Mapping[str, Tensor]
) -> tuple[list[Tensor], list[Tensor]] | None:
    """Every region of every block as a pair of views: ``(in_tensors, in_points)``, one entry
    per region and block, ``in_tensors[i]`` a view of a tensor of ``tensors`` (whole tensors
    by parameter name, in parameter layout) and ``in_points[i]`` the view of ``points`` (one
    ``(Σ heads, Σk, h)`` tensor per kind) that :func:`gather` reads it into, both
    ``(heads, r, c, h)`` (:meth:`~.layout.Region.factor_parts`). Writes into ``in_tensors``
    write into the tensors: ``torch._foreach_copy_(in_tensors, in_points)`` is
    :func:`write_blocks_` of every block in one operator. ``None`` where a region is not a
    view of its tensor (an interleaved or copied view) or a kind is a product."""
    in_tensors: list[Tensor] = []
    in_points: list[Tensor] = []
    for kind, y in zip(plan.kinds, points, strict=True):
        if kind.product is not None:
            return None
        offset = 0
        for bi in kind.blocks:
            block = plan.blocks[bi]
            heads, start = block.heads, 0
            for r in block.regions:
                t = tensors[r.name]
                view = r.factor_parts(r.of(t), heads)
                if view.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
                    return None
                piece = y[offset : offset + heads, start : start + r.k]
                piece = piece.unflatten(-2, (r.group, r.k // r.group))
                if piece.shape != view.shape:
                    return None
                in_tensors.append(view)
                in_points.append(piece)
                start += r.k
            offset += heads
    return in_tensors, in_points


def _congruent(
    plan: Plan, kind: int, blocks: range, tensors: Mapping[str, Tensor]
) -> list[Block] | None:
    """The blocks ``blocks`` of ``kind`` where they can move together, as one batch: two or
    more blocks that read the same regions of same-shaped parameters (the layers of a model,
    :meth:`Block.layout_key`), each region from a different parameter in every block, through
    views (no regrouped rows) of contiguous tensors. ``None`` otherwise."""
    k = plan.kinds[kind]
    found = [plan.blocks[k.blocks[i]] for i in blocks]
    if len(found) < 2:
        return None
    key = found[0].layout_key()
    if any(b.layout_key() != key for b in found[1:]):
        return None
    for j, region in enumerate(found[0].regions):
        names = [b.regions[j].name for b in found]
        if region.view.interleave is not None or len(set(names)) != len(names):
            return None
        if not all(tensors[name].is_contiguous() for name in names):
            return None
    return found


def _stacked_views(
    found: list[Block], tensors: Mapping[str, Tensor], points: Tensor
) -> tuple[list[Tensor], list[Tensor], list[str]]:
    """Congruent blocks (:func:`_congruent`) as pairs of views: ``(in_points, in_params,
    names)``, one entry per region of every block, its heads' factors ``(heads, r, c, h)`` in
    ``points`` (``(Σ heads, Σk, h)``) and in its parameter ``names[i]``
    (:meth:`Region.factor_parts`), so that one ``_foreach_copy_`` moves all of them either
    way."""
    first = found[0]
    heads = first.heads
    y, start = points.view(len(found), heads, *points.shape[1:]), 0
    in_points: list[Tensor] = []
    in_params: list[Tensor] = []
    names: list[str] = []
    for j, r in enumerate(first.regions):
        target = y[:, :, start : start + r.k].unflatten(-2, (r.group, r.k // r.group))
        in_points += target.unbind(0)
        for block in found:
            region = block.regions[j]
            names.append(region.name)
            in_params.append(r.factor_parts(region.of(tensors[region.name]), heads))
        start += r.k
    return in_points, in_params, names


def _gather_stacked(
    found: list[Block], tensors: Mapping[str, Tensor], dtype, out: Tensor | None = None
) -> Tensor:
    """:func:`gather_blocks` of congruent blocks (:func:`_congruent`): the points allocated
    once and every region of every block copied into them in one ``_foreach_copy_``
    (:func:`_stacked_views`); parameters of another dtype than ``dtype``: each region
    stacked, its heads' factors formed in one batch, one concatenation. ``out``: the points'
    tensor to write into."""
    first, n = found[0], len(found)
    heads, rows = first.heads, []
    names = [r.name for b in found for r in b.regions]
    if all(tensors[name].dtype == dtype for name in names):
        k, h = first.shape
        if out is None:
            out = torch.empty((n * heads, k, h), dtype=dtype, device=tensors[names[0]].device)
        detached = {name: tensors[name].detach() for name in names}
        in_points, in_params, _ = _stacked_views(found, detached, out)
        torch._foreach_copy_(in_points, in_params)  # pyright: ignore[reportPrivateImportUsage]
        return out
    for j, r in enumerate(first.regions):
        region = torch.stack([b.regions[j].of(tensors[b.regions[j].name].detach()) for b in found])
        if r.axis == 0:  # (n, heads·g·h, c): the n blocks' heads are one batch of heads
            factor = r.to_factor(region.reshape(-1, region.shape[-1]), n * heads)
        else:  # (n, c, heads·g·h) -> (n·heads, g·c, h), as Region.to_factor per block
            c, g, h = region.shape[1], r.group, r.width
            factor = region.reshape(n, c, heads, g, h).permute(0, 2, 3, 1, 4)
            factor = factor.reshape(n * heads, g * c, h)
        rows.append(factor.to(dtype))
    points = rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)
    return points if out is None else out.copy_(points)


def _write_stacked(found: list[Block], points: Tensor, tensors: Mapping[str, Tensor]) -> None:
    """:func:`write_blocks_` of congruent blocks: every region of every block written in one
    ``_foreach_copy_``, from views of ``points`` into its heads' factors as views of the
    parameters (:func:`_stacked_views`, as :func:`_gather_stacked` reads them): no copy in
    between."""
    in_points, in_params, _ = _stacked_views(found, tensors, points.contiguous())
    torch._foreach_copy_(in_params, in_points)  # pyright: ignore[reportPrivateImportUsage]


Strided = tuple[tuple[int, ...], tuple[int, ...], int]


@dataclasses.dataclass(frozen=True)
class StackedLayout:
    """Where the regions of congruent blocks lie, as plain data (:func:`stacked_layout`): the
    points' shape, and each region of each block as a strided view ``(size, stride, offset)``
    of the points and of its parameter (the offset counted from the parameter's own). Valid for
    tensors of the shapes, strides and dtypes it was made for; reading and writing through it
    is one ``as_strided`` per region and one ``_foreach_copy_``, with none of the views'
    reshapes, slices and transposes of :func:`gather_blocks` built again."""

    shape: tuple[int, ...]
    in_points: tuple[Strided, ...]
    in_params: tuple[tuple[str, Strided], ...]
    same_dtype: bool  # the parameters in the points' dtype: reads may take this layout

    def _views(self, points: Tensor, tensors: Mapping[str, Tensor]):
        if points.shape != self.shape or not points.is_contiguous():
            raise ValueError(f"points must be contiguous of shape {self.shape}")
        base = points.storage_offset()
        in_points = [
            points.as_strided(size, stride, base + at) for size, stride, at in self.in_points
        ]
        in_params = []
        for name, (size, stride, at) in self.in_params:
            t = tensors[name]
            in_params.append(t.as_strided(size, stride, t.storage_offset() + at))
        return in_points, in_params

    @torch.no_grad()
    def read(self, tensors: Mapping[str, Tensor], out: Tensor) -> Tensor:
        """``out`` (contiguous, of :attr:`shape`) ``←`` the blocks' points in ``tensors``."""
        in_points, in_params = self._views(out, tensors)
        torch._foreach_copy_(in_points, in_params)  # pyright: ignore[reportPrivateImportUsage]
        return out

    @torch.no_grad()
    def write_(self, points: Tensor, tensors: Mapping[str, Tensor]) -> None:
        """The blocks' entries of ``tensors ← points`` (contiguous, of :attr:`shape`; cast to
        each tensor's dtype)."""
        in_points, in_params = self._views(points, tensors)
        torch._foreach_copy_(in_params, in_points)  # pyright: ignore[reportPrivateImportUsage]


def stacked_layout(
    plan: Plan, kind: int, blocks: range, tensors: Mapping[str, Tensor], dtype: torch.dtype
) -> StackedLayout | None:
    """The :class:`StackedLayout` of blocks ``plan.kinds[kind].blocks[i]``, ``i`` in
    ``blocks``, for tensors shaped as ``tensors`` and points in ``dtype``, where they are
    congruent (:func:`_congruent`; else ``None``). Found on meta tensors: nothing is read."""
    if plan.kinds[kind].product is not None:
        return None
    found = _congruent(plan, kind, blocks, tensors)
    if found is None:
        return None
    names = dict.fromkeys(r.name for b in found for r in b.regions)
    meta = {
        name: torch.empty_strided(tensors[name].shape, tensors[name].stride(), device="meta")
        for name in names
    }
    k, h = found[0].shape
    points = torch.empty((len(found) * found[0].heads, k, h), device="meta")
    in_points, in_params, owners = _stacked_views(found, meta, points)
    return StackedLayout(
        tuple(points.shape),
        tuple(_strided(v) for v in in_points),
        tuple((name, _strided(v)) for name, v in zip(owners, in_params, strict=True)),
        all(tensors[name].dtype == dtype for name in names),
    )


def _strided(view: Tensor) -> Strided:
    return tuple(view.shape), tuple(view.stride()), int(view.storage_offset())


def _split_regions(y: Tensor, block) -> list[Tensor]:
    """Points ``(..., heads, Σk, h)`` of a block -> its regions ``(..., *region)``."""
    regions = block.regions
    parts = torch.split(y, [r.k for r in regions], dim=-2) if len(regions) > 1 else (y,)
    return [r.from_factor(part) for r, part in zip(regions, parts, strict=True)]


def scatter(
    plan: Plan, params: Mapping[str, Tensor], points: Sequence[Tensor], w: Tensor | None
) -> dict[str, Tensor]:
    """Parameters ``name -> tensor`` from ``points`` and ``w``: the inverse of :func:`gather`."""
    if len(points) != len(plan.kinds):
        raise ValueError(f"expected {len(plan.kinds)} point tensors, got {len(points)}")
    out: dict[str, Tensor] = {}
    residual: dict[str, Tensor] = {}
    if w is not None:
        n_adaptive = sum(plan.adaptive_sizes)
        if w.shape != (n_adaptive,):
            raise ValueError(
                f"the adaptive vector must have shape ({n_adaptive},), got {tuple(w.shape)}"
            )
        parts = torch.split(w, list(plan.adaptive_sizes)) if plan.adaptive_sizes else ()
        names = plan.adaptive_names + tuple(plan.partial)
        for name, part in zip(names, parts, strict=True):
            if name in plan.partial:
                residual[name] = part
            else:
                p = params[name]
                out[name] = part.view(p.shape).to(p.dtype)
    flat = {ki: points[ki].reshape(-1) for ki in plan.segments}  # product points (1, D)
    regions: dict[tuple[int, int], Tensor] = {}
    if plan.stacks is not None:
        out.update(_scatter_stacked(plan, params, points))
        names = plan.product_names
    else:
        for kind, y in zip(plan.kinds, points, strict=True):
            if kind.product is not None:
                continue
            chunks = torch.split(y, list(kind.sizes), dim=0) if len(kind.sizes) > 1 else (y,)
            for bi, chunk in zip(kind.blocks, chunks, strict=True):
                for j, value in enumerate(_split_regions(chunk, plan.blocks[bi])):
                    regions[bi, j] = value
        names = plan.assembly
    for name in names:
        how = plan.assembly[name]
        p = params[name]
        values = [regions[piece.block, piece.index] for piece in how.pieces]
        if isinstance(how, Concat):
            value = torch.cat(values, dim=how.dim)
        elif (
            not values
            and len(how.segments) == 1
            and name not in residual
            and (how.segments[0].span.mask is None)
        ):  # one product covers the whole parameter: a reshape of its entries
            seg = how.segments[0]
            part = flat[seg.kind][seg.span.offset : seg.span.offset + seg.span.size]
            value = part.reshape(seg.span.view.shape)
        else:
            dtype = values[0].dtype if values else flat[how.segments[0].kind].dtype
            value = plan.views[name].matrix(p.detach().to(dtype))
            for piece, region in zip(how.pieces, values, strict=True):
                (r0, r1), (c0, c1) = piece.region.rows, piece.region.cols
                if (c0, c1) != (0, value.shape[1]):
                    region = torch.slice_scatter(value[r0:r1], region, 1, c0, c1)
                value = torch.slice_scatter(value, region, 0, r0, r1)
            for seg in how.segments:
                part = flat[seg.kind][seg.span.offset : seg.span.offset + seg.span.size]
                mask = _segment_mask(plan, seg, value.device)
                if mask is None:
                    value = part.reshape(value.shape).to(value.dtype)
                else:
                    value = value.masked_scatter(mask, part.to(value.dtype))
            if name in residual:
                mask = _mask(plan, name, value.device)
                value = value.masked_scatter(mask, residual[name].to(value.dtype))
        out[name] = plan.views[name].restore(value).reshape(p.shape).to(p.dtype)
    return out


def _scatter_stacked(plan: Plan, params, points: Sequence[Tensor]) -> dict[str, Tensor]:
    """Covered parameters of all layers at once (see :class:`~.plan.Stack`)."""
    regions: dict[tuple[int, int], Tensor] = {}
    for ki, (kind, y) in enumerate(zip(plan.kinds, points, strict=True)):
        if kind.product is not None:
            continue
        first = plan.blocks[kind.blocks[0]]
        y = y.reshape(len(kind.blocks), first.heads, *y.shape[1:])
        for j, value in enumerate(_split_regions(y, first)):
            regions[ki, j] = value  # (layers, *region)
    out = {}
    for stack in plan.stacks or ():  # the caller checked that there are stacks
        tensors = [regions[s] for s in stack.sources]
        value = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=stack.dim + 1)
        value = plan.views[stack.names[0]].restore(value)
        for name, v in zip(stack.names, value.unbind(0), strict=True):
            p = params[name]
            out[name] = v.reshape(p.shape).to(p.dtype)
    return out
