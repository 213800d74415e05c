"""Perturbations of a model's parameters in its parameter geometry, part by part.

Shared by the sharpness measures (the Auto-PGD maximiser) and the sharpness-aware optimizer.
Tangent vectors live in parameter coordinates, as an optimizer keeps its state: one tensor per
trainable parameter, or its local part for a parameter sharded over ranks
(:mod:`quotientgeo.geometry.shards`). The geometry works on parts of them, so that no step holds
more than a part of the model in the compute dtype at a time:

- a :class:`BlockChunk`: consecutive symmetry blocks of one kind (a few layers' heads), read
  from parameter tensors as points ``(heads, Σk, h)`` and written back into them; the blocks of
  a sharded parameter are read whole (an all-gather of those parameters, never of the model);
- a :class:`Piece`: entries of the adaptive rest, whole small parameters and slices of large
  ones (``Perturbations.piece_size`` entries at most), read as one vector.

:class:`Perturbations` lists the parts of a geometry; a part at a base point is a
:class:`PerturbationSpace`: its manifold at the cached point, the map that applies a tangent
vector (second-order, first-order or exact geodesic step) and the metric of the ball.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..manifolds import AdaptiveGeometry, QuotientManifold
from ..manifolds.base import speeds_at_most
from ..manifolds.gl.damping import with_ball_filled
from ..options import Norm, Perturbation
from . import shards as sh
from .parameters import ParameterGeometry
from .transfer import StackedLayout, gather_blocks, stacked_layout, write_blocks_

Tensor = torch.Tensor

__all__ = [
    "MOVES",
    "BasePoint",
    "BlockChunk",
    "PerturbationSpace",
    "Perturbations",
    "Piece",
    "Segment",
    "Sums",
    "clone_together",
    "empty_like_together",
    "in_ball",
    "move_of",
]

MOVES = {
    Perturbation.SECOND_ORDER: "expmap2",
    Perturbation.FIRST_ORDER: "retr",
    Perturbation.EXACT: "expmap",
}

#: The fewest entries a :class:`Piece` (of the adaptive rest, or of an element-wise pass) may
#: hold: a piece holds up to ``Perturbations.piece_size`` entries, this or a chunk's worth of
#: the compute dtype, whichever is more.
PIECE = 2**22
#: Parameters of fewer entries share pieces (read as one concatenated copy, written back in one
#: ``_foreach_copy_``); larger ones are read as views of themselves, sliced into pieces. A
#: piece costs some forty operators per pass whatever its size, and each operator costs about
#: what moving tens of megabytes does (a launch against the bandwidth of a GPU), so parameters
#: up to a whole piece share: a model's small and middle-sized parameters cost a few pieces'
#: operators, not a few per layer.
SMALL = 2**22
#: A :class:`BlockChunk` holds, in the compute dtype, at most this fraction of the bytes of the
#: parameters in their own dtype (so half-precision weights get chunks of half the entries:
#: their float32 transients count against the same budget), and at least one block. A pass
#: keeps about a dozen chunk-sized tensors alive (point, iterates, gradient, the map's
#: vector-Jacobian product), so its transients stay below a tenth of a parameter copy.
CHUNK_FRACTION = 1 / 128
#: The fraction on an accelerator (parameters on a device other than the CPU). There every
#: operator is a kernel launch that the host dispatches in tens of microseconds, and a pass runs
#: a few dozen of them per chunk whatever its size: at 1/128 a GPT-2-small-sized model is cut
#: into a chunk per layer and a kind, and the GPU waits for the host. At 1/16 a kind takes a few
#: chunks; the transients (up to 0.75 parameter copies) fall outside the peak of a forward and
#: backward pass of modest batches.
ACCELERATOR_CHUNK_FRACTION = 1 / 16
MIN_CHUNK_BYTES = 2**22


def chunk_fraction(device: torch.device) -> float:
    """:data:`CHUNK_FRACTION` on the CPU, :data:`ACCELERATOR_CHUNK_FRACTION` elsewhere."""
    return CHUNK_FRACTION if device.type == "cpu" else ACCELERATOR_CHUNK_FRACTION


def in_ball(manifold: QuotientManifold, radius: float | None) -> QuotientManifold:
    """``manifold`` as a ball of radius ``radius`` perturbs it: a GL manifold damped by a
    ``FrameDamping()`` or ``BallDamping()`` still waiting for its radius (what discovery
    declares for LoRA adapters) gets the ball's; every other manifold is itself."""
    return manifold if radius is None else with_ball_filled(manifold, radius)


def move_of(manifold, perturbation: Perturbation | str) -> str:
    """The manifold method that applies ``perturbation``: :data:`MOVES`, and for ``"default"``
    the exact geodesic (``expmap``) where it is a closed form
    (``manifold.closed_form_geodesic``), else the second-order map (``expmap2``)."""
    if perturbation == Perturbation.DEFAULT:
        return "expmap" if manifold.closed_form_geodesic else "expmap2"
    return MOVES[Perturbation(perturbation)]


