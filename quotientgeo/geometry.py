r"""Parameter geometry of a model: which weights form symmetry blocks, gathered and scattered.

A :class:`ParameterGeometry` splits the trainable parameters of a :class:`torch.nn.Module` into

- **symmetry blocks**: pairs of factors that enter the network only through ``G Hᵀ`` (a GL(h)
  pair per attention head, DESIGN.md section 6) or through ``u ⊙ v`` (a re-scaling pair).
  All blocks of one *kind* (same type and shape) are stored batched in one tensor, shape
  ``(batch, n+m, h)`` for GL pairs and ``(batch, 2, d)`` for re-scaling pairs, so that one
  :class:`~quotientgeo.GLQuotient` / :class:`~quotientgeo.RescaleQuotient` handles all heads
  of all layers at once;
- the **adaptive rest**: every other trainable element, flattened into one vector ``w`` for
  the element-wise geometry of adaptive sharpness (:class:`~quotientgeo.AdaptiveGeometry`).

:meth:`ParameterGeometry.gather` reads the points from the model; :meth:`ParameterGeometry.scatter`
maps (perturbed) points back to a dict ``name -> tensor`` with differentiable view, transpose
and concatenation operations only; it never writes to the model. Scattering the gathered
points reproduces every parameter exactly.

:func:`find_symmetries` discovers the attention and LoRA blocks of a model; the explicit API
(:meth:`ParameterGeometry.add_gl_pair`, :meth:`ParameterGeometry.add_rescale_pair`) declares
anything else (diagonal networks, custom attention).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .manifolds import GLQuotient, InterpolatedGLQuotient, RescaleQuotient

Tensor = torch.Tensor

__all__ = ["Block", "ParameterGeometry", "Source", "find_symmetries"]

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Source:
    """Where one parameter contributes rows to a factor of a symmetry block.

    The parameter is seen as a 2-D matrix ``V`` (1-D parameters of length ``L`` as ``(L, 1)``,
    2-D ones as they are, anything else through ``view``), and the region ``V[rows, cols]``
    belongs to the block. For a GL pair with ``heads`` heads of width ``h``:

    - ``axis=0`` (the ``nn.Linear`` weight convention ``x Wᵀ``): the region's rows are the heads'
      features, ``heads·h`` of them; head ``i`` contributes ``V[rows][i·h:(i+1)·h, cols]ᵀ``, i.e.
      ``len(cols)`` rows of its factor. A bias ``b`` (``axis=0``) contributes one row ``b_i``.
    - ``axis=1`` (an output projection ``W_o[:, head columns]``): the region's columns are the
      heads' features; head ``i`` contributes ``V[rows, cols][:, i·h:(i+1)·h]``.

    For a re-scaling pair the whole region is flattened (``axis`` is ignored).
    """

    param: str
    axis: int = 0
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None
    view: tuple[int, int] | None = None


@dataclass(frozen=True)
class Block:
    """A declared symmetry: a GL(h) pair per head, or an element-wise re-scaling pair."""

    type: str  # "gl" or "rescale"
    g: tuple[Source, ...]
    h: tuple[Source, ...]
    heads: int
    label: str


@dataclass
class _Piece:
    """A resolved source: region bounds and the number of factor rows per head."""

    src: Source
    name: str  # canonical parameter name
    view: tuple[int, int]
    r: tuple[int, int]
    c: tuple[int, int]
    k: int  # rows contributed to the factor (gl) or entries (rescale)


@dataclass
class _BlockPlan:
    """A validated block: resolved pieces and the kind it joins."""

    gp: list[_Piece]
    hp: list[_Piece]
    key: tuple
    shape: tuple[int, int]
    size: int  # batch entries (heads) contributed
    n: int


class _BlockChecker:
    """Checks :class:`ParameterGeometry` blocks one at a time against those accepted before.

    Keeps what the checks need across blocks: the covered regions of every parameter (host
    boolean masks over its 2-D view) and the view each parameter is seen through. :meth:`add`
    costs only the new block's pieces, and an invalid block leaves the state untouched.
    """

    def __init__(self, geometry: ParameterGeometry):
        self.geometry = geometry
        self.coverage: dict[str, Tensor] = {}
        self.views: dict[str, tuple[int, int]] = {}
        self.plans: list[_BlockPlan] = []

    def add(self, block: Block) -> _BlockPlan:
        """Check ``block``; record and return its plan, or raise with nothing recorded."""
        geometry = self.geometry
        if block.heads < 1:
            raise ValueError(f"{block.label}: heads must be >= 1, got {block.heads}")
        gp = [geometry._resolve(s, block) for s in block.g]
        hp = [geometry._resolve(s, block) for s in block.h]
        if block.type == "gl":
            widths = {geometry._width(p, block) for p in gp + hp}
            if len(widths) != 1:
                raise ValueError(
                    f"{block.label}: the sources give different head widths {sorted(widths)}"
                )
            hw = widths.pop()
            n, m = sum(p.k for p in gp), sum(p.k for p in hp)
            if hw > n or hw > m:
                raise ValueError(
                    f"{block.label}: head width {hw} exceeds the factor rows (G {n}×{hw}, "
                    f"H {m}×{hw}); full column rank needs h <= n and h <= m"
                )
            key, shape, size = ("gl", n, m, hw), (n + m, hw), block.heads
        elif block.type == "rescale":
            n, m = sum(p.k for p in gp), sum(p.k for p in hp)
            if n != m:
                raise ValueError(f"{block.label}: u has {n} entries but v has {m}")
            key, shape, size, n = ("rescale", n), (2, n), 1, 1
        else:
            raise ValueError(f"unknown block type {block.type!r}")
        filled: list[Tensor] = []
        new_masks: list[str] = []
        new_views: list[str] = []
        try:
            for p in gp + hp:
                mask = self.coverage.get(p.name)
                if mask is None:
                    mask = self.coverage[p.name] = torch.zeros(p.view, dtype=torch.bool)
                    new_masks.append(p.name)
                region = mask[p.r[0] : p.r[1], p.c[0] : p.c[1]]
                if bool(region.any()):
                    raise ValueError(
                        f"{block.label}: rows {p.r}, cols {p.c} of {p.name!r} already belong to "
                        "another block"
                    )
                region.fill_(True)
                filled.append(region)
            for p in gp + hp:
                view = self.views.get(p.name)
                if view is None:
                    self.views[p.name] = p.view
                    new_views.append(p.name)
                elif view != p.view:
                    raise ValueError(
                        f"{block.label}: parameter {p.name!r} is viewed as {view} by another "
                        f"block and as {p.view} here"
                    )
        except Exception:
            # every filled region was all False before (it was checked), so this restores it
            for region in filled:
                region.fill_(False)
            for name in new_masks:
                del self.coverage[name]
            for name in new_views:
                del self.views[name]
            raise
        plan = _BlockPlan(gp, hp, key, shape, size, n)
        self.plans.append(plan)
        return plan


@dataclass
class Kind:
    """All blocks of one type and shape, stored as one batched tensor."""

    type: str
    shape: tuple[int, ...]  # (n+m, h) for gl, (2, d) for rescale
    n: int  # rows of G (gl), 1 (rescale)
    blocks: list[int] = field(default_factory=list)  # indices into ParameterGeometry.blocks
    sizes: list[int] = field(default_factory=list)  # batch entries contributed by each block

    @property
    def batch(self) -> int:
        return sum(self.sizes)

    def manifold(self, metric: str | float = "mix", *, eps: float = 0.0, exp_steps: int = 10):
        """The quotient manifold of this kind for ``metric``.

        ``metric`` is ``"inv"``, ``"mix"`` or, for GL kinds, a number ``s ∈ [0, 1]``: the
        metric ``(1-s)·inv + s·mix`` of :class:`~quotientgeo.InterpolatedGLQuotient`.
        """
        if not isinstance(metric, str):
            if self.type != "gl":
                raise ValueError(
                    f"the interpolated metric s={metric} is defined for GL pairs only; "
                    "re-scaling pairs take metric='inv' or 'mix'"
                )
            return InterpolatedGLQuotient(self.n, float(metric), eps=eps, exp_steps=exp_steps)
        if self.type == "gl":
            return GLQuotient(self.n, metric=metric, eps=eps, exp_steps=exp_steps)
        return RescaleQuotient(metric=metric, exp_steps=exp_steps)

    def describe(self) -> str:
        if self.type == "gl":
            n, h = self.n, self.shape[1]
            return f"GL({h}) pairs, G {n}×{h}, H {self.shape[0] - n}×{h}"
        return f"re-scaling pairs, d={self.shape[1]}"


def _as_sources(spec) -> tuple[Source, ...]:
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


class ParameterGeometry:
    """Symmetry blocks and adaptive rest of a model's trainable parameters (module docstring).

    Args:
        model: the module whose trainable parameters (``requires_grad``) are described.
        blocks: optional :class:`Block` declarations to start from.

    The model is only read: :meth:`gather` copies its parameters, :meth:`scatter` builds new
    tensors, and only :meth:`assign_` writes (in place, explicitly).
    """

    def __init__(self, model: nn.Module, blocks: Iterable[Block] = ()):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self._all = dict(model.named_parameters(remove_duplicate=False))
        canonical: dict[int, str] = {}
        for name, p in model.named_parameters():
            canonical[id(p)] = name
        self._canonical = {name: canonical[id(p)] for name, p in self._all.items()}
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.blocks: list[Block] = []
        self._checker = _BlockChecker(self)
        for block in blocks:
            self._add(block, build=False)
        self._build()

    # ------------------------------------------------------------------ declaration
    def add_gl_pair(self, g, h, *, heads: int = 1, label: str | None = None) -> ParameterGeometry:
        """Declare GL pairs ``(G, H)``, one per head, that enter the network through ``G Hᵀ``.

        ``g`` and ``h`` are parameter names or :class:`Source` objects (or lists of them,
        stacked as factor rows in order). A plain name means ``Source(name)``: an ``nn.Linear``
        weight or bias whose output features are the heads' features. Use
        ``Source(name, axis=1)`` for an output projection whose input columns belong to the
        heads, and ``rows``/``cols`` to select slices. Returns ``self``.
        """
        label = label or f"GL pair {len(self.blocks)}"
        return self._add(Block("gl", _as_sources(g), _as_sources(h), int(heads), label))

    def add_rescale_pair(self, u, v, *, label: str | None = None) -> ParameterGeometry:
        """Declare an element-wise re-scaling pair ``(u, v) ~ (α u, v / α)`` (``β = u ⊙ v``).

        ``u`` and ``v`` are parameter names or :class:`Source` objects of equal size; their
        regions are flattened to ``d`` entries. Returns ``self``.
        """
        label = label or f"re-scaling pair {len(self.blocks)}"
        return self._add(Block("rescale", _as_sources(u), _as_sources(v), 1, label))

    def _add(self, block: Block, *, build: bool = True) -> ParameterGeometry:
        """Validate ``block`` against the blocks declared so far and append it.

        An invalid block raises and leaves the geometry exactly as it was. Validation costs
        only the new block's pieces; ``build=False`` defers the plan (:meth:`_build`, linear in
        the number of blocks), so that :func:`find_symmetries` plans once for all its blocks.
        """
        self._checker.add(block)
        self.blocks.append(block)
        if build:
            self._build()
        return self

    # ------------------------------------------------------------------ plan
    def _resolve(self, src: Source, block: Block) -> _Piece:
        if src.param not in self._all:
            raise KeyError(f"{block.label}: the model has no parameter named {src.param!r}")
        name = self._canonical[src.param]
        if name not in self.params:
            raise ValueError(
                f"{block.label}: parameter {src.param!r} is frozen (requires_grad=False); "
                "only trainable parameters can form symmetry blocks"
            )
        p = self.params[name]
        if src.view is not None:
            view = tuple(int(s) for s in src.view)
            if math.prod(view) != p.numel() or len(view) != 2:
                raise ValueError(
                    f"{block.label}: view {src.view} does not fit parameter {name!r} of shape "
                    f"{tuple(p.shape)}"
                )
        elif p.dim() == 1:
            view = (p.shape[0], 1)
        elif p.dim() == 2:
            view = tuple(p.shape)
        else:
            raise ValueError(
                f"{block.label}: parameter {name!r} has shape {tuple(p.shape)}; "
                "give Source(view=(rows, cols))"
            )

        def bounds(span, size, what):
            start, stop = (0, size) if span is None else (int(span[0]), int(span[1]))
            if not 0 <= start < stop <= size:
                raise ValueError(
                    f"{block.label}: {what} {span} out of range for {name!r} viewed as {view}"
                )
            return start, stop

        r = bounds(src.rows, view[0], "rows")
        c = bounds(src.cols, view[1], "cols")
        if src.axis not in (0, 1):
            raise ValueError(f"{block.label}: Source.axis must be 0 or 1, got {src.axis}")
        R, C = r[1] - r[0], c[1] - c[0]
        if block.type == "rescale":
            return _Piece(src, name, view, r, c, R * C)
        feat, k = (R, C) if src.axis == 0 else (C, R)
        if feat % block.heads:
            raise ValueError(
                f"{block.label}: {feat} head features of {name!r} do not split into "
                f"{block.heads} heads"
            )
        return _Piece(src, name, view, r, c, k)

    def _build(self) -> None:
        """Group the validated blocks into kinds and plan gather/scatter (no tensors copied)."""
        checker = self._checker
        self.kinds: list[Kind] = []
        self._pieces: list[tuple[list[_Piece], list[_Piece]]] = []
        self._block_kind: list[int] = []
        index: dict[tuple, int] = {}
        for bi, (block, plan) in enumerate(zip(self.blocks, checker.plans, strict=True)):
            if plan.key not in index:
                index[plan.key] = len(self.kinds)
                self.kinds.append(Kind(block.type, plan.shape, plan.n))
            kind = self.kinds[index[plan.key]]
            kind.blocks.append(bi)
            kind.sizes.append(plan.size)
            self._pieces.append((plan.gp, plan.hp))
            self._block_kind.append(index[plan.key])
        coverage = checker.coverage
        # adaptive rest: whole parameters, then uncovered elements of partially covered ones
        self.adaptive_names = [n for n in self.params if n not in coverage]
        uncovered = {n: ~mask for n, mask in coverage.items() if not bool(mask.all())}
        self._adaptive_sizes = [self.params[n].numel() for n in self.adaptive_names] + [
            int(mask.sum()) for mask in uncovered.values()
        ]
        # uncovered-entry masks live on their parameter's device: gather/scatter index with
        # them on every evaluation, so they are moved once here, not once per call
        self._partial = {n: m.to(self.params[n].device) for n, m in uncovered.items()}
        # how each covered parameter is reassembled from its regions
        self._assembly: dict[str, tuple[str, list]] = {}
        regions: dict[str, list] = {}
        self._views: dict[str, tuple[int, int]] = dict(checker.views)
        for bi, (gp, hp) in enumerate(self._pieces):
            for j, p in enumerate(gp + hp):
                regions.setdefault(p.name, []).append((p.r, p.c, bi, j))
        for name, regs in regions.items():
            view = self._view_shape(name)
            rows = sorted(regs, key=lambda t: t[0])
            cols = sorted(regs, key=lambda t: t[1])
            if name not in self._partial and _tiles(rows, 0, view):
                self._assembly[name] = ("cat0", rows)
            elif name not in self._partial and _tiles(cols, 1, view):
                self._assembly[name] = ("cat1", cols)
            else:
                self._assembly[name] = ("scatter", regs)
        self._batched = self._plan_batched()

    def _plan_batched(self):
        """Scatter plan batched over layers, or ``None`` (then :meth:`scatter` goes per block).

        Possible when every kind is homogeneous (all its blocks lay out the same regions of
        same-shaped parameters) and every covered parameter is a concatenation of regions taken
        at one block position: then each (kind, source) region is formed for all layers at
        once, and parameters of all layers come from one ``cat`` and ``unbind``.
        """
        signature = []
        for block, (gp, hp) in zip(self.blocks, self._pieces, strict=True):
            layout = tuple((p.src.axis, p.k, p.r, p.c, p.view) for p in gp + hp)
            signature.append((block.type, block.heads, layout))
        position = {}
        for ki, kind in enumerate(self.kinds):
            if kind.type != "gl" or len({signature[b] for b in kind.blocks}) != 1:
                return None
            for i, b in enumerate(kind.blocks):
                position[b] = (ki, i)
        groups: dict[tuple, dict[int, str]] = {}
        for name, (mode, regs) in self._assembly.items():
            at = {position[bi][1] for _, _, bi, _ in regs}
            if mode == "scatter" or len(at) != 1:
                return None
            key = (mode, tuple((position[bi][0], j) for _, _, bi, j in regs))
            groups.setdefault(key, {})[at.pop()] = name
        plan = []
        for (mode, sources), members in groups.items():
            n = len(members)
            if sorted(members) != list(range(n)):
                return None
            if any(len(self.kinds[ki].blocks) != n for ki, _ in sources):
                return None
            plan.append((1 if mode == "cat0" else 2, sources, [members[i] for i in range(n)]))
        return plan

    def _width(self, p: _Piece, block: Block) -> int:
        R, C = p.r[1] - p.r[0], p.c[1] - p.c[0]
        return (R if p.src.axis == 0 else C) // block.heads

    def _view_shape(self, name: str) -> tuple[int, int]:
        return self._views[name]

    def _partial_mask(self, name: str, device: torch.device) -> Tensor:
        """Mask of the uncovered entries of ``name`` (in its view) on ``device``.

        Built on the parameter's device by :meth:`_build`; moved (and kept there) only if the
        model has been moved since, so steady-state calls copy nothing.
        """
        mask = self._partial[name]
        if mask.device != device:
            mask = self._partial[name] = mask.to(device)
        return mask

    # ------------------------------------------------------------------ properties
    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of gathered points: the parameters' promoted dtype, at least float32."""
        dtype = torch.float32
        for p in self.params.values():
            if p.dtype.is_floating_point and p.dtype not in _HALF:
                dtype = torch.promote_types(dtype, p.dtype)
        return dtype

    @property
    def device(self) -> torch.device:
        devices = {p.device for p in self.params.values()}
        if len(devices) > 1:
            raise ValueError(f"parameters live on several devices {sorted(map(str, devices))}")
        return devices.pop() if devices else torch.device("cpu")

    @property
    def symmetric_names(self) -> list[str]:
        """Parameters (wholly or partly) in symmetry blocks."""
        return list(self._assembly)

    @property
    def n_symmetric(self) -> int:
        """Number of parameter entries covered by symmetry blocks."""
        return sum(k.batch * math.prod(k.shape) for k in self.kinds)

    @property
    def n_adaptive(self) -> int:
        """Number of parameter entries in the adaptive geometry."""
        return sum(self._adaptive_sizes)

    @property
    def n_heads(self) -> int:
        """Number of GL pairs (heads) over all kinds."""
        return sum(k.batch for k in self.kinds if k.type == "gl")

    def manifolds(
        self, metric: str | float = "mix", *, eps: float = 0.0, exp_steps: int = 10
    ) -> list:
        """One quotient manifold per kind (same order as :attr:`kinds` and :meth:`gather`)."""
        return [k.manifold(metric, eps=eps, exp_steps=exp_steps) for k in self.kinds]

    # ------------------------------------------------------------------ gather / scatter
    def gather(
        self, params: dict[str, Tensor] | None = None, *, dtype: torch.dtype | None = None
    ) -> tuple[list[Tensor], Tensor]:
        """Points of every kind and the flat adaptive vector, read from ``params``.

        Returns ``(points, w)``: ``points[i]`` has shape ``(kinds[i].batch, *kinds[i].shape)``;
        ``w`` holds the adaptive parameters flattened in :attr:`adaptive_names` order, then
        the uncovered entries of partially covered parameters. ``params`` defaults to the
        model's (detached) parameters; ``dtype`` to :attr:`compute_dtype`.
        """
        dtype = dtype or self.compute_dtype
        src = self.params if params is None else params

        def get(name: str) -> Tensor:
            return src[name].detach().to(dtype)

        points = []
        for kind in self.kinds:
            parts = [self._gather_block(bi, get) for bi in kind.blocks]
            points.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))
        flat = [get(n).reshape(-1) for n in self.adaptive_names]
        for name in self._partial:
            value = get(name)
            mask = self._partial_mask(name, value.device)
            flat.append(value.reshape(mask.shape)[mask])
        if flat:
            w = torch.cat(flat)
        else:
            w = torch.zeros(0, dtype=dtype, device=self.device)
        return points, w

    def _gather_block(self, bi: int, get) -> Tensor:
        block = self.blocks[bi]
        gp, hp = self._pieces[bi]
        if block.type == "rescale":
            u = torch.cat([_region(get(p.name), p).reshape(-1) for p in gp])
            v = torch.cat([_region(get(p.name), p).reshape(-1) for p in hp])
            return torch.stack((u, v)).unsqueeze(0)
        heads = block.heads
        rows = [_to_factor(_region(get(p.name), p), p.src.axis, heads) for p in gp + hp]
        return torch.cat(rows, dim=1)

    def scatter(self, points: Sequence[Tensor], w: Tensor | None = None) -> dict[str, Tensor]:
        """Parameters ``name -> tensor`` from ``points`` and ``w``: the inverse of :meth:`gather`.

        Differentiable; uses only views, transposes and concatenations (slice scatters where
        blocks cover parameters partially). Tensors are returned in the parameters' dtypes;
        parameters are never modified. ``w=None`` keeps the adaptive parameters out of the dict.
        """
        if len(points) != len(self.kinds):
            raise ValueError(f"expected {len(self.kinds)} point tensors, got {len(points)}")
        out: dict[str, Tensor] = {}
        pieces: list[list[Tensor]] = [None] * len(self.blocks)  # type: ignore[list-item]
        if self._batched is not None:
            out.update(self._scatter_batched(points))
        else:
            for kind, y in zip(self.kinds, points, strict=True):
                chunks = torch.split(y, kind.sizes, dim=0) if len(kind.sizes) > 1 else (y,)
                for bi, chunk in zip(kind.blocks, chunks, strict=True):
                    pieces[bi] = self._scatter_block(bi, chunk)
        residual: dict[str, Tensor] = {}
        if w is not None:
            if w.shape != (self.n_adaptive,):
                raise ValueError(
                    f"the adaptive vector must have shape ({self.n_adaptive},), "
                    f"got {tuple(w.shape)}"
                )
            parts = torch.split(w, self._adaptive_sizes) if self._adaptive_sizes else ()
            names = self.adaptive_names + list(self._partial)
            for name, part in zip(names, parts, strict=True):
                if name in self._partial:
                    residual[name] = part
                else:
                    p = self.params[name]
                    out[name] = part.view(p.shape).to(p.dtype)
        for name, (mode, regs) in self._assembly.items():
            if self._batched is not None:
                break
            p = self.params[name]
            if mode == "cat0":
                value = torch.cat([pieces[bi][j] for _, _, bi, j in regs], dim=0)
            elif mode == "cat1":
                value = torch.cat([pieces[bi][j] for _, _, bi, j in regs], dim=1)
            else:
                dtype = pieces[regs[0][2]][regs[0][3]].dtype
                value = p.detach().to(dtype).reshape(self._view_shape(name))
                for r, c, bi, j in regs:
                    region = pieces[bi][j]
                    if c != (0, value.shape[1]):
                        region = torch.slice_scatter(value[r[0] : r[1]], region, 1, c[0], c[1])
                    value = torch.slice_scatter(value, region, 0, r[0], r[1])
                if name in residual:
                    mask = self._partial_mask(name, value.device)
                    value = value.masked_scatter(mask, residual[name].to(dtype))
            out[name] = value.reshape(p.shape).to(p.dtype)
        return out

    def _scatter_batched(self, points: Sequence[Tensor]) -> dict[str, Tensor]:
        """Covered parameters of all layers at once (see :meth:`_plan_batched`)."""
        regions: dict[tuple[int, int], Tensor] = {}
        for ki, (kind, y) in enumerate(zip(self.kinds, points, strict=True)):
            heads, nb = self.blocks[kind.blocks[0]].heads, len(kind.blocks)
            gp, hp = self._pieces[kind.blocks[0]]
            ps = gp + hp
            parts = torch.split(y, [p.k for p in ps], dim=1) if len(ps) > 1 else (y,)
            for j, (p, part) in enumerate(zip(ps, parts, strict=True)):
                part = part.reshape(nb, heads, p.k, part.shape[-1])
                if p.src.axis == 0:  # (nb, heads, k, h) -> (nb, heads·h, k)
                    regions[ki, j] = part.transpose(2, 3).reshape(nb, -1, p.k)
                else:  # (nb, heads, k, h) -> (nb, k, heads·h)
                    regions[ki, j] = part.permute(0, 2, 1, 3).reshape(nb, p.k, -1)
        out = {}
        for dim, sources, names in self._batched:
            tensors = [regions[s] for s in sources]
            value = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)
            for name, v in zip(names, value.unbind(0), strict=True):
                p = self.params[name]
                out[name] = v.reshape(p.shape).to(p.dtype)
        return out

    def _scatter_block(self, bi: int, y: Tensor) -> list[Tensor]:
        """Regions ``V[rows, cols]`` of every source of block ``bi`` from its points ``y``."""
        block = self.blocks[bi]
        gp, hp = self._pieces[bi]
        if block.type == "rescale":
            out = []
            for row, ps in ((y[:, 0].reshape(-1), gp), (y[:, 1].reshape(-1), hp)):
                parts = torch.split(row, [p.k for p in ps]) if len(ps) > 1 else (row,)
                for p, part in zip(ps, parts, strict=True):
                    out.append(part.view(p.r[1] - p.r[0], p.c[1] - p.c[0]))
            return out
        ps = gp + hp
        parts = torch.split(y, [p.k for p in ps], dim=1) if len(ps) > 1 else (y,)
        return [_from_factor(part, p.src.axis) for p, part in zip(ps, parts, strict=True)]

    @torch.no_grad()
    def assign_(self, points: Sequence[Tensor], w: Tensor | None = None) -> None:
        """Write scattered ``points`` (and ``w``) into the model's parameters, in place."""
        for name, value in self.scatter(points, w).items():
            self.params[name].copy_(value)

    # ------------------------------------------------------------------ display
    def summary(self) -> str:
        """Readable description: kinds, heads, shapes, parameters covered and left adaptive."""
        model = type(self.model).__name__
        lines = [
            f"ParameterGeometry of {model}: {len(self.kinds)} kind(s), {len(self.blocks)} block(s)"
        ]
        for i, kind in enumerate(self.kinds):
            labels = [self.blocks[b].label for b in kind.blocks]
            shown = ", ".join(labels[:3]) + (f", … (+{len(labels) - 3})" if len(labels) > 3 else "")
            lines.append(
                f"  [{i}] {kind.describe()}: point {(kind.batch, *kind.shape)}, "
                f"{len(labels)} block(s): {shown}"
            )
        total = self.n_symmetric + self.n_adaptive
        sym_t = len(self._assembly)
        lines.append(
            f"  symmetric: {self.n_symmetric:,} of {total:,} trainable entries in {sym_t} tensor(s)"
        )
        names = self.adaptive_names + [f"{n} (partly)" for n in self._partial]
        shown = ", ".join(names[:4]) + (f", … (+{len(names) - 4})" if len(names) > 4 else "")
        lines.append(
            f"  adaptive:  {self.n_adaptive:,} entries in {len(names)} tensor(s)"
            + (f": {shown}" if names else "")
        )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()


