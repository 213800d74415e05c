r"""The adaptive rest's Auto-PGD passes as compiled kernels: ``evaluate(..., compile=True)``.

Every Auto-PGD iteration reads the gradient ``∇`` and the iterates ``ξ_k``, ``ξ_{k-1}`` of every
parameter without symmetry (the adaptive rest: straight lines in the element-wise metric
``1/ŵ²``, ``ŵ = max(|x₀|, floor)``) twice. The Gram pass writes the Riemannian gradient
``g = ŵ² ∇`` over ``∇`` and takes the Gram matrix of ``(ξ_k, ξ_{k-1}, g)`` in that metric,

.. math::

    K = \begin{pmatrix}
        \sum ξ^2/ŵ^2 & \sum ξ ξ'/ŵ^2 & \sum ξ ∇ \\
        \cdot & \sum ξ'^2/ŵ^2 & \sum ξ' ∇ \\
        \cdot & \cdot & \sum ŵ^2 ∇^2
    \end{pmatrix},
    \qquad ξ = w̃ - x₀,

with ``w̃`` the weights (which hold ``x₀ + ξ_k``) and ``ξ'`` the previous iterate (``⟨ξ, g⟩ =
Σ ξ ŵ² ∇ / ŵ² = Σ ξ ∇``). The step writes ``ξ' ← ξ_k`` and ``w̃ ← x₀ + c₀ ξ_k + c₁ ξ' + c₂ g``.
In eager PyTorch the two are some twenty element-wise passes and a concatenation, about 55
parameter copies of memory traffic per iteration; here each is one function of the segments of
all the rest's pieces together (views of the weights, of ``x₀``, of ``ξ'`` and of ``∇``; no
temporary, so no bound on their size) compiled by :func:`torch.compile` into one kernel. On the
CPU (torch 2.14) the Gram pass's kernel makes two loops over a segment, the six sums (reading
the four vectors) and the write of ``g`` (reading ``x₀`` and ``∇`` again): seven copies; the
step's makes one (reading four, writing ``ξ'`` and ``w̃``): six. The Gram pass's sums are taken
in another order than the eager matrix product, so ``K`` agrees with the eager path to rounding;
``g`` is the same product, bit for bit; the step sums its terms in the eager order.

The symmetric parameters, whose ``ξ_k`` is held in tensors of its own (parked in the weights
after the backward pass), take the held step: ``ξ' ← ξ_k`` and ``ξ_{k+1} = c₀ ξ_k + c₁ ξ' +
c₂ g`` into new tensors (reading three vectors, writing two), a piece at a time, since the new
tensors are allocated as the gradients are freed. Where ``ξ'`` stays as the best point, its
values first go to new tensors of the best point's, a piece at a time, and the kernels then run
as at any other step.

Each compiled function is wrapped in a custom operator (``quotientgeo::adaptive_gram``,
``quotientgeo::adaptive_step``, ``quotientgeo::held_step``, registered on first use by
:func:`operators`), so that the dispatcher sees one operator, counted by ``quotientgeo bench
cost --compile`` with the bytes of its inputs and outputs (five copies for the Gram pass, two
fewer than its loops move). A function compiles once per number of segments in a call (the
segments' sizes are dynamic), up to :data:`RECOMPILE_LIMIT` times (torch's
``recompile_limit``, 8 by default, is raised for these calls only); beyond it the function
runs eagerly (torch warns once), the dispatcher still counting one operator. What does not
qualify takes the eager path: a piece with a masked or sharded parameter, weights in another
dtype than the compute dtype, a subclass of :class:`~quotientgeo.AdaptiveGeometry` with its
own scale or metric (the Gram pass), and the symmetric parameters of a model that recomputes
its forward pass in the backward pass (their ``ξ_k`` is not parked; the step).
"""

import functools
from collections.abc import Callable, Mapping, Sequence

import torch

from ..geometry.perturbation import Piece
from ..manifolds import AdaptiveGeometry

Tensor = torch.Tensor

__all__ = ["fusable", "fused_gram", "fused_held_step", "fused_step", "operators"]


def _gram_sums(
    weights: list[Tensor],
    base: list[Tensor],
    previous: list[Tensor],
    grads: list[Tensor],
    floor_squared: float,
) -> Tensor:
    """``K`` (3 × 3, its six sums each taken once) over the segments; ``grads ← ŵ² ∇``."""
    total = None
    for w, x0, prev, grad in zip(weights, base, previous, grads, strict=True):
        scale_squared = (x0 * x0).clamp_min(floor_squared)
        xi = w - x0
        g = grad * scale_squared
        whitened, whitened_prev = xi / scale_squared, prev / scale_squared
        a, b, c = (xi * whitened).sum(), (prev * whitened).sum(), (xi * grad).sum()
        d, e, f = (prev * whitened_prev).sum(), (prev * grad).sum(), (g * grad).sum()
        sums = torch.stack((a, b, c, b, d, e, c, e, f)).view(3, 3)
        total = sums if total is None else total + sums
        grad.copy_(g)
    assert total is not None
    return total


