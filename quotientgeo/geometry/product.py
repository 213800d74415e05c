"""Blocks that overlap: one point holding the union of their entries, on a :class:`ProductQuotient`.

A product of blocks ``B_1, …, B_n`` covers the union of their regions. Its point is one vector
of ``D`` entries: for each parameter it touches (in the order the parts first name them), the
covered entries of the parameter's view in row-major order, each entry once. Part ``j`` reads
its usual ``(heads, Σ k_f, h)`` points from that vector through an index tensor, built by
reading a matrix of entry positions exactly as gather reads the parameter, so part ``j``'s
points are the block's points. :func:`check_product` refuses, at declaration, parts whose
actions do not commute, whose actions do not preserve the product's element-wise metric, or
whose vertical spaces intersect.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..manifolds.product import ProductQuotient
from .layout import View

Tensor = torch.Tensor

__all__ = ["Product", "Span", "check_product", "make_product", "union_point"]

# the checks run in float64 and accept relative violations up to √ε (1.5e-8): rounding
# leaves ~1e-13 for well-conditioned group elements, non-commuting actions O(1)
CHECK_DTYPE = torch.float64
CHECK_TOL = torch.finfo(CHECK_DTYPE).eps ** 0.5
CHECK_DRAWS = 2


@dataclass(frozen=True, eq=False)
class Span:
    """The entries of parameter ``name`` in a product's point: positions ``offset`` to
    ``offset + size``, the view's entries where ``mask`` is true in row-major order
    (``mask=None``: every entry of the view)."""

    name: str
    view: View
    offset: int
    size: int
    mask: Tensor | None


@dataclass(frozen=True, eq=False)
class Product:
    """Blocks ``parts`` (indices into the declared blocks) measured as one point ``(1, D)`` on
    ``manifold``; ``spans`` say where each parameter's entries sit in it."""

    parts: tuple[int, ...]
    manifold: ProductQuotient
    spans: tuple[Span, ...]

    @property
    def size(self) -> int:
        return self.manifold.size


def make_product(blocks: Sequence, parts: Sequence[int]) -> Product:
    """The product of ``blocks[j]`` for ``j`` in ``parts`` (their views must agree)."""
    masks: dict[str, Tensor] = {}
    views: dict[str, View] = {}
    for b in parts:
        for r in blocks[b].regions:
            if r.name not in masks:
                masks[r.name] = torch.zeros(r.view.shape, dtype=torch.bool)
                views[r.name] = r.view
            masks[r.name][r.rows[0] : r.rows[1], r.cols[0] : r.cols[1]] = True
    spans, positions, offset = [], {}, 0
    for name, mask in masks.items():
        size = int(mask.sum())
        ids = torch.full(mask.shape, -1, dtype=torch.long)
        ids[mask] = torch.arange(offset, offset + size)
        positions[name] = ids
        spans.append(Span(name, views[name], offset, size, None if bool(mask.all()) else mask))
        offset += size
    indices = []
    for b in parts:
        block = blocks[b]
        rows = [r.to_factor(r.of_matrix(positions[r.name]), block.heads) for r in block.regions]
        indices.append(torch.cat(rows, dim=1))  # (heads, Σk, h): the block's points, by position
    manifold = ProductQuotient(
        [(blocks[b].manifold, index) for b, index in zip(parts, indices, strict=True)],
        size=offset,
        labels=[blocks[b].label for b in parts],
    )
    return Product(tuple(parts), manifold, tuple(spans))


def span_values(span: Span, value: Tensor, mask: Tensor | None) -> Tensor:
    """The entries of ``span`` read from its parameter's ``value`` (``mask`` on its device)."""
    matrix = span.view.matrix(value)
    return matrix.reshape(-1) if mask is None else matrix[mask]


def union_point(product: Product, params: Mapping[str, Tensor], dtype: torch.dtype) -> Tensor:
    """The product's point ``(1, D)`` read from ``params`` in ``dtype`` (a new tensor)."""
    values = []
    for span in product.spans:
        value = params[span.name].detach()
        mask = None if span.mask is None else span.mask.to(value.device)
        values.append(span_values(span, value, mask).to(dtype))
    return torch.cat(values).unsqueeze(0)


