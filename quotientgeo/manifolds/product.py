r"""Quotient by a product of commuting groups that act on overlapping parts of one point.

Chains of ReLU re-scalings are the textbook case: the outgoing weights of a hidden layer are
the incoming weights of the next, so the unit scalings of consecutive layers act on shared
entries. Their actions commute, and together they form one group, the product
``G = G_1 × … × G_n``, whose quotient is what the network computes.

A point of :class:`ProductQuotient` is a vector ``x`` of ``D`` entries (shape ``(..., D)``),
the union of the parts' entries, each entry once. Part ``j`` reads its own points through an
index tensor ``I_j``: ``x_j = x[..., I_j]``, on which its manifold ``M_j`` acts. With ``E_j``
the embedding of part ``j``'s vectors into the union (the Euclidean adjoint of the gather
``x ↦ x[..., I_j]``: zeros on the entries part ``j`` does not cover):

- Lie algebra: ``ω = (ω_1, …, ω_n)``, the parts' elements flattened and concatenated, shape
  ``(K,)`` with ``K = Σ_j k_j``;
- vertical map: ``V_x ω = Σ_j E_j V_j(x_j) ω_j``, so the vertical space is the sum of the
  parts' vertical spaces;
- action: ``g · x = g_1 · (g_2 · ( … (g_n · x)))``, where ``g_j · x`` replaces the entries
  ``I_j`` of ``x`` by ``M_j.act(x_j, g_j)``; the order does not matter when the actions
  commute (:meth:`ProductQuotient.commutator` measures it);
- metric: the element-wise ``<u, v>_x = Σ_e u_e v_e / x_e²`` on the union.

The parts' own metrics are not used: a part's metric is in general not invariant under the
other parts' actions (the column norm of a layer's outgoing weights, which the unit metric of
that layer divides by, changes when the next layer re-scales its units), so no combination of
them descends to the quotient by the product. The element-wise metric is invariant under
every action that re-scales each entry, ``(g · x)_e = c_e(g) x_e`` (then ``η_e ↦ c_e η_e`` and
every term ``η_e² / x_e²`` is unchanged), which covers products of re-scaling symmetries;
:meth:`ProductQuotient.metric_distortion` measures it for other actions. It is the
adaptive-sharpness metric of the entries, and has closed forms: ``M⁻¹ v = v ⊙ x²``, the
isotropic map ``e ↦ |x| ⊙ e``, the Christoffel contraction ``Γ(u, v) = -u ⊙ v / x`` and the
exact geodesic ``x ⊙ exp(t u / x)`` (the metric is the flat metric of ``log |x|``). The group
acts by isometries, so a geodesic that starts horizontal stays horizontal and is the
horizontal lift of the quotient's geodesic. It divides by every entry: points with a zero
entry are refused.

Projection is the base class's: normal equations ``(V* M V) ω = V* M u``, formed densely for
``K ≤ dense_max`` and solved by conjugate gradients otherwise.

:class:`ProductQuotient` is ``total / group``: :class:`ProductTotalSpace` (the ``D`` entries
with the element-wise metric) by :class:`ProductGroup` (the parts' groups and their actions).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..validation import positive_int
from .base import AtPoint, QuotientManifold
from .groups import DEFAULT_CONDITION, random_element
from .quotient import Quotient, TotalSpace

Tensor = torch.Tensor

__all__ = ["ProductGroup", "ProductQuotient", "ProductTotalSpace"]

# dense normal equations materialise K vertical vectors of D entries: at most this many entries
DENSE_ENTRIES = 2**24


class ProductTotalSpace(TotalSpace):
    r"""``D`` non-zero entries (shape ``(..., D)``) with the element-wise metric
    ``<u, v>_x = Σ_e u_e v_e / x_e²``: the flat metric of ``log |x|``, with closed forms
    ``M⁻¹ v = v ⊙ x²``, ``T e = |x| ⊙ e``, ``Γ(u, v) = -u ⊙ v / x`` and the exact geodesic
    ``x ⊙ exp(t u / x)``. The total space of :class:`ProductQuotient`.

    Args:
        size: ``D``, the number of entries.
        exp_steps: unused by the closed-form geodesics; kept for :meth:`generic`.
        dense_max: as for :class:`QuotientManifold`.
    """

    closed_form_geodesic = True

    name = "ProductTotalSpace"
    ndim = 1

    def __init__(self, size: int, *, exp_steps: int | None = None, dense_max: int = 64):
        super().__init__(exp_steps=exp_steps, dense_max=dense_max)
        self.size = positive_int("size", size)

    def extra_repr(self) -> str:
        return f"size={self.size}"

    def squared(self, p: AtPoint) -> Tensor:
        """``x²``, cached on ``p``."""
        return p.cached("product_squared", lambda: p.x.square())

    def metric(self, p: AtPoint, u: Tensor) -> Tensor:
        """``M(x) u = u / x²``."""
        return u / self.squared(p)

    def metric_inv(self, p: AtPoint, v: Tensor) -> Tensor:
        """``M(x)⁻¹ v = v ⊙ x²``."""
        return v * self.squared(p)

    def isotropic(self, p: AtPoint, e: Tensor) -> Tensor:
        """``|x| ⊙ e`` (``Tᵀ M T = I``)."""
        return e * p.x.abs()

    def christoffel(self, x, u: Tensor, v: Tensor | None = None) -> Tensor:
        """``Γ(u, v) = -u ⊙ v / x`` (``v=None``: ``Γ(u, u)``)."""
        p = self.at(x)
        self._check_vector(p, u)
        if v is None:
            v = u
        else:
            self._check_vector(p, v, "v")
        return -u * v / p.x

    def geodesic(
        self, x: Tensor | AtPoint, u: Tensor, t: float | Tensor = 1.0, *, steps: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(x ⊙ exp(t u / x), u ⊙ exp(t u / x))``: the exact point and velocity at ``t``
        (``steps`` is not used)."""
        p = self.at(x)
        self._check_vector(p, u)
        grow = torch.exp(self._times(t, p, u) * u / p.x)
        return p.x * grow, u * grow

    def _check_shape(self, shape, name):
        if len(shape) < 1 or shape[-1] != self.size:
            return False, f"{name} must have shape (..., {self.size}), got {tuple(shape)}"
        return True, None

    def _check_free(self, x: Tensor) -> None:
        zeros = int((x == 0).sum())
        if zeros:
            raise ValueError(
                f"{zeros} entries of the point are 0: the element-wise metric Σ η²/x² of a "
                "product divides by every entry"
            )


