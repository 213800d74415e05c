"""Errors that name the weights at fault when the parameter geometry cannot be used.

The geometry of a GL kind factorizes the Gram matrices ``GᵀG`` and ``HᵀH`` of every head; a
rank-deficient (or non-finite) factor makes a factorization fail deep inside the manifold,
with a message that cannot say where the factor came from. :class:`Diagnosis` gathers the
points of one model when a failure needs explaining and turns it into a ``ValueError`` that
names the block label, the layer, the head and the parameters at fault, checking every head of
every kind at once. It costs nothing until something fails, except
:meth:`Diagnosis.check_finite` (one reduction per parameter and one host synchronisation),
which callers run once per call where non-finite weights must be told apart from rank
deficiency before anything fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from ..linalg import LinAlgError, gram
from ..manifolds import FrameDamping, GLQuotient, QuotientManifold
from ..manifolds.gl.damping import relaxation
from .parameters import ParameterGeometry
from .plan import HeadLocation

Tensor = torch.Tensor

__all__ = ["Diagnosis"]

SHOWN = 4  # entries listed in a message before "… and k more"
_PACKAGE = Path(__file__).resolve().parents[1]


def _finite(t: Tensor) -> bool:
    """All entries finite (``aminmax`` propagates NaN and keeps ±inf; no tensor of ``t``'s
    size is allocated)."""
    if t.numel() == 0:
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(t.detach()))).all())


def _from_geometry(err: BaseException) -> bool:
    """Did ``err`` come out of the geometry's linear algebra: a ``LinAlgError`` in its chain of
    causes, or a ``ValueError`` raised in the manifolds or :mod:`quotientgeo.linalg`?"""
    seen, e = set(), err
    while e is not None and id(e) not in seen:
        if isinstance(e, LinAlgError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    frames = traceback.extract_tb(err.__traceback__)
    if not isinstance(err, ValueError) or not frames:
        return False
    path = Path(frames[-1].filename).resolve()
    return path == _PACKAGE / "linalg.py" or path.is_relative_to(_PACKAGE / "manifolds")


def _gl(manifold: QuotientManifold) -> QuotientManifold:
    """The :class:`GLQuotient` whose factors a manifold factorizes (itself, or the ``gl`` of a
    subgroup quotient such as :class:`~quotientgeo.RotaryGLQuotient`), else the manifold."""
    gl = getattr(manifold, "gl", None)
    return gl if isinstance(gl, GLQuotient) else manifold


def _listed(lines: list[str]) -> str:
    """The first :data:`SHOWN` lines, indented, and how many more there are."""
    out = [f"  {line}" for line in lines[:SHOWN]]
    if len(lines) > SHOWN:
        out.append(f"  … and {len(lines) - SHOWN} more")
    return "\n".join(out)


def _heads(locations: list[HeadLocation]) -> str:
    """``label (layer k), head(s) i, j`` for each block of ``locations``, in order."""
    by_block: dict[int, list[HeadLocation]] = {}
    for loc in locations:
        by_block.setdefault(loc.block, []).append(loc)
    parts = []
    for locs in by_block.values():
        first = locs[0]
        layer = "" if first.layer is None else f" (layer {first.layer})"
        heads = [str(loc.head) for loc in locs]
        shown = ", ".join(heads[:SHOWN]) + (
            f", … (+{len(heads) - SHOWN})" if len(heads) > SHOWN else ""
        )
        parts.append(f"{first.label}{layer}, head{'s' if len(heads) > 1 else ''} {shown}")
    return "; ".join(parts)


class Diagnosis:
    """The points of a model, gathered when a failure needs explaining.

    Args:
        geometry: the model's :class:`~quotientgeo.geometry.ParameterGeometry`.
        manifolds: one manifold per kind, as used.
        gather: ``gather() -> (points, w)``, the kinds' points and the adaptive vector
            (``geometry.gather()``), called once, on the first failure to explain; ``None``
            where gathering is not possible (a sharded model): failures are then not located.
        restored: what the caller did with the model, ending every message (``"the model is
            restored"``).
    """

    def __init__(
        self,
        geometry: ParameterGeometry,
        manifolds: Sequence[QuotientManifold],
        gather: Callable[[], tuple[list[Tensor], Tensor]] | None,
        restored: str,
    ):
        self.geometry = geometry
        self.manifolds = list(manifolds)
        self._gather = gather
        self._gathered: tuple[list[Tensor], Tensor] | None = None
        self.restored = restored

    @property
    def points(self) -> list[Tensor]:
        return self._read()[0]

    @property
    def w(self) -> Tensor:
        return self._read()[1]

    def _read(self) -> tuple[list[Tensor], Tensor]:
        if self._gathered is None:
            if self._gather is None:
                raise RuntimeError("the points of a sharded model are not gathered")
            self._gathered = self._gather()
        return self._gathered

    # ------------------------------------------------------------------ non-finite weights
    def check_finite(self, tensors: Mapping[str, Tensor] | None = None) -> None:
        """Raise the :meth:`non_finite` error if a parameter (or its entry of ``tensors``, by
        name: local parts on a sharded model, all ranks checking together) has a NaN or an
        infinity: one ``aminmax`` per tensor, one host synchronisation."""
        params = self.geometry.params
        source = params if tensors is None else tensors
        names = [n for n in params if source[n].numel()]
        if not names:
            return
        extremes = torch.stack([torch.stack(torch.aminmax(source[n].detach())) for n in names])
        finite = torch.isfinite(extremes).all(-1).to(torch.int32)
        if self._gather is None:  # sharded: every rank learns of a non-finite entry anywhere
            torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        if not bool(finite.all()):
            bad = [n for n, ok in zip(names, finite.tolist(), strict=True) if not ok]
            raise self.non_finite(bad)

    def non_finite_heads(self) -> list[HeadLocation]:
        """Every head (batch entry of a kind) with a non-finite entry, kind by kind, its
        ``params`` restricted to the parameters holding the non-finite rows."""
        found = []
        for ki, x in enumerate(self.points):
            if x.numel() == 0 or _finite(x):
                continue
            rows = ~torch.isfinite(x.detach()).all(-1)  # (batch, rows of a point)
            heads = rows.any(-1).nonzero().flatten().tolist()
            for i, bad in zip(heads, rows[heads].tolist(), strict=True):
                loc = self.geometry.locate(ki, i)
                names, start = [], 0
                for region in self.geometry.plan.blocks[loc.block].regions:
                    if any(bad[start : start + region.k]) and region.name not in names:
                        names.append(region.name)
                    start += region.k
                found.append(dataclasses.replace(loc, params=tuple(names)))
        return found

    def non_finite(self, names: list[str] | None = None) -> ValueError:
        """The error naming the parameters with non-finite entries (``names``, default: found
        here) and, where they are in symmetry blocks, the blocks, layers and heads."""
        plan = self.geometry.plan
        if names is None:
            names = [n for n, p in self.geometry.params.items() if not _finite(p)]
        if self._gather is None:  # sharded: the parameters only
            return ValueError(
                f"non-finite weights (NaN or Inf) in {len(names)} parameter(s):\n"
                f"{_listed(names)}\n"
                f"sharpness and geodesic steps need finite weights; {self.restored}"
            )
        heads = self.non_finite_heads()
        rest = set()
        if self.w.numel():
            parts = torch.split(self.w.detach(), list(plan.adaptive_sizes))
            rest = {n for n, part in zip(plan.rest_names, parts, strict=True) if not _finite(part)}
        lines = []
        for name in names:
            where = [loc for loc in heads if name in loc.params]
            text = _heads(where) if where else ""
            if name in rest:
                text += ("; " if text else "") + (
                    "its adaptive entries" if where or name in plan.partial else "adaptive geometry"
                )
            lines.append(f"{name}: {text}" if text else name)
        return ValueError(
            f"non-finite weights (NaN or Inf) in {len(names)} parameter(s):\n"
            f"{_listed(lines)}\n"
            f"sharpness and geodesic steps need finite weights; {self.restored}"
        )

    # ------------------------------------------------------------------ rank deficiency
    def _deficient(self, ki: int) -> list[tuple[HeadLocation, str, float]]:
        """``(location, what, condition number)`` of every failing head of kind ``ki``:
        for GL pairs each factor ``F`` (``"G"``, ``"H"``) whose relaxed Gram matrix
        ``FᵀF + eps·I`` has ``cond ≥ 1 / eps`` of the dtype or no Cholesky factor, located to
        the parameters holding that factor; for other manifolds each head their own point
        check refuses (``what`` is its reason)."""
        m, x = self.manifolds[ki], self.points[ki].detach()
        if x.numel() == 0:
            return []
        gl = _gl(m)
        found = []
        if isinstance(gl, GLQuotient):
            threshold = 1 / torch.finfo(x.dtype).eps
            rows = {"G": (0, gl.n), "H": (gl.n, x.shape[-2])}
            framed = isinstance(gl.eps, FrameDamping)  # G may be anything, H needs full rank
            try:
                eps = 0.0 if isinstance(gl.eps, FrameDamping) else relaxation(gl.eps, *gl.split(x))
            except ValueError:  # a ball damping without its radius, or a zero pair
                eps = 0.0
            flat = eps.flatten() if isinstance(eps, torch.Tensor) else eps
            for name, F in zip(("G", "H"), gl.split(x), strict=True):
                if framed and name == "G":
                    continue
                s = torch.linalg.svdvals(F)
                big, small = s[..., 0], s[..., -1]
                cond = torch.where(small > 0, big / small, math.inf)
                relaxed = (big.square() + flat) / (small.square() + flat)
                failed = torch.linalg.cholesky_ex(gram(F, eps)).info != 0
                bad = failed | ~(relaxed < threshold)  # NaN (0/0) counts as deficient
                for i in bad.nonzero().flatten().tolist():
                    loc = self.geometry.locate(ki, i, rows[name])
                    found.append((loc, name, float(cond[i])))
            return found
        if m._check_point_on_manifold(x)[0]:
            return []
        for i in range(x.shape[0]):
            ok, reason = m._check_point_on_manifold(x[i : i + 1])
            if not ok:
                found.append((self.geometry.locate(ki, i), reason, math.nan))
        return found

    def rank_deficient(self) -> ValueError | None:
        """The error naming every rank-deficient head (block label, layer, head, factor and
        parameters), with the dtype, the worst condition number and the remedies (heads of
        other manifolds: their point check's reason); ``None`` when every head passes (or the
        heads cannot be examined)."""
        if self._gather is None:
            return None
        try:
            found = [f for ki in range(len(self.points)) for f in self._deficient(ki)]
        except Exception:  # the diagnosis must never hide the failure it explains
            return None
        if not found:
            return None
        dtype = self.points[0].dtype
        heads = len({(loc.kind, loc.index) for loc, _, _ in found})
        lines = []
        for loc, what, cond in found:
            if math.isnan(cond):
                lines.append(f"{loc}: {what} ({', '.join(loc.params)})")
            else:
                lines.append(
                    f"{loc}: {what} has condition number {cond:.3g} ({', '.join(loc.params)})"
                )
        conds = [c for _, _, c in found if not math.isnan(c)]
        if not conds:  # no GL factor: the manifolds' own reasons say what is wrong
            return ValueError(
                f"degenerate points in {heads} head(s) of the symmetry blocks:\n"
                f"{_listed(lines)}\n{self.restored}"
            )
        limit = torch.finfo(dtype).eps ** -0.5
        declared = [getattr(_gl(self.manifolds[loc.kind]), "eps", 0.0) for loc, _, _ in found]
        eps = max((e for e in declared if isinstance(e, (int, float))), default=0.0)
        remedies = [] if dtype == torch.float64 else ["compute in float64"]
        remedies.append(
            f"relax the geometry with an eps larger than {eps:g}"
            if eps > 0
            else "relax the geometry with eps > 0 (Gram matrices GᵀG + eps·I) or, for a pair "
            "whose H has full rank, with eps=FrameDamping() (GᵀG + (ρ/κ)²(HᵀH)⁻¹, exactly "
            "invariant: the default of LoRA adapters, which start at B = 0)"
        )
        what = "rank-deficient factors" if len(conds) == len(found) else "degenerate points"
        return ValueError(
            f"{what} in {heads} head(s) of the symmetry blocks at {dtype} precision "
            f"(a condition number ≥ {limit:.2g} is deficient; worst condition number "
            f"{max(conds):.3g}):\n"
            f"{_listed(lines)}\n"
            f"{' or '.join(remedies)}; {self.restored}"
        )

    # ------------------------------------------------------------------ failures
    def explain(self, err: BaseException) -> ValueError | None:
        """The error that names the weights behind ``err``, a failure of the geometry's linear
        algebra (a ``LinAlgError``, or a ``ValueError`` of the manifolds): non-finite heads
        first, then rank-deficient ones. ``None`` when ``err`` did not come from there or no
        weight is at fault (then ``err`` stands as it is)."""
        if not isinstance(err, Exception) or not _from_geometry(err) or self._gather is None:
            return None
        try:
            if self.non_finite_heads():
                return self.non_finite()
            return self.rank_deficient()
        except Exception:  # the diagnosis must never hide the failure it explains
            return None

    @contextlib.contextmanager
    def located(self):
        """Re-raise a failure of the geometry in the block as :meth:`explain`'s error, chained
        from it; anything else passes through unchanged."""
        try:
            yield
        except Exception as err:
            located = self.explain(err)
            if located is None:
                raise
            raise located from err