def check_product(
    product: Product,
    new: int,
    overlapped: Sequence[int],
    params: Mapping[str, Tensor],
    label: str,
) -> None:
    """Refuse (``ValueError`` starting with ``label``) a product that is not a quotient by the
    product group at the current parameters.

    ``new`` is the part being declared and ``overlapped`` the parts it shares entries with (by
    position in ``product.parts``). In float64, with random group elements of the parts
    (``random_group``, fixed seeds):

    - the point must be admissible: no zero entry (the element-wise metric divides by them)
      and every part's action free there (its ``_check_free``);
    - commutation: ``‖g_i·(g_j·x) − g_j·(g_i·x)‖ ≤ √ε ‖g_i·(g_j·x)‖`` on the entries of the new
      part ``i`` and every part ``j`` it overlaps;
    - metric invariance: ``|‖g·u‖²_{g·x} − ‖u‖²_x| ≤ √ε ‖u‖²_x`` for every part's ``g``;
    - independence (when the normal equations are dense, ``K ≤ dense_max``): ``V* M V`` is
      well defined, ``λ_min > K·10³·ε·λ_max``, so that the vertical space is a direct sum.
    """
    m = product.manifold
    labels = m.labels
    x = union_point(product, params, CHECK_DTYPE)
    zeros = []
    for span in product.spans:
        count = int((x[0, span.offset : span.offset + span.size] == 0).sum())
        if count:
            zeros.append(f"{count} of {span.name!r}")
    if zeros:
        raise ValueError(
            f"{label}: the product of {_names(labels)} is measured with the element-wise metric "
            f"Σ η²/x², which divides by every entry, and some entries are 0 ({', '.join(zeros)})"
        )
    try:
        m.at(x)
    except ValueError as err:
        raise ValueError(
            f"{label}: the product of {_names(labels)} is not free here: {err}"
        ) from None

    def generator(seed: int) -> torch.Generator:
        return torch.Generator(device=x.device).manual_seed(seed)

    try:
        for j in overlapped:
            gap = max(m.commutator(x, new, j, generator=generator(s)) for s in range(CHECK_DRAWS))
            if not gap <= CHECK_TOL:
                raise ValueError(
                    f"{label}: the actions of {labels[new]!r} and {labels[j]!r} do not commute "
                    f"on their shared parameters (‖a·(b·x) − b·(a·x)‖ / ‖a·(b·x)‖ = {gap:.2e} > "
                    f"{CHECK_TOL:.1e} for random group elements a, b), so they do not form a "
                    "product group: declare them on disjoint parameters, or as one block whose "
                    "manifold knows the whole group"
                )
        for j in range(len(labels)):
            change = max(
                m.metric_distortion(x, j, generator=generator(s)) for s in range(CHECK_DRAWS)
            )
            if not change <= CHECK_TOL:
                raise ValueError(
                    f"{label}: the action of {labels[j]!r} does not preserve the element-wise "
                    f"metric Σ η²/x² that a product is measured with (relative change "
                    f"{change:.2e} > {CHECK_TOL:.1e}); only actions that re-scale entries "
                    "preserve it"
                )
    except NotImplementedError as err:
        raise ValueError(
            f"{label}: a product needs the finite action act(x, g) of every part, to check that "
            f"the actions commute and preserve its metric: {err}"
        ) from None
    k = m.lie_shape(m.at(x))[0]
    if 0 < k <= m.dense_max:
        ratio = m.vertical_conditioning(x)
        if not ratio > k * 1e3 * torch.finfo(CHECK_DTYPE).eps:
            raise ValueError(
                f"{label}: the vertical spaces of {_names(labels)} are not independent here "
                f"(V*MV has λ_min/λ_max = {ratio:.1e}): one part's group moves along another's "
                "orbits (a symmetry declared twice?)"
            )


def _names(labels: Sequence[str]) -> str:
    return ", ".join(repr(label) for label in labels)
