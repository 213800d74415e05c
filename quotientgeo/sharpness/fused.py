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
parameter copies of memory traffic per iteration; here each is one function of a piece's
segments (views of the weights, of ``x₀``, of ``ξ'`` and of ``∇``) compiled by
:func:`torch.compile` into one kernel. On the CPU (torch 2.14) the Gram pass's kernel makes two
loops over a segment, the six sums (reading the four vectors) and the write of ``g`` (reading
``x₀`` and ``∇`` again): seven copies; the step's makes one (reading four, writing ``ξ'`` and
``w̃``): six. The Gram pass's sums are taken in
another order than the eager matrix product, so ``K`` agrees with the eager path to rounding;
``g`` is the same product, bit for bit; the step sums its terms in the eager order.

Each compiled function is wrapped in a custom operator (``quotientgeo::adaptive_gram``,
``quotientgeo::adaptive_step``, registered on first use by :func:`operators`), so that the
dispatcher sees one operator, counted by ``quotientgeo bench cost --compile`` with the bytes of
its inputs and outputs (five copies for the Gram pass, two fewer than its loops move). A
function compiles once per number of segments of a piece (the segments' sizes are dynamic);
torch's limit on recompilations (``torch._dynamo.config.recompile_limit``, 8 by default) bounds
how many are compiled, and beyond it the function runs eagerly (torch warns once). What does not
qualify takes the eager path: a piece with a masked or sharded parameter, weights in another
dtype than the compute dtype, a subclass of :class:`~quotientgeo.AdaptiveGeometry` with its own
scale or metric (the Gram pass), the segments of symmetric parameters (the step), and the step
at which ``ξ_{k-1}`` is kept as the best point (it then goes into a new buffer).
"""

import functools
from collections.abc import Callable, Mapping

import torch

from ..geometry.perturbation import Piece
from ..manifolds import AdaptiveGeometry

Tensor = torch.Tensor

__all__ = ["fused_gram", "fused_step", "operators"]


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


@functools.cache
def operators() -> tuple[Callable[..., Tensor], Callable[..., None]]:
    """``(adaptive_gram, adaptive_step)``: :func:`_gram_sums` and :func:`_step` compiled by
    :func:`torch.compile` (dynamic sizes) and registered as the custom
    operators ``quotientgeo::adaptive_gram`` (mutating ``grads``) and
    ``quotientgeo::adaptive_step`` (mutating ``weights`` and ``previous``), on first use."""
    gram = torch.compile(_gram_sums, dynamic=True)
    step = torch.compile(_step, dynamic=True)

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
        return gram(weights, base, previous, grads, floor_squared)

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

    return adaptive_gram, adaptive_step


def fused_step(
    piece: Piece,
    weights: Mapping[str, Tensor],
    base: Mapping[str, Tensor],
    previous: Mapping[str, Tensor],
    grads: Mapping[str, Tensor],
    c: Tensor,
    dtype: torch.dtype,
) -> bool:
    """``quotientgeo::adaptive_step`` (:func:`operators`) on ``piece``: the weights hold
    ``x₀ + ξ_k``, ``previous`` holds ``ξ_{k-1}`` and takes ``ξ_k``, ``grads`` hold ``g``; ``c``
    the three coefficients (compute dtype). ``False`` (nothing done) where the piece has no
    plain views in ``dtype``."""
    if piece.sharded:
        return False
    views = [piece.views(t, dtype) for t in (weights, base, previous, grads)]
    if any(v is None for v in views):
        return False
    operators()[1](*views, c)
    return True


def fused_gram(
    piece: Piece,
    weights: Mapping[str, Tensor],
    base: Mapping[str, Tensor],
    previous: Mapping[str, Tensor],
    grads: Mapping[str, Tensor],
    dtype: torch.dtype,
) -> Tensor | None:
    """``K`` of :meth:`~quotientgeo.geometry.perturbation.Piece.gradient_gram_` for a piece of
    the adaptive rest whose ``ξ_k`` the weights hold (``weights - base``), by
    ``quotientgeo::adaptive_gram`` (:func:`operators`), with ``grads ← ŵ² ∇``; ``None``
    (nothing done) where the piece does not qualify (module docstring)."""
    manifold = piece.manifold
    if piece.sharded or not _plain_adaptive(manifold):
        return None
    views = [piece.views(t, dtype) for t in (weights, base, previous, grads)]
    if any(v is None for v in views):
        return None
    assert isinstance(manifold, AdaptiveGeometry)
    return operators()[0](*views, manifold.floor**2)


def _plain_adaptive(manifold) -> bool:
    """Whether ``manifold`` is :class:`~quotientgeo.AdaptiveGeometry` with its own scale and
    metric (a subclass that redefines them takes the eager path)."""
    cls = type(manifold)
    return isinstance(manifold, AdaptiveGeometry) and all(
        getattr(cls, name) is getattr(AdaptiveGeometry, name)
        for name in ("scale_squared", "metric", "inner")
    )
