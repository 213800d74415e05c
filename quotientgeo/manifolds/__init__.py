"""Quotient manifolds: the generic base and the shipped symmetries."""

from .adaptive import AdaptiveGeometry
from .base import AtPoint, GenericPath, QuotientManifold
from .gl import GLQuotient
from .interpolated import InterpolatedGLQuotient
from .rescale import RescaleQuotient
from .scale import ScaleQuotient

__all__ = [
    "AdaptiveGeometry",
    "AtPoint",
    "GLQuotient",
    "GenericPath",
    "InterpolatedGLQuotient",
    "QuotientManifold",
    "RescaleQuotient",
    "ScaleQuotient",
]