# ---------------------------------------------------------------------- layout helpers
def _tiles(regs, axis: int, view: tuple[int, int]) -> bool:
    """Do the regions, sorted along ``axis``, tile the matrix as full slabs along ``axis``?"""
    other = 1 - axis
    pos = 0
    for r, c, _, _ in regs:
        span, full = (r, c) if axis == 0 else (c, r)
        if span[0] != pos or full != (0, view[other]):
            return False
        pos = span[1]
    return pos == view[axis]


def _region(param: Tensor, p: _Piece) -> Tensor:
    return param.reshape(p.view)[p.r[0] : p.r[1], p.c[0] : p.c[1]]


def _to_factor(region: Tensor, axis: int, heads: int) -> Tensor:
    """Region ``(heads·h, k)`` (axis 0) or ``(k, heads·h)`` (axis 1) -> ``(heads, k, h)``."""
    if axis == 0:
        return region.reshape(heads, -1, region.shape[1]).transpose(1, 2)
    return region.reshape(region.shape[0], heads, -1).permute(1, 0, 2)


def _from_factor(piece: Tensor, axis: int) -> Tensor:
    """Inverse of :func:`_to_factor`: ``(heads, k, h)`` -> the region."""
    heads, k, h = piece.shape
    if axis == 0:
        return piece.transpose(1, 2).reshape(heads * h, k)
    return piece.permute(1, 0, 2).reshape(k, heads * h)