class ProductGroup:
    r"""The product ``G_1 × … × G_n`` of the parts' groups acting on ``D`` entries.

    Part ``j`` is a pair ``(M_j, I_j)``: its points are ``x[..., I_j]``, on which the group of
    the manifold ``M_j`` acts. Lie algebra: the parts' elements flattened and concatenated,
    shape ``(K,)``; vertical ``V_x ω = Σ_j E_j V_j(x_j) ω_j``; action
    ``g · x = g_1 · (… (g_n · x))``; group elements are tuples ``(g_1, …, g_n)``. Arguments
    as for :class:`ProductQuotient` (checked there).
    """

    def __init__(
        self,
        manifolds: Sequence[QuotientManifold],
        indices: Sequence[Tensor],
        size: int,
        labels: Sequence[str],
    ):
        self.manifolds = tuple(manifolds)
        self.indices = tuple(indices)
        self.size = size
        self.labels = tuple(labels)
        inverses = []
        for index in self.indices:
            flat = index.reshape(-1)
            # inverse[e]: where entry e sits among the part's flat entries; n (a zero) if absent
            inverse = torch.full((size,), flat.numel(), dtype=torch.long)
            inverse[flat] = torch.arange(flat.numel())
            inverses.append(inverse)
        self._inverses = tuple(inverses)
        self._on_device: dict[torch.device, tuple] = {}

    def __repr__(self) -> str:
        return f"ProductGroup({' × '.join(repr(label) for label in self.labels)})"

    def _tables(self, device: torch.device) -> tuple:
        """``(indices, inverses, covered masks)`` on ``device`` (moved once per device)."""
        tables = self._on_device.get(device)
        if tables is None:
            indices = tuple(i.to(device) for i in self.indices)
            inverses = tuple(i.to(device) for i in self._inverses)
            covered = tuple(i < self.indices[j].numel() for j, i in enumerate(inverses))
            tables = self._on_device[device] = (indices, inverses, covered)
        return tables

    def part(self, x, j: int) -> Tensor:
        """Part ``j``'s points ``x[..., I_j]``, shape ``(..., *batch_j, *event_j)``."""
        x = x.x if isinstance(x, AtPoint) else x
        return x[..., self._tables(x.device)[0][j]]

    def embed(self, v: Tensor, j: int) -> Tensor:
        """``E_j v``: a vector of part ``j`` (``(..., *batch_j, *event_j)``) on the union
        (``(..., D)``), zeros on the entries part ``j`` does not cover; the adjoint of
        :meth:`part`."""
        _, inverses, _ = self._tables(v.device)
        flat = v.flatten(v.dim() - self.indices[j].dim())
        return F.pad(flat, (0, 1))[..., inverses[j]]

    def covered(self, j: int, device=None) -> Tensor:
        """Boolean mask ``(D,)`` of the entries part ``j`` covers."""
        return self._tables(torch.device("cpu") if device is None else device)[2][j]

    def _points(self, p: AtPoint) -> tuple[AtPoint, ...]:
        """The parts' points at ``p`` (cached on ``p``)."""
        return p.cached(
            "product_parts",
            lambda: tuple(AtPoint(m, self.part(p.x, j)) for j, m in enumerate(self.manifolds)),
        )

    def _lie(self, p: AtPoint) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        """Per part: the shape ``(*batch_j, *lie_j)`` of ``ω_j`` and its size ``k_j``."""

        def compute():
            shapes = []
            for m, index, q in zip(self.manifolds, self.indices, self._points(p), strict=True):
                shapes.append((*index.shape[: index.dim() - m.ndim], *m.lie_shape(q)))
            return tuple(shapes), tuple(math.prod(s) for s in shapes)

        return p.cached("product_lie", compute)

    def lie_shape(self, p: AtPoint) -> tuple[int]:
        """``(K,)``, ``K = Σ_j k_j``."""
        return (sum(self._lie(p)[1]),)

    def vertical(self, p: AtPoint, omega: Tensor) -> Tensor:
        """``V_x ω = Σ_j E_j V_j(x_j) ω_j``."""
        shapes, sizes = self._lie(p)
        chunks = torch.split(omega, list(sizes), dim=-1) if len(sizes) > 1 else (omega,)
        total = None
        for j, (m, q, w, shape) in enumerate(
            zip(self.manifolds, self._points(p), chunks, shapes, strict=True)
        ):
            v = self.embed(m.vertical(q, w.reshape(*w.shape[:-1], *shape)), j)
            total = v if total is None else total + v
        assert total is not None  # a product has at least one part
        return total

    def precondition(self, p: AtPoint, r: Tensor) -> Tensor:
        return r

    def _elements(self, g) -> tuple:
        if not isinstance(g, (tuple, list)) or len(g) != len(self.manifolds):
            raise ValueError(
                f"a group element of a product of {len(self.manifolds)} parts is a tuple of "
                f"one element per part, got {type(g).__name__}"
            )
        return tuple(g)

    def act_part(self, x: Tensor, j: int, g) -> Tensor:
        """``g_j · x``: the entries ``I_j`` replaced by ``M_j.act(x_j, g_j)``, the others kept."""
        moved = self.embed(self.manifolds[j].act(self.part(x, j), g), j)
        return torch.where(self.covered(j, x.device), moved, x)

    def act(self, x: Tensor, g: Any) -> Tensor:
        """``g · x = g_1 · (… (g_n · x))`` for ``g = (g_1, …, g_n)``."""
        for j, gj in reversed(tuple(enumerate(self._elements(g)))):
            x = self.act_part(x, j, gj)
        return x

    def push(self, x: Tensor, u: Tensor, g: Any) -> Tensor:
        """Differential of :meth:`act` at ``x`` applied to ``u`` (forward-mode autodiff)."""
        g = self._elements(g)
        shape = torch.broadcast_shapes(x.shape, u.shape)
        x, u = x.expand(shape).contiguous(), u.expand(shape).contiguous()
        return torch.func.jvp(lambda y: self.act(y, g), (x,), (u,))[1]

    def random_group(
        self,
        x,
        *,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        condition: float = DEFAULT_CONDITION,
    ):
        """``(g_1, …, g_n)``, ``g_j`` = part ``j``'s ``random_group`` at its points (each with
        condition number at most ``condition``)."""
        x = x.x if isinstance(x, AtPoint) else x
        return tuple(
            random_element(
                m, self.part(x, j), generator=generator, scale=scale, condition=condition
            )
            for j, m in enumerate(self.manifolds)
        )

    def group_name(self, shape) -> str:
        names = []
        for m, index in zip(self.manifolds, self.indices, strict=True):
            heads = math.prod(index.shape[: index.dim() - m.ndim])
            group = m.group_name(tuple(index.shape[index.dim() - m.ndim :]))
            names.append(group if heads == 1 else f"({group})^{heads}")
        return " × ".join(names)

    def check_free(self, x: Tensor) -> None:
        """Each part's freeness check on its points (a ``ValueError`` naming the part)."""
        for j, m in enumerate(self.manifolds):
            try:
                m._check_free(self.part(x, j))
            except ValueError as err:
                raise ValueError(f"{self.labels[j]}: {err}") from None