class PerturbationSpace:
    """Perturbations of one part at a base point ``x``, through the manifold API only.

    ``manifold`` carries the perturbation (``move``: one of its ``expmap2``, ``retr``,
    ``expmap`` at the cached base point; ``first_order``: its ``retr``, whatever ``move`` is)
    and the horizontal space; ``ball`` is the metric of the ball and of the gradient:
    ``manifold`` itself (Riemannian norm) or the element-wise
    :class:`~quotientgeo.AdaptiveGeometry` (adaptive norm, perturbations kept horizontal).
    ``speed``: a bound on the norm of every vector ``move`` applies, in ``manifold``'s metric
    (the ball's radius where the ball is in that metric), promised to the manifold
    (:func:`~quotientgeo.manifolds.base.speeds_at_most`).
    """

    def __init__(
        self,
        manifold,
        x: Tensor,
        move: str,
        ball,
        factors: dict | None = None,
        speed: float | None = None,
    ):
        self.manifold = manifold
        self.point = manifold.at(x)
        if factors is not None:  # the factors of this base point computed by earlier spaces
            self.point.cache = _KeptFactors(factors, x)
        self.linear = move == "retr"
        self._move = functools.partial(getattr(manifold, move), self.point)
        vjp = {"retr": None, "expmap2": manifold.expmap2_vjp, "expmap": manifold.expmap_vjp}[move]
        self._vjp = None if vjp is None else functools.partial(vjp, self.point)
        self.speed = speed
        self.first_order = functools.partial(manifold.retr, self.point)  # ``x + ξ``
        self.ball = ball
        self.ball_point = self.point if ball is manifold else ball.at(x)
        #: Straight moves in the part's own element-wise adaptive metric (a piece of the
        #: adaptive rest): ``J = I``, every vector horizontal, ``rgrad(∇) = ŵ² ∇``.
        self.adaptive_rest = self.linear and ball is manifold and isinstance(ball, AdaptiveGeometry)

    def move(self, xi: Tensor) -> Tensor:
        """The part moved by ``ξ`` (the map of ``move``), with ``‖ξ‖ ≤ speed`` promised."""
        with speeds_at_most(self.speed):
            return self._move(xi)

    def zeros(self) -> Tensor:
        return torch.zeros_like(self.point.x)

    def rgrad(self, d: Tensor) -> Tensor:
        """Horizontal gradient in the ball metric: ``egrad2rgrad`` (or ``proj(M_ball⁻¹ ∇)``)."""
        if self.ball is self.manifold:
            return self.manifold.egrad2rgrad(self.point, d)
        return self.manifold.proju(self.point, self.ball.egrad2rgrad(self.ball_point, d))

    def pullback(self, xi: Tensor, d: Tensor) -> Tensor:
        """``J(ξ)ᵀ d``: the gradient with respect to ``ξ`` of a function of ``move(ξ)`` whose
        gradient there is ``d`` (the map's vector-Jacobian product: ``d`` itself for ``x + ξ``,
        else the manifold's ``expmap2_vjp`` or ``expmap_vjp``, with ``‖ξ‖ ≤ speed``
        promised)."""
        if self._vjp is None:
            return d
        with speeds_at_most(self.speed):
            return self._vjp(xi, d)

    def sqnorm(self, c: Tensor) -> Tensor:
        """``||c||²`` in the ball's metric, summed over the batch (0-dim)."""
        value = self.ball.inner(self.ball_point, c)
        return value if value.dim() == 0 else value.sum()

    def gram(self, *vectors: Tensor) -> Tensor:
        """The Gram matrix ``<vᵢ, vⱼ>`` in the ball's metric, summed over the batch (``k × k``
        for ``k`` vectors), exactly symmetric: :func:`mirror_upper` of :meth:`stacked_gram` of
        ``V = [v₁; …; v_k]`` stacked."""
        return mirror_upper(self.stacked_gram(torch.stack(vectors)))

    def stacked_gram(self, stacked: Tensor) -> Tensor:
        """``V M(x) Vᵀ`` of the vectors ``V = stacked[i]``: the metric applied once to the stack
        (a leading batch dimension), in one matrix product. Its upper triangle is the Gram
        matrix of :meth:`gram`; its lower one is the same up to rounding (``M`` is symmetric), so
        that a sum of these over parts is mirrored once (:func:`mirror_upper`): the values of
        the sum of the parts' mirrored ones, in three operators for all the parts."""
        images = self.ball.metric(self.ball_point, stacked)
        k = stacked.shape[0]
        return stacked.reshape(k, -1) @ images.reshape(k, -1).mT

    def stacked_row(self, stacked: Tensor) -> Tensor:
        """``V M(x) v_k``: the inner products ``<vᵢ, v_k>`` in the ball's metric of the vectors
        ``V = stacked[i]`` with the last of them (``(k,)``), the last column of
        :meth:`stacked_gram`, for a third of its metric's work: the metric applied to ``v_k``
        alone."""
        image = self.ball.metric(self.ball_point, stacked[-1])
        return stacked.reshape(stacked.shape[0], -1) @ image.reshape(-1)

    def gradient_gram(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """``(g, K)`` from ``rows = [ξ, ξ_prev, ∇]`` (``(3, *point shape)``, stacked by the
        caller, who gives it up): ``rows[2]`` becomes ``g = rgrad(J(ξ)ᵀ ∇)``, the horizontal
        Riemannian gradient with respect to ``ξ`` (in place: ``ŵ² ∇`` where the part moves
        along straight lines in its own element-wise adaptive metric, a piece of the adaptive
        rest), and ``K`` is :meth:`stacked_gram` of ``(ξ, ξ_prev, g)`` (not mirrored): no stack
        of its own."""
        xi, _, d = rows.unbind(0)
        if self.adaptive_rest:
            d.mul_(self.ball.scale_squared(self.point))
        else:
            d.copy_(self.rgrad(self.pullback(xi, d)))
        return d, self.stacked_gram(rows)

    def gradient_row(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """``(g, r)``: :meth:`gradient_gram`'s ``g`` with only the last column of its ``K``,
        ``r = (<ξ, g>, <ξ_prev, g>, <g, g>)`` in the ball's metric, for horizontal ``ξ`` and
        ``ξ_prev`` (iterates kept in the compute dtype).

        Where the ball's metric is the manifold's ``M``, the metric cancels: with
        ``d = J(ξ)ᵀ ∇`` and ``Π`` the ``M``-orthogonal projection onto the horizontal space,
        ``g = Π M⁻¹ d``, so ``<v, g>_M = <v, M⁻¹ d>_M = <v, d>`` for every horizontal ``v``, ``g``
        included: ``r`` is the Euclidean products with ``d``, and no metric is applied (for a
        piece of the adaptive rest, ``<v, ŵ² ∇> = Σ v ∇`` in the metric ``1/ŵ²``), to the
        accuracy of the horizontal projection (rounding for closed forms; the conjugate
        gradients' tolerance for a generic quotient's large group). ``g``
        replaces ``rows[2]``, except where the map is ``x + ξ`` (``d = ∇``, kept in ``rows[2]``
        for the products): there ``g`` is a new tensor. In another ball's metric the metric is
        applied to ``g`` alone (:meth:`stacked_row`)."""
        xi, _, d = rows.unbind(0)
        if self.ball is not self.manifold:
            d.copy_(self.rgrad(self.pullback(xi, d)))
            return d, self.stacked_row(rows)
        pulled = self.pullback(xi, d)
        if pulled is d:  # a straight move: ∇ stays in rows[2]
            g = d * self.ball.scale_squared(self.point) if self.adaptive_rest else self.rgrad(d)
            return g, _products_with_gradient(rows.reshape(3, -1), g.reshape(-1))
        d.copy_(self.rgrad(pulled))
        return d, rows.reshape(3, -1) @ pulled.reshape(-1)

    def gradient_sqnorm(self, g: Tensor, d: Tensor) -> Tensor:
        """``||g||²`` in the ball's metric of ``g = rgrad(d)``: ``<g, d>`` where the ball's
        metric is the manifold's (:meth:`gradient_row`), else :meth:`sqnorm`."""
        if self.ball is not self.manifold:
            return self.sqnorm(g)
        return g.reshape(-1) @ d.reshape(-1)

    def random(self, e: Tensor) -> Tensor:
        """The horizontal direction of the standard Gaussian draw ``e`` (of the point's shape):
        ``proj(T e)`` with ``Tᵀ M T = I`` in the ball metric, isotropic before the projection
        (the ``random_tangent`` recipe of :class:`~quotientgeo.QuotientManifold`)."""
        return self.manifold.proju(self.point, self.ball.isotropic(self.ball_point, e))


def is_factor(value: Any, x: Tensor) -> bool:
    """Whether a cached quantity of the point ``x`` (``(..., k, h)``, a batch of heads) is
    ``h × h`` data per head: a number, or tensors (a tuple of them) of trailing shape
    ``(h, h)``, ``(h, 1)``, ``(1, h)`` or ``(1, 1)`` that are neither ``x`` nor views of it.
    Gram matrices, their damping, Cholesky factors, inverses and eigenbases are; a point's
    element-wise scale, its parts and objects holding them are not."""
    if isinstance(value, (int, float)):
        return True
    if isinstance(value, tuple):
        return all(is_factor(v, x) for v in value)
    if not isinstance(value, Tensor) or x.dim() < 3 or value.dim() < 2:
        return False
    h = x.shape[-1]
    square = all(n in (1, h) for n in value.shape[-2:]) and value.shape[-2:] != x.shape[-2:]
    return square and value.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


class _KeptFactors(dict):
    """A point's cache (:class:`~quotientgeo.manifolds.AtPoint`) that starts with the factors
    kept for its base point and adds the new ones to them (:func:`is_factor`)."""

    def __init__(self, kept: dict, x: Tensor):
        super().__init__(kept)
        self.kept, self.x = kept, x

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if is_factor(value, self.x):
            self.kept[key] = value


class BasePoint:
    """The parts' :class:`PerturbationSpace` at one fixed point, its factors computed once.

    Every space that a part gets here shares the part's ``h × h`` factors (:func:`is_factor`:
    Gram matrices, damping, Cholesky factors, inverses, Sylvester eigenbases), computed by the
    first space that needs them and reused by every later one, so that a measurement, whose
    base point ``x0`` is fixed, factorises it once instead of once per pass. Only factors are
    kept, a few ``h × h`` matrices per head; the part's point itself is gathered again for each
    space (one transient chunk, as before).

    Args:
        x: the point in parameter coordinates (by name; local parts).
        dtype: the compute dtype the parts are read in.
    """

    def __init__(self, x: Mapping[str, Tensor], dtype: torch.dtype):
        self.x, self.dtype = x, dtype
        self._factors: dict[BlockChunk | Piece, dict[str, Any]] = {}
        self._views: dict[BlockChunk | Piece, Tensor | None] = {}

    def space(self, part: BlockChunk | Piece, x: Tensor | None = None) -> PerturbationSpace:
        """``part`` at the point (``x``: its point, already read), with the factors kept; a
        piece whose entries are one view of the point (:meth:`Piece.view`) is not read again."""
        if x is None:
            if part not in self._views:
                view = part.view(self.x, self.dtype) if isinstance(part, Piece) else None
                self._views[part] = view
            x = self._views[part]
            if x is None:
                x = part.read(self.x, self.dtype)
        return part.space(x, self._factors.setdefault(part, {}))


class BlockChunk:
    """Blocks ``plan.kinds[kind].blocks[i]``, ``i`` in ``blocks``: read and written together.

    ``heads`` is the number of their points (batch entries of the kind, from ``offset`` on).
    """

    def __init__(
        self,
        geometry: ParameterGeometry,
        kind: int,
        blocks: range,
        manifold: QuotientManifold,
        move: str,
        ball: QuotientManifold,
        speed: float | None = None,
    ):
        plan = geometry.plan
        k = plan.kinds[kind]
        self.plan, self.kind, self.blocks = plan, kind, blocks
        self.manifold, self.move, self.ball, self.speed = manifold, move, ball, speed
        self.offset = sum(k.sizes[: blocks.start])
        self.heads = k.batch if k.product is not None else sum(k.sizes[i] for i in blocks)
        if k.product is not None:
            names = [seg.span.name for seg in plan.segments[kind]]
        else:
            names = [r.name for i in blocks for r in plan.blocks[k.blocks[i]].regions]
        self.params = {name: geometry.params[name] for name in dict.fromkeys(names)}
        self.sharded = sh.sharded_parameters(self.params.values())
        self._layouts: dict[tuple, StackedLayout | None] = {}

    def _whole(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {name: sh.full(tensors[name], p) for name, p in self.params.items()}

    def _layout(self, tensors: Mapping[str, Tensor], dtype: torch.dtype) -> StackedLayout | None:
        """The chunk's :class:`~quotientgeo.geometry.transfer.StackedLayout` for tensors shaped
        as ``tensors`` (``None``: its blocks are not congruent, or sharded), found once per
        layout of the tensors and kept."""
        if self.sharded:
            return None
        ts = [tensors[name] for name in self.params]
        key = (dtype, *((t.shape, t.stride(), t.dtype, t.device) for t in ts))
        if key not in self._layouts:
            layout = stacked_layout(self.plan, self.kind, self.blocks, tensors, dtype)
            self._layouts[key] = layout
        return self._layouts[key]

    def read(
        self, tensors: Mapping[str, Tensor], dtype: torch.dtype, out: Tensor | None = None
    ) -> Tensor:
        """The chunk's points in ``tensors`` (parameter coordinates): a new tensor, or written
        into ``out``."""
        layout = self._layout(tensors, dtype)
        if layout is not None and layout.same_dtype:
            if out is None:
                device = tensors[next(iter(self.params))].device
                out = torch.empty(layout.shape, dtype=dtype, device=device)
            if out.is_contiguous():
                return layout.read(tensors, out)
        return gather_blocks(self.plan, self.kind, self.blocks, self._whole(tensors), dtype, out)

    @torch.no_grad()
    def write_(self, tensors: Mapping[str, Tensor], points: Tensor) -> None:
        """Write ``points`` into the chunk's entries of ``tensors``, in place."""
        if not self.sharded:
            layout = self._layout(tensors, points.dtype)
            if layout is not None and points.is_contiguous() and points.shape == layout.shape:
                layout.write_(points, tensors)
                return
            write_blocks_(self.plan, self.kind, self.blocks, points, tensors)
            return
        whole = self._whole(tensors)
        write_blocks_(self.plan, self.kind, self.blocks, points, whole)
        for name, p in self.params.items():
            tensors[name].copy_(sh.local_part(whole[name], p))

    def space(self, x: Tensor, factors: dict | None = None) -> PerturbationSpace:
        return PerturbationSpace(self.manifold, x, self.move, self.ball, factors, self.speed)


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    """Entries ``start:stop`` of parameter ``name`` (its local part, flattened), those where
    ``mask`` is true (``None``: all)."""

    name: str
    start: int
    stop: int
    mask: Tensor | None = None

    @functools.cached_property
    def size(self) -> int:
        """Entries in the segment."""
        return self.stop - self.start if self.mask is None else int(self.mask.sum())

    def of(self, t: Tensor) -> Tensor:
        """The segment's entries of ``t``: a view, unless masked or ``t`` is not contiguous."""
        values = (t.view(-1) if t.is_contiguous() else t.reshape(-1))[self.start : self.stop]
        return values if self.mask is None else values[self.mask]

    @torch.no_grad()
    def write_(self, t: Tensor, values: Tensor) -> None:
        if not t.is_contiguous():  # rare: write a whole copy back
            flat = t.reshape(-1).clone()
            self.write_(flat, values)
            t.copy_(flat.view(t.shape))
            return
        piece = t.view(-1)[self.start : self.stop]
        if self.mask is None:
            piece.copy_(values)
        else:
            piece.masked_scatter_(self.mask, values.to(piece.dtype))


@dataclasses.dataclass(frozen=True, eq=False)
class Piece:
    """Entries of parameters, at most ``Perturbations.piece_size`` of them: several whole small
    parameters, read as one vector (the segments concatenated) and written back segment by
    segment, or a slice of one large parameter, read as a view. A piece of the adaptive rest
    moves along straight lines in ``manifold``'s metric; ``sharded``: its parameters are this
    rank's parts of sharded ones."""

    segments: tuple[Segment, ...]
    manifold: QuotientManifold | None = None
    sharded: bool = False

    @property
    def names(self) -> list[str]:
        return [seg.name for seg in self.segments]

    def read(self, tensors: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
        """The piece's entries of ``tensors`` in ``dtype``: a view where possible (do not write
        into it)."""
        values = [seg.of(tensors[seg.name]) for seg in self.segments]
        if len(values) == 1:
            return values[0].to(dtype)
        return torch.cat([v.to(dtype) for v in values])

    def view(self, tensors: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor | None:
        """The piece's entries of ``tensors`` as one view, where they are of ``dtype``, no
        segment is masked and the segments lie one after the other in one storage (tensors
        allocated together, in order), else ``None``."""
        if any(seg.mask is not None for seg in self.segments):
            return None
        values = [seg.of(tensors[seg.name]) for seg in self.segments]
        first = values[0]
        storage, end = first.untyped_storage().data_ptr(), first.storage_offset()
        for v in values:
            if (
                v.dtype != dtype
                or v.dim() != 1
                or (v.numel() > 1 and v.stride(0) != 1)
                or v.storage_offset() != end
                or v.untyped_storage().data_ptr() != storage
            ):
                return None
            end += v.numel()
        return first.as_strided((end - first.storage_offset(),), (1,))

    def views(self, tensors: Mapping[str, Tensor], dtype: torch.dtype) -> list[Tensor] | None:
        """The segments' entries of ``tensors`` as views, where no segment is masked and every
        tensor is contiguous and of ``dtype`` (else ``None``)."""
        out = []
        for seg in self.segments:
            t = tensors[seg.name]
            if seg.mask is not None or not t.is_contiguous() or t.dtype != dtype:
                return None
            flat = t.view(-1)
            out.append(flat if seg.stop - seg.start == flat.numel() else flat[seg.start : seg.stop])
        return out

    def entries(self, tensors: Mapping[str, Tensor], dtype: torch.dtype) -> list[Tensor]:
        """The piece's entries of ``tensors`` in ``dtype``, one tensor per segment (views
        where possible: do not write into them)."""
        return [seg.of(tensors[seg.name]).to(dtype) for seg in self.segments]

    def differences(
        self, a: Mapping[str, Tensor], b: Mapping[str, Tensor], dtype: torch.dtype
    ) -> list[Tensor]:
        """``a - b`` at each segment's entries, in ``dtype``: one ``_foreach_sub`` of their
        views where every segment is a plain view (:meth:`views`), else segment by segment."""
        va, vb = self.views(a, dtype), self.views(b, dtype)
        if va is None or vb is None:
            return [
                seg.of(a[seg.name]).to(dtype) - seg.of(b[seg.name]).to(dtype)
                for seg in self.segments
            ]
        if len(va) == 1:
            return [va[0] - vb[0]]
        return list(torch._foreach_sub(va, vb))  # pyright: ignore[reportPrivateImportUsage]

    @staticmethod
    def rows(*rows: list[Tensor]) -> Tensor:
        """Vectors of the piece, each given segment by segment (:meth:`entries`), as the rows
        of one new ``(k, n)`` tensor: one concatenation of all the segments."""
        return torch.cat([t for row in rows for t in row]).view(len(rows), -1)

    def gradient_gram_(
        self,
        space: PerturbationSpace,
        xi: list[Tensor],
        previous: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        *,
        row: bool = False,
    ) -> Tensor:
        """The Gram matrix of ``(ξ, ξ_prev, g)`` in the ball's metric at the piece's entries
        (:meth:`PerturbationSpace.stacked_gram`, not mirrored), with ``grads ← g = rgrad(∇)``
        there (``space``: the piece at its base point; ``xi``: :meth:`entries` of ``ξ``); with
        ``row``, its last column only, ``(<ξ, g>, <ξ_prev, g>, <g, g>)``
        (:meth:`PerturbationSpace.gradient_row`). The three vectors are read into one
        ``(3, n)`` tensor and ``g`` is written back (one ``_foreach_copy_`` where the gradients
        are plain views); for the whole matrix, a piece of the adaptive rest whose gradients
        are plain views gets ``g = ŵ² ∇`` in place in the gradients' own tensors (one
        ``_foreach_mul_``) instead (:meth:`PerturbationSpace.gradient_gram`)."""
        dtype = space.point.dtype
        views = self.views(grads, dtype) if space.adaptive_rest and not row else None
        if views is not None:
            scale = space.manifold.scale_squared(space.point)
            torch._foreach_mul_(views, self.split(scale))  # pyright: ignore[reportPrivateImportUsage]
            return space.stacked_gram(self.rows(xi, self.entries(previous, dtype), views))
        rows = self.rows(xi, self.entries(previous, dtype), self.entries(grads, dtype))
        g, gram = space.gradient_row(rows) if row else space.gradient_gram(rows)
        self.write_(grads, g)
        return gram

    @torch.no_grad()
    def write_sum_(
        self,
        tensors: Mapping[str, Tensor],
        base: Mapping[str, Tensor],
        values: Tensor | Sequence[Tensor],
        names=None,
    ) -> None:
        """``tensors ← base + values`` at the piece's entries (of the parameters ``names``
        only, where given), in place; ``values``: the piece's entries, as one vector or segment
        by segment (:meth:`parts`). Only the segments written are read: where every tensor is a
        plain view in ``values``' dtype, ``base`` is copied in and ``values`` added in two
        ``_foreach`` operators (one ``add`` with ``out`` for one segment), else the sum is
        written by :meth:`write_`."""
        parts = self.parts(values)
        if names is not None and any(name not in names for name in self.names):
            kept = [i for i, seg in enumerate(self.segments) if seg.name in names]
            if kept:
                part = Piece(tuple(self.segments[i] for i in kept))
                part.write_sum_(tensors, base, [parts[i] for i in kept])
            return
        dtype = parts[0].dtype
        targets, sources = self.views(tensors, dtype), self.views(base, dtype)
        if targets is None or sources is None:
            sums = torch._foreach_add(self.entries(base, dtype), parts)  # pyright: ignore[reportPrivateImportUsage]
            self.write_(tensors, sums)
            return
        if len(targets) == 1:
            torch.add(sources[0], parts[0], out=targets[0])
            return
        torch._foreach_copy_(targets, sources)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_add_(targets, parts)  # pyright: ignore[reportPrivateImportUsage]

    def split(self, values: Tensor) -> list[Tensor]:
        """``values`` (the piece's entries) cut into its segments."""
        if len(self.segments) == 1:
            return [values]
        return list(values.split([seg.size for seg in self.segments]))

    def parts(self, values: Tensor | Sequence[Tensor]) -> list[Tensor]:
        """The piece's entries segment by segment, from one vector (:meth:`split`) or from a
        sequence of one tensor per segment (kept as it is)."""
        if isinstance(values, Tensor):
            return self.split(values)
        if len(values) != len(self.segments):
            raise ValueError(f"{len(values)} values for a piece of {len(self.segments)} segments")
        return list(values)

    @torch.no_grad()
    def write_(
        self, tensors: Mapping[str, Tensor], values: Tensor | Sequence[Tensor], names=None
    ) -> None:
        """Write ``values`` (one vector, or one tensor per segment) into the piece's entries
        of ``tensors`` (of the parameters ``names`` only, where given), in place: the whole
        segments of contiguous tensors in one ``_foreach_copy_``, the others segment by
        segment."""
        targets, sources = [], []
        for seg, part in zip(self.segments, self.parts(values), strict=True):
            if names is not None and seg.name not in names:
                continue
            t = tensors[seg.name]
            if seg.mask is None and t.is_contiguous():
                targets.append(t.view(-1)[seg.start : seg.stop])
                sources.append(part)
            else:
                seg.write_(t, part)
        if len(targets) == 1:
            targets[0].copy_(sources[0])
        elif targets:
            torch._foreach_copy_(targets, sources)  # pyright: ignore[reportPrivateImportUsage]

    def space(self, x: Tensor, factors: dict | None = None) -> PerturbationSpace:
        return PerturbationSpace(self.manifold, x, "retr", self.manifold, factors)


def cut(entries: list[tuple[str, int, Tensor | None]], size: int = 0) -> list[list[Segment]]:
    """``entries`` (``(name, numel, mask)``, in order) cut into pieces of at most ``size``
    (default :data:`PIECE`) entries: parameters of fewer than :data:`SMALL` entries (scaled by
    ``size / PIECE`` for larger pieces) share pieces, read as one vector (a copy, but one
    operation instead of many); larger ones are sliced into pieces of their own, read as
    views. A mask selects the entries of a parameter that count."""
    size = size or PIECE
    small = SMALL if size <= PIECE else SMALL * size // PIECE
    out: list[list[Segment]] = []
    shared: list[Segment] = []
    used = 0
    for name, n, mask in entries:
        flat_mask = None if mask is None else mask.view(-1)
        if n >= small:
            for start in range(0, n, size):
                stop = min(n, start + size)
                out.append([Segment(name, start, stop, _slice(flat_mask, start, stop))])
            continue
        shared.append(Segment(name, 0, n, flat_mask))
        used += shared[-1].size
        if used >= size:
            out.append(shared)
            shared, used = [], 0
    if shared:
        out.append(shared)
    return out


def empty_like_together(tensors: Sequence[Tensor]) -> list[Tensor]:
    """New contiguous tensors shaped as ``tensors``: views of one allocation per dtype and
    device, so that many small tensors cost one allocation, not one each (the memory returns
    once every view of it is dropped)."""
    return _together(
        tensors,
        lambda group: torch.empty(
            sum(t.numel() for t in group), dtype=group[0].dtype, device=group[0].device
        ),
    )


def clone_together(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Contiguous copies of ``tensors``, allocated as by :func:`empty_like_together`, each
    allocation written by one ``cat``."""
    return _together(tensors, lambda group: torch.cat([t.reshape(-1) for t in group]))


def _together(tensors: Sequence[Tensor], flat: Callable[[list[Tensor]], Tensor]) -> list[Tensor]:
    """``tensors`` as views of ``flat(group)``, one flat tensor per dtype and device."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    views: dict[int, Tensor] = {}
    for members in groups.values():
        sizes = [tensors[i].numel() for i in members]
        views.update(zip(members, flat([tensors[i] for i in members]).split(sizes), strict=True))
    return [views[i].view(t.shape) for i, t in enumerate(tensors)]


def _slice(mask: Tensor | None, start: int, stop: int) -> Tensor | None:
    return None if mask is None else mask[start:stop]


class Perturbations:
    """The parts of a model's parameter geometry, and the parameter tensors they live in.

    Args:
        geometry: the model's :class:`~quotientgeo.geometry.ParameterGeometry`; each kind is
            perturbed on its declared manifold.
        perturbation: the map of the symmetry blocks (``"default"``: the exact geodesic where
            it is a closed form, else the second-order map).
        norm: the ball's metric on the symmetry blocks (``"adaptive"``: the element-wise
            metric on their points, perturbations kept horizontal).
        rest: the geometry of the adaptive rest (element-wise adaptive; SAM's flat one).
        radius: the ball's radius ``ρ``, for the GL kinds relaxed by a
            :class:`~quotientgeo.FrameDamping` (or ``BallDamping``) that takes it from the ball
            (:func:`in_ball`); with the Riemannian norm, also the bound on the speed of every
            move of the symmetry blocks (:attr:`PerturbationSpace.speed`): every vector moved
            along must lie in the ball.
        chunk_bytes: the largest chunk of symmetry blocks, in bytes of the compute dtype
            (``None``: :func:`chunk_fraction` of the device, of the bytes of the parameters this
            rank holds, in their own dtype; at least :data:`MIN_CHUNK_BYTES`, at least one block).

    ``params`` are the trainable parameters by name; :meth:`local` gives their local parts
    (the tensors that the parts read and write); ``chunks`` lists the chunks kind by kind,
    ``rest`` the pieces of the adaptive rest, parameter by parameter in the order of
    ``geometry.gather``'s ``w``.
    """

    def __init__(
        self,
        geometry: ParameterGeometry,
        perturbation: Perturbation | str,
        norm: Norm | str = Norm.RIEMANNIAN,
        *,
        rest: QuotientManifold | None = None,
        radius: float | None = None,
        chunk_bytes: int | None = None,
    ):
        self.geometry = geometry
        self.radius = radius
        self.params: dict[str, nn.Parameter] = dict(geometry.params)
        self.dtype = geometry.compute_dtype
        self.sharded = sh.sharded_parameters(self.params.values())
        plan = geometry.plan
        size = torch.finfo(self.dtype).bits // 8
        #: Bytes of the parameters' local parts, in their own dtype: one parameter copy here.
        self.held_bytes = sum(sh.local(p).nbytes for p in self.params.values())
        if chunk_bytes is None:  # a fraction of what this rank holds
            device = next((p.device for p in self.params.values()), torch.device("cpu"))
            chunk_bytes = max(int(self.held_bytes * chunk_fraction(device)), MIN_CHUNK_BYTES)
        self.chunk_bytes = chunk_bytes
        #: Entries of a piece: :data:`PIECE`, or a chunk's worth where that is more (on an
        #: accelerator, or on the CPU for models of more than 2 GB in float32), so that the
        #: number of pieces, and of the operators of a pass, stays bounded as models grow.
        self.piece_size = max(PIECE, chunk_bytes // size)
        self.chunks: list[list[BlockChunk]] = []
        #: Each kind's manifold as the ball perturbs it (:func:`in_ball`).
        self.manifolds: list[QuotientManifold] = [in_ball(k.manifold, radius) for k in plan.kinds]
        for ki, kind in enumerate(plan.kinds):
            m = self.manifolds[ki]
            ball = m if Norm(norm) == Norm.RIEMANNIAN else AdaptiveGeometry()
            move = move_of(m, perturbation)
            # every move is within the ball: its radius bounds the speed in the ball's metric
            speed = radius if ball is m else None
            per_head = math.prod(kind.shape) * size
            if kind.product is not None:
                groups = [range(len(kind.blocks))]
            else:
                groups, start, used = [], 0, 0
                for i, heads in enumerate(kind.sizes):
                    if i > start and used + heads * per_head > chunk_bytes:
                        groups.append(range(start, i))
                        start, used = i, 0
                    used += heads * per_head
                groups.append(range(start, len(kind.sizes)))
            self.chunks.append([BlockChunk(geometry, ki, g, m, move, ball, speed) for g in groups])
        self.rest_manifold = rest if rest is not None else geometry.rest_manifold()
        self.rest = self._pieces(plan.rest_names, masked=True)
        self.pieces = self._pieces(list(self.params), masked=False)

    @property
    def order(self) -> list[str]:
        """The parameters' names, those of the rest's pieces first, in the pieces' order: a
        copy of the parameters allocated together in this order (:func:`clone_together`)
        holds each unmasked piece of the rest as one view (:meth:`Piece.view`)."""
        names = {seg.name: None for piece in self.rest for seg in piece.segments}
        return [*names, *(name for name in self.params if name not in names)]

    def _pieces(self, names, *, masked: bool) -> list[Piece]:
        """The entries of the local parts of ``names`` (``masked``: the adaptive ones only) cut
        into pieces, the sharded parameters apart from the others."""
        out = []
        for sharded in (False, True):
            entries = []
            for name in names:
                p = self.params[name]
                if sh.is_sharded(p) == sharded:
                    mask = self._rest_mask(name) if masked else None
                    entries.append((name, sh.local(p).numel(), mask))
            pieces = cut(entries, self.piece_size)
            out += [Piece(tuple(segs), self.rest_manifold, sharded) for segs in pieces]
        return out

    def _rest_mask(self, name: str) -> Tensor | None:
        """The adaptive entries of a partly covered parameter (its local part, in its own
        order); ``None`` for a wholly adaptive one."""
        plan = self.geometry.plan
        if name not in plan.partial:
            return None
        p = self.params[name]
        view = plan.views[name]
        mask = view.restore(plan.partial[name]).reshape(p.shape)
        return sh.local_part(mask, p).contiguous()

    # ------------------------------------------------------------------ parameter tensors
    def local(self, tensors: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The local parts of ``tensors`` (default: the parameters), detached: writing into
        them writes into the tensors."""
        source = self.params if tensors is None else tensors
        return {name: sh.local(source[name]) for name in self.params}

    def empty(self, names=None, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """New contiguous tensors shaped as the local parts of ``names`` (default: every
        parameter), in each parameter's dtype unless ``dtype``."""
        out = {}
        for name in self.params if names is None else names:
            part = sh.local(self.params[name])
            out[name] = torch.empty(part.shape, dtype=dtype or part.dtype, device=part.device)
        return out

    @property
    def symmetric_names(self) -> list[str]:
        """Parameters (wholly or partly) in symmetry blocks."""
        return self.geometry.symmetric_names

    def all_chunks(self) -> Iterator[BlockChunk]:
        for chunks in self.chunks:
            yield from chunks

    def parts(self) -> Iterator[BlockChunk | Piece]:
        """Every part: the chunks kind by kind, then the pieces of the rest."""
        yield from self.all_chunks()
        yield from self.rest

    # ------------------------------------------------------------------ random draws
    def random_parts(self, gen: torch.Generator) -> Iterator[tuple[BlockChunk | Piece, Tensor]]:
        """Standard Gaussian draws ``(part, e)``, ``e`` of the part's point shape in the
        compute dtype: one draw per kind over all its heads (in the order of the kinds), then
        one over the whole adaptive vector ``w`` (as ``geometry.gather`` orders it), each cut
        into the parts. The same generator gives the same draws whatever the chunk sizes or
        the sharding."""
        plan = self.geometry.plan
        device = self.geometry.device
        kw = {"generator": gen, "dtype": self.dtype, "device": device}
        for kind, chunks in zip(plan.kinds, self.chunks, strict=True):
            e = torch.randn((kind.batch, *kind.shape), **kw)
            for chunk in chunks:
                yield chunk, e[chunk.offset : chunk.offset + chunk.heads]
        n_rest = sum(plan.adaptive_sizes)
        if not n_rest:
            return
        flat = torch.randn(n_rest, **kw)
        sizes = dict(zip(plan.rest_names, plan.adaptive_sizes, strict=True))
        offsets = itertools.accumulate(plan.adaptive_sizes, initial=0)
        starts = dict(zip(plan.rest_names, offsets, strict=False))
        whole: dict[str, Tensor] = {}
        for piece in self.rest:
            for name in list(whole):
                if name not in piece.names:
                    del whole[name]  # the parameters of one piece at a time
            for name in piece.names:
                if name not in whole:
                    values = flat[starts[name] : starts[name] + sizes[name]]
                    whole[name] = self._rest_values(name, values)
            yield piece, piece.read(whole, self.dtype)

    def _rest_values(self, name: str, values: Tensor) -> Tensor:
        """``values`` (the parameter's adaptive entries in ``w``'s order) placed in the local
        part of parameter ``name`` (zeros at covered entries)."""
        plan = self.geometry.plan
        p = self.params[name]
        if name not in plan.partial:
            return sh.local_part(values.view(p.shape), p)
        whole = torch.zeros(p.shape, dtype=values.dtype, device=values.device)
        mask = plan.partial[name].to(values.device)
        plan.views[name].edit_(whole, lambda m: m.masked_scatter_(mask, values))
        return sh.local_part(whole, p)


def _products_with_gradient(rows: Tensor, g: Tensor) -> Tensor:
    """``(Σ ξ ∇, Σ ξ_prev ∇, Σ g ∇)`` of ``rows = [ξ, ξ_prev, ∇]`` (``(3, n)``) and ``g =
    rgrad(∇)`` (``ŵ² ∇`` for the adaptive rest): the last column of the Gram matrix of
    ``(ξ, ξ_prev, g)`` in the metric of ``rgrad``, for horizontal ``ξ`` and ``ξ_prev``
    (:meth:`PerturbationSpace.gradient_row`)."""
    return torch.cat((rows[:2] @ rows[2], (g @ rows[2]).unsqueeze(0)))


def mirror_upper(K: Tensor) -> Tensor:
    """``K``'s upper triangle mirrored into its lower one (``(..., k, k)``): exactly symmetric."""
    return K.triu() + K.triu(1).mT


class Sums:
    """Sums of per-part values (``shape``, compute dtype), accumulated in place: no small
    tensor is kept per part, where it could split the allocator's large free blocks. A chunk is
    read whole on every rank; a piece of a sharded parameter is this rank's share, and those
    sums add over ranks in :meth:`total` (one all-reduce)."""

    def __init__(self, space: Perturbations, shape: tuple[int, ...] = ()):
        kw = {"dtype": space.dtype, "device": space.geometry.device}
        self.whole, self.shares = torch.zeros(shape, **kw), torch.zeros(shape, **kw)
        self.sharded = space.sharded

    def add(self, part: BlockChunk | Piece, value: Tensor) -> None:
        shared = isinstance(part, Piece) and part.sharded
        (self.shares if shared else self.whole).add_(value)

    def total(self) -> Tensor:
        if self.sharded:
            torch.distributed.all_reduce(self.shares)
        return self.whole + self.shares