def _step(
    weights: list[Tensor],
    base: list[Tensor],
    previous: list[Tensor],
    grads: list[Tensor],
    c: Tensor,
) -> None:
    """``ξ_{k+1} = c₀ ξ_k + c₁ ξ_{k-1} + c₂ g`` with ``ξ_k = w̃ - x₀``: ``previous ← ξ_k`` and the
    weights ``← x₀ + ξ_{k+1}``, in place (the terms summed in the eager path's order)."""
    for w, x0, prev, g in zip(weights, base, previous, grads, strict=True):
        xi = w - x0
        new = c[2] * g + c[1] * prev + c[0] * xi
        prev.copy_(xi)
        w.copy_(x0 + new)


def _held_step(
    current: list[Tensor],
    previous: list[Tensor],
    grads: list[Tensor],
    targets: list[Tensor],
    c: Tensor,
) -> None:
    """``targets ← ξ_{k+1} = c₀ ξ_k + c₁ ξ_{k-1} + c₂ g`` and ``previous ← ξ_k``, for ``ξ_k`` held
    in tensors of its own (``current``; parked in the weights), in place."""
    for xi, prev, g, out in zip(current, previous, grads, targets, strict=True):
        new = c[2] * g + c[1] * prev + c[0] * xi
        prev.copy_(xi)
        out.copy_(new)


#: Compilations allowed per compiled function (one per number of segments in a call: the rest
#: in one call, a piece's held or best-point segments in others), against torch's default of 8.
RECOMPILE_LIMIT = 64