# ---------------------------------------------------------------------- discovery
def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _linear(module, name: str) -> nn.Linear | None:
    m = getattr(module, name, None)
    return m if isinstance(m, nn.Linear) else None


def _config_value(module, *names):
    for holder in (module, getattr(module, "config", None)):
        if holder is None:
            continue
        for n in names:
            value = getattr(holder, n, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _rotary(model: nn.Module) -> str | None:
    """Name of a rotary position embedding in the model, if any."""
    for name, module in model.named_modules():
        cls = type(module).__name__.lower()
        if "rotary" in cls or "rope" in cls or "rotary" in name.lower():
            return name or cls
    config = getattr(model, "config", None)
    if config is not None:
        if getattr(config, "position_embedding_type", None) in ("rotary", "rope"):
            return "config.position_embedding_type"
        for attr in ("rope_theta", "rotary_dim", "rotary_pct", "rope_scaling"):
            if getattr(config, attr, None) not in (None, 0):
                return f"config.{attr}"
    return None


class _Finder:
    """Walks a model and declares the blocks it recognises on a :class:`ParameterGeometry`."""

    def __init__(self, model: nn.Module, warn: bool):
        self.model = model
        self.geometry = ParameterGeometry(model)
        self.warn = warn
        self.rotary = _rotary(model)
        self.parents = {}
        for name, module in model.named_modules():
            for child_name, child in module.named_children():
                self.parents[id(child)] = (name, module, child_name)

    def warning(self, message: str) -> None:
        if self.warn:
            warnings.warn(message, UserWarning, stacklevel=4)

    def declare(self, label: str, g, h, heads: int) -> None:
        names = [s.param for s in g + h]
        params = self.geometry._all
        trainable = [params[n].requires_grad for n in names]
        if not any(trainable):
            return
        if not all(trainable):
            self.warning(f"{label}: some factors are frozen; left to the adaptive geometry")
            return
        block = Block("gl", _as_sources(list(g)), _as_sources(list(h)), int(heads), label)
        try:
            self.geometry._add(block, build=False)  # validated now, planned once in run()
        except ValueError as err:
            self.warning(f"{label}: not mapped ({err}); left to the adaptive geometry")

    def qk_blocked(self, label: str, module) -> bool:
        """Warn and return True when something sits between the query and key factors."""
        reasons = []
        for attr in ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_norm", "key_norm"):
            if isinstance(getattr(module, attr, None), nn.Module):
                reasons.append(f"a per-head norm ({attr})")
        pos = getattr(module, "position_embedding_type", None)
        if pos is None:
            pos = getattr(getattr(module, "config", None), "position_embedding_type", None)
        if isinstance(pos, str) and pos != "absolute":
            reasons.append(f"position_embedding_type={pos!r}")
        if self.rotary is not None:
            reasons.append(f"rotary position embeddings ({self.rotary})")
        if reasons:
            self.warning(
                f"{label}: the QK pair is not an exact symmetry because of "
                + " and ".join(reasons)
                + "; left to the adaptive geometry (the VO pair is still mapped)"
            )
        return bool(reasons)

    # -------------------------------------------------------------- per pattern
    def mha(self, prefix: str, m: nn.MultiheadAttention) -> None:
        E, heads = m.embed_dim, m.num_heads
        j = lambda n: _join(prefix, n)  # noqa: E731
        if m._qkv_same_embed_dim:
            q = [Source(j("in_proj_weight"), rows=(0, E))]
            k = [Source(j("in_proj_weight"), rows=(E, 2 * E))]
            v = [Source(j("in_proj_weight"), rows=(2 * E, 3 * E))]
        else:
            q, k, v = ([Source(j(f"{x}_proj_weight"))] for x in "qkv")
        if m.in_proj_bias is not None:
            q.append(Source(j("in_proj_bias"), rows=(0, E)))
            k.append(Source(j("in_proj_bias"), rows=(E, 2 * E)))
            v.append(Source(j("in_proj_bias"), rows=(2 * E, 3 * E)))
        # bias_k / bias_v are an extra key / value token: one more row of H / G
        if m.bias_k is not None:
            k.append(Source(j("bias_k"), view=(E, 1)))
        if m.bias_v is not None:
            v.append(Source(j("bias_v"), view=(E, 1)))
        o = [Source(j("out_proj.weight"), axis=1)]
        name = prefix or type(m).__name__
        self.declare(f"{name}.QK", q, k, heads)
        self.declare(f"{name}.VO", v, o, heads)

    def linear_sources(self, prefix: str, attr: str, lin: nn.Linear) -> list[Source]:
        out = [Source(_join(prefix, f"{attr}.weight"))]
        if lin.bias is not None:
            out.append(Source(_join(prefix, f"{attr}.bias")))
        return out

    def qkv(self, prefix: str, m, names: tuple[str, str, str]) -> bool:
        """``query/key/value`` (BERT, ViT), ``q_proj/k_proj/v_proj`` (BART, OPT, CLIP, Llama)."""
        lins = [_linear(m, n) for n in names]
        if any(lin is None for lin in lins):
            return False
        heads = _config_value(m, "num_attention_heads", "num_heads", "n_heads", "n_head")
        label = prefix or type(m).__name__
        if heads is None:
            self.warning(f"{label}: attention head count not found; left to the adaptive geometry")
            return True
        kv_heads = _config_value(m, "num_key_value_heads", "num_kv_heads", "n_kv_heads")
        q_lin, k_lin, v_lin = lins
        if kv_heads not in (None, heads) or k_lin.out_features != q_lin.out_features:
            self.warning(
                f"{label}: grouped-query attention ({kv_heads} key/value heads for {heads} "
                "query heads) is not mapped; left to the adaptive geometry"
            )
            return True
        out = self.output_projection(prefix, m, v_lin.out_features)
        sources = [self.linear_sources(prefix, n, lin) for n, lin in zip(names, lins, strict=True)]
        if not self.qk_blocked(label, m):
            self.declare(f"{label}.QK", sources[0], sources[1], heads)
        if out is None:
            self.warning(
                f"{label}: output projection not found; VO pair left to the adaptive geometry"
            )
        else:
            self.declare(f"{label}.VO", sources[2], [Source(out, axis=1)], heads)
        return True

    def output_projection(self, prefix: str, m, width: int) -> str | None:
        """Name of the weight that maps the concatenated heads back (own or parent's)."""
        for attr in ("o_proj", "out_proj", "o", "dense", "out"):
            lin = _linear(m, attr)
            if lin is not None and lin.in_features == width:
                return _join(prefix, f"{attr}.weight")
        parent = self.parents.get(id(m))
        if parent is not None:
            pname, pmod, _ = parent
            out = getattr(pmod, "output", None)
            lin = _linear(out, "dense") if out is not None else None
            if lin is not None and lin.in_features == width:
                return _join(pname, "output.dense.weight")
        return None

    def lora(self, prefix: str, m) -> bool:
        """LoRA adapters: ``lora_A``/``lora_B`` modules (PEFT) or parameters (loralib)."""
        found = False
        for a_attr, b_attr in (("lora_A", "lora_B"), ("lora_embedding_A", "lora_embedding_B")):
            A, B = getattr(m, a_attr, None), getattr(m, b_attr, None)
            if A is None or B is None:
                continue
            found = True
            if isinstance(A, nn.Parameter) and isinstance(B, nn.Parameter):
                pairs = [("", A, B)]
            elif isinstance(A, (nn.ModuleDict, nn.ParameterDict)) and type(A) is type(B):
                pairs = [(f".{key}", A[key], B[key]) for key in A if key in B]
            else:
                continue
            for key, a, b in pairs:
                label = _join(prefix, f"{a_attr}{key}").replace(f".{a_attr}", ".lora")
                a_name, b_name = _join(prefix, f"{a_attr}{key}"), _join(prefix, f"{b_attr}{key}")
                if isinstance(a, nn.Linear) and isinstance(b, nn.Linear):
                    h = [Source(f"{a_name}.weight")]
                    if a.bias is not None:
                        h.append(Source(f"{a_name}.bias"))
                    g = [Source(f"{b_name}.weight", axis=1)]
                elif isinstance(a, nn.Parameter) and a.dim() == 2 and b.dim() == 2:
                    # B A with A (r, in), B (out, r): G = B, H = Aᵀ
                    h, g = [Source(a_name)], [Source(b_name, axis=1)]
                else:
                    continue
                self.declare(label, g, h, 1)
        return found

    def run(self) -> ParameterGeometry:
        for prefix, module in self.model.named_modules():
            if isinstance(module, nn.MultiheadAttention):
                self.mha(prefix, module)
            elif self.qkv(prefix, module, ("query", "key", "value")):
                pass
            elif self.qkv(prefix, module, ("q_proj", "k_proj", "v_proj")):
                pass
            elif self.qkv(prefix, module, ("q", "k", "v")):
                pass
            else:
                self.lora(prefix, module)
        self.geometry._build()
        return self.geometry


def find_symmetries(model: nn.Module, *, warn: bool = True) -> ParameterGeometry:
    """Discover the symmetry blocks of ``model`` (DESIGN.md section 6).

    Recognised: ``nn.MultiheadAttention`` (hence ``nn.Transformer*Layer``): a QK and a VO GL
    pair per head, in-projection biases (and ``bias_k``/``bias_v``) appended as factor rows;
    attention modules with ``query``/``key``/``value`` and an output ``dense`` (BERT, RoBERTa,
    ViT; the output may sit in the parent's ``output.dense``), ``q_proj``/``k_proj``/``v_proj``
    with ``o_proj``/``out_proj``, and ``q``/``k``/``v``/``o`` (T5); LoRA ``lora_A``/``lora_B``
    adapter pairs (a GL(r) pair ``G = W_B``, ``H = W_Aᵀ``). A QK pair with rotary position
    embeddings, relative position scores or a per-head norm between the factors is not an
    exact symmetry: it is left to the adaptive geometry with a warning, as are grouped-query
    attention and pairs whose factors are partly frozen. Every other trainable parameter is in
    the adaptive geometry.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return _Finder(model, warn).run()
