"""Quotient manifolds: the generic base and the shipped symmetries."""

from .adaptive import AdaptiveGeometry
from .base import AtPoint, GenericPath, QuotientManifold
from .gl import GLQuotient
from .rescale import RescaleQuotient

__all__ = [
    "AdaptiveGeometry",
    "AtPoint",
    "GLQuotient",
    "GenericPath",
    "QuotientManifold",
    "RescaleQuotient",
]
