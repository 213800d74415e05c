"""Lie groups acting on a total space: the :class:`Group` protocol and random group elements.

A :class:`Group` is what :class:`~quotientgeo.manifolds.Quotient` composes with a total space;
``random_element`` draws its elements with a bound on their condition number, ``random_exp``
draws ``exp(ω)`` for a random Lie-algebra element ``ω``.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..linalg import log_uniform
from ..validation import real_in

if TYPE_CHECKING:
    from .base import AtPoint

Tensor = torch.Tensor

#: The default bound on the condition number of :meth:`QuotientManifold.random_group`'s elements
#: (and of the moves of :func:`quotientgeo.testing.moved_along_orbits`).
DEFAULT_CONDITION = 4.0

__all__ = ["DEFAULT_CONDITION", "Group", "check_condition", "random_element", "random_exp"]


def check_condition(condition: float) -> float:
    """``condition`` as a float, checked to be a real number ``≥ 1``."""
    return real_in("condition", condition, 1.0)


def random_exp(
    lie: tuple[int, ...],
    batch: tuple[int, ...],
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    scale: float = 1.0,
    condition: float = DEFAULT_CONDITION,
) -> Tensor:
    """``g = scale · exp(ω)`` of shape ``(*batch, *lie)`` with ``cond(g) ≤ condition``.

    ``exp`` is the matrix exponential for square Lie shapes ``(h, h)``: ``ω`` is a standard
    Gaussian rescaled to spectral norm ``r · ½ log(condition)``, ``r`` uniform in ``[0, 1]``
    (``‖exp(±ω)‖₂ ≤ e^{‖ω‖₂}``; a rescaled ``ω`` stays in any subspace the Gaussian lies in).
    Otherwise (scalings) ``exp`` is element-wise and each entry of ``ω`` is uniform in
    ``[-½ log c, ½ log c]``: factors log-uniform in ``[c^{-1/2}, c^{1/2}]``, any two within a
    factor ``c = condition`` of each other. ``scale > 0`` keeps ``g`` in the identity component.
    """
    condition = check_condition(condition)
    kw = {"generator": generator, "dtype": dtype, "device": device}
    if len(lie) == 2 and lie[0] == lie[1]:
        omega = torch.randn((*batch, *lie), **kw)
        norm = torch.linalg.matrix_norm(omega, ord=2, keepdim=True)
        radius = 0.5 * math.log(condition) * torch.rand((*batch, 1, 1), **kw)
        omega = omega * (radius / norm.clamp_min(torch.finfo(omega.dtype).tiny))
        return torch.linalg.matrix_exp(omega).mul_(scale)
    return log_uniform(*batch, *lie, condition=condition, **kw).mul_(scale)


def random_element(
    group: Any,
    x: Tensor,
    *,
    generator: torch.Generator | None = None,
    scale: float = 1.0,
    condition: float = DEFAULT_CONDITION,
) -> Any:
    """``group.random_group(x, generator=, scale=, condition=)``, without ``condition`` where
    that ``random_group`` (a user's override) takes no such keyword."""
    if _takes_condition(type(group).random_group):
        return group.random_group(x, generator=generator, scale=scale, condition=condition)
    return group.random_group(x, generator=generator, scale=scale)


@functools.cache
def _takes_condition(method: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "condition" or p.kind is p.VAR_KEYWORD for p in parameters)


class Group(Protocol):
    """A Lie group acting on the points of a total space (what :class:`Quotient` composes).

    The methods are those of :class:`QuotientManifold` of the same names (a quotient manifold is
    a group in this sense, for its own group): the shape of a Lie-algebra element, the vertical
    map ``ω ↦ V_x ω``, an approximate inverse of the normal operator ``V* M V`` (the identity
    when unknown), the finite action and its differential, random elements and a name. A
    ``random_group`` without the ``condition`` keyword (the bound on the elements' condition
    number) is called without it (:func:`random_element`). A group element is whatever ``act``
    takes (a tensor for the shipped groups but :class:`~.product.ProductGroup`, whose elements
    are tuples).
    """

    def lie_shape(self, p: AtPoint, /) -> tuple[int, ...]: ...

    def vertical(self, p: AtPoint, omega: Tensor, /) -> Tensor: ...

    def precondition(self, p: AtPoint, r: Tensor, /) -> Tensor: ...

    def act(self, x: Tensor, g: Any, /) -> Tensor: ...

    def push(self, x: Tensor, u: Tensor, g: Any, /) -> Tensor: ...

    def random_group(
        self,
        x: Tensor | AtPoint,
        /,
        *,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
        condition: float = DEFAULT_CONDITION,
    ) -> Any: ...

    def group_name(self, shape: tuple[int, ...], /) -> str: ...
