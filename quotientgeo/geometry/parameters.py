r"""Parameter geometry of a model: its symmetry blocks and the adaptive rest.

A :class:`ParameterGeometry` splits the trainable parameters of a :class:`torch.nn.Module` into

- **symmetry blocks**, each declared on a :class:`~quotientgeo.QuotientManifold`: ``heads``
  points of shape ``(Σ k_f, h)``, head ``i``'s point stacking the ``(k_f × h)`` parts of its
  factors (see :class:`Source`) along rows. Blocks on equal manifolds with equal point shapes
  form one *kind*, stored batched as one ``(batch, Σ k_f, h)`` tensor, so that one manifold
  handles all heads of all layers at once. Blocks that share parameter entries (declared with
  ``product=True``) form a *product* instead: one kind whose point ``(1, D)`` holds the union
  of their entries, on a :class:`~quotientgeo.ProductQuotient`;
- the **adaptive rest**: every other trainable element, flattened into one vector ``w`` for
  the element-wise geometry of adaptive sharpness (:class:`~quotientgeo.AdaptiveGeometry`).

:meth:`ParameterGeometry.gather` reads the points from the model;
:meth:`ParameterGeometry.scatter` maps (perturbed) points back to a dict ``name -> tensor``
with differentiable view, transpose and concatenation operations only; it never writes to
the model. Scattering the gathered points reproduces every parameter exactly.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import TypeAlias

import torch
from torch import nn

from ..manifolds import (
    DEFAULT_METRIC,
    AdaptiveGeometry,
    BallDamping,
    FrameDamping,
    GLQuotient,
    QuotientManifold,
    RescaleQuotient,
)
from ..validation import positive_int
from .layout import Layout, Region, Source, overlaps
from .plan import Block, HeadLocation, Kind, Plan, build_plan, n_entries
from .product import Product, check_product, make_product
from .transfer import gather, scatter

Tensor = torch.Tensor

__all__ = ["HALF", "ParameterGeometry", "as_sources"]

HALF = (torch.float16, torch.bfloat16)
Factor: TypeAlias = str | Source | Sequence[str | Source]
"""A factor of a block: a parameter name, a :class:`Source`, or a list of them stacked as rows."""


def as_sources(spec: Factor) -> tuple[Source, ...]:
    """A factor given as a parameter name, a :class:`Source` or a list of them."""
    if isinstance(spec, (str, Source)):
        spec = [spec]
    out = []
    for s in spec:
        if isinstance(s, str):
            s = Source(s)
        if not isinstance(s, Source):
            raise TypeError(f"a factor source must be a parameter name or a Source, got {s!r}")
        out.append(s)
    if not out:
        raise ValueError("a factor needs at least one source parameter")
    return tuple(out)


def _source_text(src: Source) -> str:
    """``src`` as a user would write it: the plain name if every field is the default."""
    changed = [
        f"{f.name}={getattr(src, f.name)!r}"
        for f in dataclasses.fields(src)
        if f.name != "param" and getattr(src, f.name) != f.default
    ]
    if not changed:
        return repr(src.param)
    return f"Source({', '.join([repr(src.param), *changed])})"


class ParameterGeometry:
    """Symmetry blocks and adaptive rest of a model's trainable parameters (module docstring).

    Args:
        model: the module whose trainable parameters (``requires_grad``) are described.

    The model is only read: :meth:`gather` copies its parameters, :meth:`scatter` builds new
    tensors, and only :meth:`assign_` writes (in place, explicitly).

    ``skipped``: what :func:`~quotientgeo.find_symmetries` recognised but left out, one
    readable ``"label: reason"`` per block or module (frozen parameters, no known group,
    unknown layout); ``()`` for a geometry declared by hand.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.layout: Layout = Layout(model)
        self.blocks: list[Block] = []
        self.products: list[Product] = []  # groups of overlapping blocks, each one kind
        self.skipped: tuple[str, ...] = ()
        self._plan: Plan | None = None  # built on first use after the last declaration

    # ------------------------------------------------------------------ declaration
    def add(
        self,
        manifold: QuotientManifold,
        *factors: Factor,
        heads: int = 1,
        label: str | None = None,
        product: bool = False,
    ) -> ParameterGeometry:
        """Declare a block of ``heads`` points on ``manifold``; returns ``self``.

        Each factor is a parameter name, a :class:`Source` or a list of them stacked as rows.
        Head ``i``'s part of a factor is a ``(k_f × h)`` matrix (``axis=0``: ``nn.Linear``
        weight rows and bias entries are the head features; ``axis=1``: output-projection
        columns are), and head ``i``'s point stacks its factors along rows: shape
        ``(Σ k_f, h)``. An invalid block raises a ``ValueError`` naming it (a ``KeyError``
        for an unknown parameter) and leaves the geometry unchanged.

        A block may share parameter entries with blocks declared before it only with
        ``product=True``: it then joins them (and the products they belong to) in one
        quotient by the product of their groups, measured as one point ``(1, D)`` that holds
        the union of their entries on a :class:`~quotientgeo.ProductQuotient`: vertical
        space ``Σ_j V_j``, action ``g_1 · (… (g_n · x))`` and the element-wise metric
        ``Σ η²/x²``, the one metric that every re-scaling of entries preserves (the parts'
        own metrics are not used). The declaration is refused unless, at the current
        parameters (in float64, with random group elements of the parts), the new block's
        action commutes with those of the blocks it overlaps, every part's action preserves
        the metric (both to ``√ε ≈ 1.5e-8`` relative), no covered entry is 0, and (for
        ``K ≤ dense_max`` generators) the parts' vertical spaces are independent. A
        ``product=True`` block that overlaps nothing is an ordinary block.
        """
        label = label or f"block {len(self.blocks)}"
        if not isinstance(manifold, QuotientManifold):
            raise ValueError(
                f"{label}: a block is measured on a QuotientManifold, got {type(manifold).__name__}"
            )
        try:
            heads = positive_int("heads", heads)
        except ValueError as err:
            raise ValueError(f"{label}: {err}") from None
        if not factors:
            raise ValueError(f"{label}: give at least one factor")
        sources = tuple(as_sources(f) for f in factors)
        regions = tuple(self.layout.resolve(s, heads, label) for f in sources for s in f)
        widths = sorted({r.width for r in regions})
        if len(widths) != 1:
            hint = self._axis_hint(regions, heads, label)
            raise ValueError(f"{label}: the factors give different head widths {widths}{hint}")
        block = Block(label, manifold, heads, sources, regions)
        ok, reason = manifold._check_shape((heads, *block.shape), "the point")
        if not ok:
            raise ValueError(f"{label}: {type(manifold).__name__} rejects its points: {reason}")
        if not isinstance(product, bool):
            raise TypeError(f"{label}: product must be True or False, got {product!r}")
        touched = (
            [
                bi
                for bi, other in enumerate(self.blocks)
                if any(overlaps(a, b) for a in regions for b in other.regions)
            ]
            if product
            else []
        )
        undo = self.layout.claim(regions, label, shared=bool(touched))
        if touched:
            try:
                joined = self._join(block, touched, label)
            except BaseException:
                undo()
                raise
            self.products = [p for p in self.products if not set(p.parts) & set(joined.parts)]
            self.products.append(joined)
        self.blocks.append(block)
        self._plan = None
        return self

    def _axis_hint(self, regions: Sequence[Region], heads: int, label: str) -> str:
        """For factors of different head widths: the sources that, read along their other
        axis, would give the width all the other sources share (e.g. a LoRA ``B`` weight
        ``(out, r)`` given as a plain name instead of ``Source(name, axis=1)``), as a sentence
        naming the parameter and the fix; ``""`` if none does."""
        fixes = []
        for i, region in enumerate(regions):
            others = {r.width for j, r in enumerate(regions) if j != i}
            if len(others) != 1:
                continue
            src = region.source
            flipped = dataclasses.replace(src, axis=1 - src.axis)
            try:
                width = self.layout.resolve(flipped, heads, label).width
            except ValueError:
                continue  # its other axis does not split into the heads either
            if {width} != others:
                continue
            shape = tuple(self.layout.params[region.name].shape)
            features = "columns" if flipped.axis == 1 else "rows"
            fixes.append(
                f"parameter {src.param!r} (shape {shape}) read along axis {src.axis} gives head "
                f"width {region.width}, along axis {flipped.axis} (its {features} as the heads' "
                f"features) {width} like the other factors: give {_source_text(flipped)} "
                f"instead of {_source_text(src)}"
            )
        return "; " + "; or ".join(fixes) if fixes else ""

    def _join(self, block: Block, touched: list[int], label: str) -> Product:
        """The product of ``block`` with the blocks ``touched`` and their products, checked."""
        new = len(self.blocks)
        parts = set(touched)
        for p in self.products:
            if parts & set(p.parts):
                parts |= set(p.parts)
        parts = (*sorted(parts), new)
        joined = make_product([*self.blocks, block], parts)
        position = {b: j for j, b in enumerate(parts)}
        check_product(joined, len(parts) - 1, [position[b] for b in touched], self.params, label)
        return joined

    def add_gl_pair(
        self,
        g: Factor,
        h: Factor,
        *,
        heads: int = 1,
        label: str | None = None,
        metric: str | float = DEFAULT_METRIC,
    ) -> ParameterGeometry:
        """Declare GL pairs ``(G, H)``, one per head, that enter the network through ``G Hᵀ``.

        ``add(GLQuotient(n, metric), g, h, heads=heads)`` with ``n`` the rows of ``G`` (the
        metric is ``"mix"`` unless named: ``"inv"``, ``"mix"`` or ``s``): a plain name
        means ``Source(name)``, an ``nn.Linear`` weight or bias whose output features are the
        heads' features; ``Source(name, axis=1)`` is an output projection whose input columns
        belong to the heads. Returns ``self``.
        """
        label = label or f"GL pair {len(self.blocks)}"
        n = self.rows(g, heads=heads, label=label)
        return self.add(GLQuotient(n, metric), g, h, heads=heads, label=label)

    def rows(self, factor: Factor, *, heads: int = 1, label: str = "factor") -> int:
        """Rows ``k_f`` of one head's part of ``factor`` (a name, Source or list of them):
        ``n`` of a pair quotient whose ``G`` is this factor."""
        try:
            heads = positive_int("heads", heads)
        except ValueError as err:
            raise ValueError(f"{label}: {err}") from None
        return sum(self.layout.resolve(s, heads, label).k for s in as_sources(factor))

    def add_rescale_pair(
        self, u: Factor, v: Factor, *, label: str | None = None, metric: str = DEFAULT_METRIC
    ) -> ParameterGeometry:
        """Declare an element-wise re-scaling pair ``(u, v) ~ (α u, v / α)`` (``β = u ⊙ v``).

        ``add(RescaleQuotient(metric), u, v)`` (``"mix"`` unless named): ``u`` and ``v`` are
        1-D regions (a vector, or a ``Source`` with ``view=(d, 1)``) of equal length ``d``; the
        point is ``(2, d)``.
        """
        label = label or f"re-scaling pair {len(self.blocks)}"
        sizes = [sum(self.layout.resolve(s, 1, label).width for s in as_sources(f)) for f in (u, v)]
        if sizes[0] != sizes[1]:
            raise ValueError(f"{label}: u has {sizes[0]} entries but v has {sizes[1]}")
        return self.add(RescaleQuotient(metric), u, v, label=label)

    def with_metric(
        self, metric: str | float | None, *, eps: float | BallDamping | FrameDamping | None = None
    ) -> ParameterGeometry:
        """A new geometry of the same model and blocks, each block's manifold replaced by
        ``manifold.with_metric(metric, eps=eps)``.

        That re-chooses the metric of GL pairs, their rotary subgroup (``"inv"``, ``"mix"`` or
        ``s``) and re-scaling pairs (``"inv"``, ``"mix"``) (``None``: each keeps its own), and
        their Gram relaxation ``eps`` unless ``None``; manifolds whose metric is part of their
        definition (scales, products, user-defined ones) are kept. The measures use a
        geometry's declared metrics: this is how a study compares metrics on one model.
        ``self`` is unchanged.
        """

        def replaced(m: QuotientManifold) -> QuotientManifold:
            chosen = m.metric_name if metric is None else metric
            return m if chosen is None else m.with_metric(chosen, eps=eps)

        new = copy.copy(self)
        new.layout = self.layout.copy()
        new.blocks = [dataclasses.replace(b, manifold=replaced(b.manifold)) for b in self.blocks]
        new.products = list(self.products)  # the product metric Σ η²/x² is the only one
        new._plan = None
        return new

    @property
    def half_dtypes(self) -> list[str]:
        """The half-precision dtypes (``float16``, ``bfloat16``) among the trainable parameters,
        as sorted names."""
        return sorted({str(p.dtype) for p in self.params.values() if p.dtype in HALF})

    @property
    def metrics(self) -> tuple[str | float, ...]:
        """The distinct declared metrics of the kinds that have a choice of metric
        (each manifold's ``metric_name``), in the order of :attr:`kinds`."""
        names = (k.manifold.metric_name for k in self.kinds)
        return tuple(dict.fromkeys(n for n in names if n is not None))

    # ------------------------------------------------------------------ plan
    @property
    def plan(self) -> Plan:
        """The frozen plan of the declared blocks (built once after the last declaration)."""
        if self._plan is None:
            self._plan = build_plan(self.layout, self.blocks, tuple(self.products))
        return self._plan

    @property
    def params(self) -> dict[str, nn.Parameter]:
        """Trainable parameters by canonical name."""
        return self.layout.params

    @property
    def kinds(self) -> tuple[Kind, ...]:
        return self.plan.kinds

    @property
    def adaptive_names(self) -> list[str]:
        """Parameters wholly in the adaptive geometry."""
        return list(self.plan.adaptive_names)

    @property
    def partial_names(self) -> list[str]:
        """Parameters partly in symmetry blocks; their other entries are adaptive."""
        return list(self.plan.partial)

    @property
    def symmetric_names(self) -> list[str]:
        """Parameters (wholly or partly) in symmetry blocks."""
        return list(self.plan.assembly)

    @property
    def n_symmetric(self) -> int:
        """Number of parameter entries covered by symmetry blocks."""
        return n_entries(self.plan.kinds)

    @property
    def n_adaptive(self) -> int:
        """Number of parameter entries in the adaptive geometry."""
        return sum(self.plan.adaptive_sizes)

    @property
    def n_heads(self) -> int:
        """Number of block points (heads) over all kinds."""
        return sum(k.batch for k in self.plan.kinds)

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of gathered points: the parameters' promoted dtype, at least float32."""
        dtype = torch.float32
        for p in self.params.values():
            if p.dtype.is_floating_point and p.dtype not in HALF:
                dtype = torch.promote_types(dtype, p.dtype)
        return dtype

    @property
    def device(self) -> torch.device:
        devices = {p.device for p in self.params.values()}
        if len(devices) > 1:
            raise ValueError(f"parameters live on several devices {sorted(map(str, devices))}")
        return devices.pop() if devices else torch.device("cpu")

    def manifolds(
        self,
        metric: str | float | None = None,
        *,
        eps: float | BallDamping | FrameDamping | None = None,
    ) -> list[QuotientManifold]:
        """One manifold per kind (order of :attr:`kinds` and :meth:`gather`).

        ``metric`` (``"inv"``, ``"mix"`` or ``s``) re-chooses the metric of the shipped GL and
        re-scaling kinds (:meth:`QuotientManifold.with_metric`), ``None`` keeps each kind's
        declared one; ``eps``, unless ``None``, re-chooses the Gram relaxation of the kinds that
        have a metric to relax (``metric_name`` not ``None``). Both ``None``: the declared
        manifolds.
        """
        out = []
        for kind in self.kinds:
            m = kind.manifold
            chosen = m.metric_name if metric is None else metric
            out.append(
                m
                if chosen is None or (metric is None and eps is None)
                else m.with_metric(chosen, eps=eps)
            )
        return out

    def locate(self, kind: int, index: int, rows: tuple[int, int] | None = None) -> HeadLocation:
        """Block label, head, layer and parameter names of entry ``index`` of the points of
        kind ``kind`` (``gather()[0][kind][index]``); ``rows`` restricts the parameters to
        those holding rows ``(start, stop)`` of that point."""
        return self.plan.locate(kind, index, rows)

    def rest_manifold(self) -> AdaptiveGeometry:
        """The geometry of the adaptive rest ``w``."""
        return AdaptiveGeometry()

    # ------------------------------------------------------------------ gather / scatter
    def gather(
        self, params: dict[str, Tensor] | None = None, *, dtype: torch.dtype | None = None
    ) -> tuple[list[Tensor], Tensor]:
        """Points of every kind and the flat adaptive vector, read from ``params``.

        Returns ``(points, w)``, new tensors that share no memory with the parameters:
        ``points[i]`` has shape ``(kinds[i].batch, *kinds[i].shape)``;
        ``w`` holds the adaptive parameters flattened in :attr:`adaptive_names` order, then
        the uncovered entries of partially covered parameters. ``params`` defaults to the
        model's (detached) parameters; ``dtype`` to :attr:`compute_dtype`.
        """
        src = self.params if params is None else params
        return gather(self.plan, src, dtype or self.compute_dtype, self.device)

    def scatter(self, points: Sequence[Tensor], w: Tensor | None = None) -> dict[str, Tensor]:
        """Parameters ``name -> tensor`` from ``points`` and ``w``: the inverse of :meth:`gather`.

        Differentiable; uses only views, transposes and concatenations (slice scatters where
        blocks cover parameters partially). Tensors are returned in the parameters' dtypes;
        parameters are never modified. ``w=None`` keeps the adaptive parameters out of the dict.
        """
        return scatter(self.plan, self.params, points, w)

    @torch.no_grad()
    def assign_(self, points: Sequence[Tensor], w: Tensor | None = None) -> None:
        """Write scattered ``points`` (and ``w``) into the model's parameters, in place."""
        values = self.scatter(points, w)
        targets: list[Tensor] = [self.params[name] for name in values]
        # one fused copy (torch's _foreach ops have no public names)
        torch._foreach_copy_(targets, list(values.values()))  # pyright: ignore[reportPrivateImportUsage]

    # ------------------------------------------------------------------ display
    def summary(self) -> str:
        """Readable description: kinds, heads, shapes, parameters covered and left adaptive."""
        plan = self.plan
        model = type(self.model).__name__
        lines = [
            f"ParameterGeometry of {model}: {len(plan.kinds)} kind(s), {len(plan.blocks)} block(s)"
        ]
        for i, kind in enumerate(plan.kinds):
            labels = [plan.blocks[b].label for b in kind.blocks]
            shown = ", ".join(labels[:3]) + (f", … (+{len(labels) - 3})" if len(labels) > 3 else "")
            lines.append(f"  [{i}] {kind.describe()}, {len(labels)} block(s): {shown}")
        total = self.n_symmetric + self.n_adaptive
        lines.append(
            f"  symmetric: {self.n_symmetric:,} of {total:,} trainable entries in "
            f"{len(plan.assembly)} tensor(s)"
        )
        names = self.adaptive_names + [f"{n} (partly)" for n in plan.partial]
        shown = ", ".join(names[:4]) + (f", … (+{len(names) - 4})" if len(names) > 4 else "")
        lines.append(
            f"  adaptive:  {self.n_adaptive:,} entries in {len(names)} tensor(s)"
            + (f": {shown}" if names else "")
        )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()
