r"""The sharpness-aware step's passes over the rest as compiled kernels: ``GeodesicSAM(...,
compile=True)``.

Every parameter without symmetry (every parameter for SAM and ASAM) moves along a straight line
in an element-wise metric, ``ŵ = max(|w|, floor)`` for ASAM and geodesic SAM, ``ŵ = 1`` for
SAM. The first pass takes the square norm of the Riemannian gradient ``ŵ² ∇``,

.. math::

    \|ŵ^2 ∇\|_w^2 = \sum ŵ^2 ∇^2,

and the second moves the weights to the perturbed point,

.. math::

    w ← w + c\, ŵ^2 ∇, \qquad c = ρ / \|\operatorname{grad} L\|_w.

In eager PyTorch these are eight ``_foreach`` passes for ASAM (``|w|``, the floor, ``ŵ ∇``, its
norm; ``w²``, the floor, the factor ``c``, the sum), about 19 copies of the rest's memory
traffic, and three for SAM (6 copies); here each pass is one function of the segments of all
the rest's pieces together (views of the weights and the gradients, no temporary) compiled by
:func:`torch.compile` into one kernel: the first reads ``w`` and ``∇`` (two copies; one for
SAM), the second reads them and writes ``w`` (three). The first pass sums in another order than
the eager norms, so the norm agrees with the eager path to rounding; the second computes the
eager path's products in its order.

Each compiled function is wrapped in a custom operator (``quotientgeo::rest_sqnorm``,
``quotientgeo::rest_step``, registered on first use by :func:`operators`), so that the
dispatcher sees one operator, counted by ``quotientgeo bench cost --compile`` with the bytes of
its inputs and outputs. A piece that is not a list of plain views in the compute dtype (a
masked, sharded or non-contiguous parameter, or one of another dtype) takes the eager path, as
does a subclass of :class:`~quotientgeo.AdaptiveGeometry` with its own scale.
"""

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from ..geometry.perturbation import Piece
from ..manifolds import AdaptiveGeometry, EuclideanGeometry
from ..sharpness.fused import _compiled

Tensor = torch.Tensor

__all__ = ["RestViews", "fused_rest_sqnorm", "fused_rest_step", "operators", "rest_views"]


def _sqnorm(grads: list[Tensor], weights: list[Tensor], floor_squared: float) -> Tensor:
    """``Σ max(w², floor²) ∇²`` over the segments (``Σ ∇²`` where ``weights`` is empty)."""
    total = None
    for i, d in enumerate(grads):
        e = d * d
        if weights:
            w = weights[i]
            e = (w * w).clamp_min(floor_squared) * e
        s = e.sum()
        total = s if total is None else total + s
    assert total is not None
    return total


def _step(
    weights: list[Tensor], grads: list[Tensor], c: Tensor, floor_squared: float, adaptive: bool
) -> None:
    """``w ← w + (c max(w², floor²)) ∇`` (``w + ∇ c`` unless ``adaptive``), in place, the
    products in the eager path's order."""
    for w, d in zip(weights, grads, strict=True):
        if adaptive:
            w.copy_(w + (w * w).clamp_min(floor_squared) * c * d)
        else:
            w.copy_(w + d * c)


@functools.cache
def operators() -> tuple[Callable[..., Tensor], Callable[..., None]]:
    """``(rest_sqnorm, rest_step)``: :func:`_sqnorm` and :func:`_step` compiled by
    :func:`torch.compile` (dynamic sizes) and registered as the custom operators
    ``quotientgeo::rest_sqnorm`` and ``quotientgeo::rest_step`` (mutating ``weights``), on
    first use."""
    sqnorm, step = _compiled(_sqnorm), _compiled(_step)

    # the schemas written out: torch 2.6 infers none from ``list[Tensor]`` annotations
    @torch.library.custom_op(
        "quotientgeo::rest_sqnorm",
        mutates_args=(),
        schema="(Tensor[] grads, Tensor[] weights, float floor_squared) -> Tensor",
    )
    def rest_sqnorm(grads: list[Tensor], weights: list[Tensor], floor_squared: float) -> Tensor:
        out = sqnorm(grads, weights, floor_squared)
        assert isinstance(out, Tensor)
        return out

    @rest_sqnorm.register_fake
    def _(grads, weights, floor_squared):
        return grads[0].new_empty(())

    @torch.library.custom_op(
        "quotientgeo::rest_step",
        mutates_args=("weights",),
        schema="(Tensor(a!)[] weights, Tensor[] grads, Tensor c, float floor_squared, "
        "bool adaptive) -> ()",
    )
    def rest_step(
        weights: list[Tensor], grads: list[Tensor], c: Tensor, floor_squared: float, adaptive: bool
    ) -> None:
        step(weights, grads, c, floor_squared, adaptive)

    return rest_sqnorm, rest_step


class RestViews(NamedTuple):
    """The pieces of the rest that the kernels take, and their segments' views of the weights
    and of the gradients (all pieces' segments in order), built once for both passes."""

    pieces: list[Piece]
    weights: list[Tensor]
    grads: list[Tensor]


def rest_views(
    pieces: Sequence[Piece],
    manifold,
    weights: Mapping[str, Tensor],
    grads: Mapping[str, Tensor],
    dtype: torch.dtype,
) -> RestViews | None:
    """The pieces that the kernels take: not sharded, every segment a plain view of the weights
    and of the gradients in ``dtype``
    (:meth:`~quotientgeo.geometry.perturbation.Piece.views`); ``None`` where there is none, or
    the kernels do not know ``manifold``'s metric (:class:`~quotientgeo.EuclideanGeometry` or
    :class:`~quotientgeo.AdaptiveGeometry` itself: a subclass may redefine the scale). The
    views stay valid while the tensors are written in place."""
    if _floor_squared(manifold) is None:
        return None
    out = RestViews([], [], [])
    for piece in pieces:
        w = None if piece.sharded else piece.views(weights, dtype)
        d = None if w is None else piece.views(grads, dtype)
        if w is None or d is None:
            continue
        out.pieces.append(piece)
        out.weights.extend(w)
        out.grads.extend(d)
    return out if out.pieces else None


def _floor_squared(manifold) -> float | None:
    """``floor²`` of a plain :class:`~quotientgeo.AdaptiveGeometry`, ``0.0`` for the flat
    metric, ``None`` for anything else (a subclass with its own scale takes the eager path)."""
    if type(manifold) is EuclideanGeometry:
        return 0.0
    if type(manifold) is AdaptiveGeometry:
        return manifold.floor**2
    return None


def fused_rest_sqnorm(views: RestViews, manifold) -> Tensor:
    """``||grad||²`` of the pieces of ``views`` (:func:`rest_views`) in ``manifold``'s metric
    (``Σ ŵ² ∇²``, ``Σ ∇²`` for the flat one) by one call of ``quotientgeo::rest_sqnorm``."""
    floor_squared = _floor_squared(manifold)
    assert floor_squared is not None
    weights = views.weights if isinstance(manifold, AdaptiveGeometry) else []
    return operators()[0](views.grads, weights, floor_squared)


def fused_rest_step(views: RestViews, manifold, c: Tensor) -> None:
    """``w ← w + c ŵ² ∇`` (``w + c ∇`` for the flat metric) at the entries of the pieces of
    ``views`` (:func:`rest_views`), in place, by one call of ``quotientgeo::rest_step``."""
    floor_squared = _floor_squared(manifold)
    assert floor_squared is not None
    adaptive = isinstance(manifold, AdaptiveGeometry)
    operators()[1](views.weights, views.grads, c, floor_squared, adaptive)