class ProductQuotient(Quotient):
    r"""The quotient of ``D`` entries by the product of commuting groups acting on parts of them.

    See the module docstring for the formulas: :attr:`total` is a :class:`ProductTotalSpace`,
    :attr:`group` a :class:`ProductGroup`. :meth:`ParameterGeometry.add
    <quotientgeo.ParameterGeometry.add>` builds one when a block declared with
    ``product=True`` overlaps other blocks; it can also be built directly.

    Args:
        parts: pairs ``(manifold, index)``: part ``j``'s points are ``x[..., index]``, so
            ``index`` is an integer tensor of shape ``(*batch_j, *event_j)`` (``event_j``: the
            manifold's ``ndim`` trailing point dimensions; ``batch_j``: its heads) whose entries
            are distinct positions ``0 ≤ e < D``. Parts may share positions.
        size: ``D``, the number of entries (default: the largest position + 1); every position
            must belong to some part.
        labels: names of the parts for messages (default ``"part j"``).
        exp_steps: unused by the closed-form geodesics; kept for :meth:`generic`.
        dense_max: largest ``K`` with dense normal equations (default: 64, lowered so that
            ``K · D ≤ 2²⁴``).
    """

    name = "ProductQuotient"
    ndim = 1
    _parts: tuple[ProductTotalSpace, ProductGroup]  # pyright: ignore[reportIncompatibleVariableOverride]

    def __init__(
        self,
        parts: Sequence[tuple[QuotientManifold, Tensor]],
        *,
        size: int | None = None,
        labels: Sequence[str] | None = None,
        exp_steps: int | None = None,
        dense_max: int | None = None,
    ):
        parts = tuple(parts)
        if len(parts) < 1:
            raise ValueError("a product needs at least one part")
        indices = []
        for j, part in enumerate(parts):
            if not (isinstance(part, (tuple, list)) and len(part) == 2):
                raise TypeError(f"part {j} must be a pair (manifold, index), got {part!r}")
            m, index = part
            if not isinstance(m, QuotientManifold):
                raise TypeError(f"part {j}: expected a QuotientManifold, got {type(m).__name__}")
            index = torch.as_tensor(index).detach().to("cpu")
            if index.dtype.is_floating_point or index.dtype == torch.bool:
                raise TypeError(f"part {j}: the index must be an integer tensor, got {index.dtype}")
            if index.dim() < m.ndim or index.numel() == 0:
                raise ValueError(
                    f"part {j}: the index has shape {tuple(index.shape)}, but "
                    f"{type(m).__name__} points have {m.ndim} dimension(s)"
                )
            indices.append(index.long())
        top = max(int(i.max()) for i in indices) + 1
        size = top if size is None else positive_int("size", size)
        labels = [f"part {j}" for j in range(len(parts))] if labels is None else list(labels)
        if len(labels) != len(parts):
            raise ValueError(f"{len(labels)} labels for {len(parts)} parts")
        covered = torch.zeros(size, dtype=torch.bool)
        for j, index in enumerate(indices):
            flat = index.reshape(-1)
            if int(flat.min()) < 0 or int(flat.max()) >= size:
                raise ValueError(f"{labels[j]}: positions must lie in [0, {size})")
            if flat.unique().numel() != flat.numel():
                raise ValueError(f"{labels[j]}: a part must read every position at most once")
            covered[flat] = True
        if not bool(covered.all()):
            raise ValueError(f"{int((~covered).sum())} of the {size} entries belong to no part")
        if dense_max is None:
            dense_max = min(64, DENSE_ENTRIES // size)
        total = ProductTotalSpace(size, exp_steps=exp_steps, dense_max=dense_max)
        group = ProductGroup([m for m, _ in parts], indices, size, labels)
        super().__init__(total, group, exp_steps=exp_steps, dense_max=dense_max)
        self.size = size
        self.labels = tuple(labels)

    # ------------------------------------------------------------------ structure
    @property
    def parts(self) -> tuple[tuple[QuotientManifold, Tensor], ...]:
        """The pairs ``(manifold, index)`` (indices on the CPU)."""
        group = self._parts[1]
        return tuple(zip(group.manifolds, group.indices, strict=True))

    def extra_repr(self) -> str:
        parts = " × ".join(repr(label) for label in self.labels)
        return f"{parts}, size={self.size}"

    def geometry_key(self) -> Hashable:
        """Unique: a product is one kind of its own."""
        return type(self), id(self)

    def part(self, x, j: int) -> Tensor:
        """Part ``j``'s points ``x[..., I_j]`` (:meth:`ProductGroup.part`)."""
        return self._parts[1].part(x, j)

    def embed(self, v: Tensor, j: int) -> Tensor:
        """``E_j v``, zeros off part ``j`` (:meth:`ProductGroup.embed`)."""
        return self._parts[1].embed(v, j)

    def covered(self, j: int, device=None) -> Tensor:
        """Boolean mask ``(D,)`` of the entries part ``j`` covers."""
        return self._parts[1].covered(j, device)

    def act_part(self, x: Tensor, j: int, g) -> Tensor:
        """``g_j · x`` (:meth:`ProductGroup.act_part`)."""
        return self._parts[1].act_part(x, j, g)

    def squared(self, p: AtPoint) -> Tensor:
        """``x²``, cached on ``p`` (:meth:`ProductTotalSpace.squared`)."""
        return self._parts[0].squared(p)

    # ------------------------------------------------------------------ points
    def at(self, x: Tensor | AtPoint) -> AtPoint:
        """The total space's cached point; a new one is checked to be free for every part."""
        known = isinstance(x, AtPoint) and x.manifold is self._parts[0]
        p = super().at(x)
        if not known:
            self._parts[1].check_free(p.x)
        return p

    def _check_free(self, x: Tensor) -> None:
        self._parts[0]._check_free(x)
        self._parts[1].check_free(x)

    # ------------------------------------------------------------------ checks of a product
    def commutator(self, x: Tensor, i: int, j: int, *, generator=None, scale: float = 1.0):
        """``‖g_i·(g_j·x) − g_j·(g_i·x)‖ / ‖g_i·(g_j·x)‖`` over the entries parts ``i`` and ``j``
        cover, for random elements ``g_i``, ``g_j`` (their ``random_group``): zero up to
        rounding when the actions commute. Returns a Python float (the largest over the
        batch)."""
        x = x.x if isinstance(x, AtPoint) else x
        gi = (
            self._parts[1]
            .manifolds[i]
            .random_group(self.part(x, i), generator=generator, scale=scale)
        )
        gj = (
            self._parts[1]
            .manifolds[j]
            .random_group(self.part(x, j), generator=generator, scale=scale)
        )
        a = self.act_part(self.act_part(x, j, gj), i, gi)
        b = self.act_part(self.act_part(x, i, gi), j, gj)
        mask = self.covered(i, x.device) | self.covered(j, x.device)
        gap = torch.linalg.vector_norm((a - b)[..., mask], dim=-1)
        norm = torch.linalg.vector_norm(a[..., mask], dim=-1)
        return float((gap / norm.clamp_min(torch.finfo(x.dtype).tiny)).max())

    def metric_distortion(self, x: Tensor, j: int, *, generator=None, scale: float = 1.0):
        """``|‖g·u‖²_{g·x} − ‖u‖²_x| / ‖u‖²_x`` for a random element ``g`` of part ``j`` and a
        random ``u = |x| ⊙ e``, ``e ~ N(0, I)``, pushed by the differential of the action: zero
        up to rounding when the action preserves the metric. A Python float (batch maximum)."""
        x = x.x if isinstance(x, AtPoint) else x
        g = (
            self._parts[1]
            .manifolds[j]
            .random_group(self.part(x, j), generator=generator, scale=scale)
        )
        e = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        u = e * x.abs()
        y, pushed = torch.func.jvp(lambda z: self.act_part(z, j, g), (x,), (u,))[:2]
        before = self.inner(x, u)
        after = self.inner(y, pushed)
        return float(((after - before).abs() / before).max())

    def vertical_conditioning(self, x: Tensor) -> float:
        """``λ_min / λ_max`` of the normal operator ``V* M V`` at ``x`` (dense, ``K × K``; the
        smallest over the batch): zero up to rounding when the parts' vertical spaces
        intersect (the product then does not act freely)."""
        p = self.at(x)
        omegas = self._basis(p, self.lie_shape(p))
        basis = torch.func.vmap(lambda w: self.vertical(p, w))(omegas)
        weighted = basis / p.x.abs()  # M^½ V e_i
        gram = torch.einsum("i...e,j...e->...ij", weighted, weighted)
        eig = torch.linalg.eigvalsh(gram)
        return float((eig[..., 0] / eig[..., -1]).min())