def _compiled(fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` compiled with dynamic sizes, called with torch's recompilation limit raised to
    :data:`RECOMPILE_LIMIT` for that call only (``recompile_limit``, ``cache_size_limit`` before
    torch 2.7)."""
    compiled = torch.compile(fn, dynamic=True)
    config = torch._dynamo.config  # pyright: ignore[reportAttributeAccessIssue]
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"

    def call(*args):
        with config.patch({name: max(RECOMPILE_LIMIT, getattr(config, name))}):
            return compiled(*args)

    return call


@functools.cache
def operators() -> tuple[Callable[..., Tensor], Callable[..., None], Callable[..., None]]:
    """``(adaptive_gram, adaptive_step, held_step)``: :func:`_gram_sums`, :func:`_step` and
    :func:`_held_step` compiled by :func:`torch.compile` (dynamic sizes) and registered as the
    custom operators ``quotientgeo::adaptive_gram`` (mutating ``grads``),
    ``quotientgeo::adaptive_step`` (mutating ``weights`` and ``previous``) and
    ``quotientgeo::held_step`` (mutating ``previous`` and ``targets``), on first use."""
    gram, step, held = _compiled(_gram_sums), _compiled(_step), _compiled(_held_step)

    # the schemas written out: torch 2.6 infers none from ``list[Tensor]`` annotations
    @torch.library.custom_op(
        "quotientgeo::adaptive_gram",
        mutates_args=("grads",),
        schema="(Tensor[] weights, Tensor[] base, Tensor[] previous, Tensor(a!)[] grads, "
        "float floor_squared) -> Tensor",
    )
    def adaptive_gram(
        weights: list[Tensor],
        base: list[Tensor],
        previous: list[Tensor],
        grads: list[Tensor],
        floor_squared: float,
    ) -> Tensor:
        out = gram(weights, base, previous, grads, floor_squared)
        assert isinstance(out, Tensor)
        return out

    @adaptive_gram.register_fake
    def _(weights, base, previous, grads, floor_squared):
        return weights[0].new_empty((3, 3))

    @torch.library.custom_op(
        "quotientgeo::adaptive_step",
        mutates_args=("weights", "previous"),
        schema="(Tensor(a!)[] weights, Tensor[] base, Tensor(b!)[] previous, Tensor[] grads, "
        "Tensor c) -> ()",
    )
    def adaptive_step(
        weights: list[Tensor],
        base: list[Tensor],
        previous: list[Tensor],
        grads: list[Tensor],
        c: Tensor,
    ) -> None:
        step(weights, base, previous, grads, c)

    @torch.library.custom_op(
        "quotientgeo::held_step",
        mutates_args=("previous", "targets"),
        schema="(Tensor[] current, Tensor(a!)[] previous, Tensor[] grads, Tensor(b!)[] targets, "
        "Tensor c) -> ()",
    )
    def held_step(
        current: list[Tensor],
        previous: list[Tensor],
        grads: list[Tensor],
        targets: list[Tensor],
        c: Tensor,
    ) -> None:
        held(current, previous, grads, targets, c)

    return adaptive_gram, adaptive_step, held_step


def fusable(piece: Piece, tensors: Sequence[Mapping[str, Tensor]], dtype: torch.dtype) -> bool:
    """Whether the kernels can take ``piece``: not sharded, and each of its segments a plain
    view (:meth:`~quotientgeo.geometry.perturbation.Piece.views`) of every one of ``tensors``
    in ``dtype``."""
    return not piece.sharded and all(piece.views(t, dtype) is not None for t in tensors)


def _views(
    pieces: Sequence[Piece], tensors: Sequence[Mapping[str, Tensor]], dtype: torch.dtype
) -> list[list[Tensor]] | None:
    """For each of ``tensors``, the views of all the pieces' segments, in order; ``None`` where
    a piece is not :func:`fusable` or there is none."""
    if not pieces or not all(fusable(piece, tensors, dtype) for piece in pieces):
        return None
    return [[v for piece in pieces for v in piece.views(t, dtype) or ()] for t in tensors]


def fused_gram(
    pieces: Sequence[Piece],
    weights: Mapping[str, Tensor],
    base: Mapping[str, Tensor],
    previous: Mapping[str, Tensor],
    grads: Mapping[str, Tensor],
    dtype: torch.dtype,
) -> Tensor | None:
    """``K`` of :meth:`~quotientgeo.geometry.perturbation.Piece.gradient_gram_` summed over
    pieces of the adaptive rest whose ``ξ_k`` the weights hold (``weights - base``), by one call
    of ``quotientgeo::adaptive_gram`` (:func:`operators`), with ``grads ← ŵ² ∇``; ``None``
    (nothing done) where a piece does not qualify (module docstring) or the pieces' manifolds
    differ."""
    manifold = pieces[0].manifold if pieces else None
    if not _plain_adaptive(manifold) or any(p.manifold is not manifold for p in pieces):
        return None
    views = _views(pieces, (weights, base, previous, grads), dtype)
    if views is None:
        return None
    assert isinstance(manifold, AdaptiveGeometry)
    return operators()[0](*views, manifold.floor**2)


def fused_step(
    pieces: Sequence[Piece],
    weights: Mapping[str, Tensor],
    base: Mapping[str, Tensor],
    previous: Mapping[str, Tensor],
    grads: Mapping[str, Tensor],
    c: Tensor,
    dtype: torch.dtype,
) -> bool:
    """``quotientgeo::adaptive_step`` (:func:`operators`) on ``pieces``, in one call: the
    weights hold ``x₀ + ξ_k``, ``previous`` holds ``ξ_{k-1}`` and takes ``ξ_k``, ``grads`` hold
    ``g``; ``c`` the three coefficients (compute dtype). ``False`` (nothing done) where a piece
    is not :func:`fusable`."""
    views = _views(pieces, (weights, base, previous, grads), dtype)
    if views is None:
        return False
    operators()[1](*views, c)
    return True


def fused_held_step(
    pieces: Sequence[Piece],
    current: Mapping[str, Tensor],
    previous: Mapping[str, Tensor],
    grads: Mapping[str, Tensor],
    targets: Mapping[str, Tensor],
    c: Tensor,
    dtype: torch.dtype,
) -> bool:
    """``quotientgeo::held_step`` (:func:`operators`) on ``pieces``, in one call: ``current``
    holds ``ξ_k`` (tensors other than ``targets``), ``previous`` holds ``ξ_{k-1}`` and takes
    ``ξ_k``, ``grads`` hold ``g``, ``targets`` take ``ξ_{k+1}``. ``False`` (nothing done) where
    a piece is not :func:`fusable`."""
    views = _views(pieces, (current, previous, grads, targets), dtype)
    if views is None:
        return False
    operators()[2](*views, c)
    return True


def _plain_adaptive(manifold) -> bool:
    """Whether ``manifold`` is :class:`~quotientgeo.AdaptiveGeometry` with its own scale and
    metric (a subclass that redefines them takes the eager path)."""
    cls = type(manifold)
    return isinstance(manifold, AdaptiveGeometry) and all(
        getattr(cls, name) is getattr(AdaptiveGeometry, name)
        for name in ("scale_squared", "metric", "inner")
    )
