"""The options shared by the measures and the sharpness-aware optimizer, as string enums.

Every option also accepts its value as a plain string (``"second_order"`` and
``Perturbation.SECOND_ORDER`` are the same option); :func:`option` turns either into the enum
member with an error that lists the allowed values.
"""

from __future__ import annotations

import enum
from typing import TypeVar

from .validation import is_real, real_in

__all__ = [
    "METRICS",
    "Distributed",
    "Norm",
    "Option",
    "Perturbation",
    "checked_metric",
    "option",
]

E = TypeVar("E", bound="Option")

#: Named metrics of the GL and re-scaling quotients (GL pairs also take a number ``s ∈ [0, 1]``).
METRICS = ("mix", "inv")


class Option(str, enum.Enum):
    """A string enum: its members are their values (``Norm("adaptive") is Norm.ADAPTIVE``).

    It behaves as Python 3.11's ``enum.StrEnum`` on every supported Python (3.10 has none):
    ``str()`` gives the value, and so does ``format()``, which follows ``str()``
    (``f"{Norm.ADAPTIVE}" == "adaptive"``); ``repr()`` names the member.
    """

    __str__ = str.__str__


class Perturbation(Option):
    """How a tangent vector ``ξ`` moves a symmetry block ``x``.

    ``SECOND_ORDER``: ``expmap2``, ``x + ξ - ½Γ(ξ, ξ)`` (the paper's map); ``FIRST_ORDER``:
    ``retr``, ``x + ξ``; ``EXACT``: ``expmap``, the geodesic ``γ_ξ(1)`` (closed form where
    known, else integrated); ``DEFAULT``: ``EXACT`` on manifolds whose geodesic is a closed form
    (``closed_form_geodesic``), ``SECOND_ORDER`` elsewhere.
    """

    DEFAULT = "default"
    SECOND_ORDER = "second_order"
    FIRST_ORDER = "first_order"
    EXACT = "exact"


class Norm(Option):
    """The metric of the ball and of the gradient: ``RIEMANNIAN`` (the quotient metric of each
    block) or ``ADAPTIVE`` (the element-wise ``Σ ξ²/w²`` on every entry, perturbations kept
    horizontal)."""

    RIEMANNIAN = "riemannian"
    ADAPTIVE = "adaptive"


class Distributed(Option):
    """How a measurement spreads over the ranks of a ``torch.distributed`` process group
    (:mod:`quotientgeo.sharpness.ranks`). ``AUTO``: ``SPLIT_BATCH`` for a model sharded over
    the ranks (FSDP2), ``BATCHES`` otherwise."""

    AUTO = "auto"
    BATCHES = "batches"
    SPLIT_BATCH = "split_batch"
    OFF = "off"


def option(kind: type[E], name: str, value) -> E:
    """``value`` (a member of ``kind`` or its string) as the member; ``ValueError`` naming
    ``name`` and the allowed values otherwise."""
    try:
        return kind(value)
    except ValueError:
        allowed = tuple(m.value for m in kind)
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}") from None


def checked_metric(metric):
    """``None`` (as declared), ``"mix"``, ``"inv"``, or a number ``s`` as a Python ``float`` in
    ``[0, 1]``."""
    if metric is None:
        return None
    if is_real(metric):
        return real_in("an interpolated metric s", metric, 0.0, 1.0)
    if metric not in METRICS:
        raise ValueError(
            f"metric must be one of {METRICS}, a number s in [0, 1] or None (as declared), "
            f"got {metric!r}"
        )
    return str(metric)
