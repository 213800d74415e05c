"""Quotient manifolds: the generic base and the shipped symmetries."""

from .adaptive import AdaptiveGeometry
from .base import AtPoint, GenericPath, QuotientManifold
from .euclidean import EuclideanGeometry
from .gl import (
    GLInvQuotient,
    GLMixQuotient,
    GLQuotient,
    InterpolatedGLQuotient,
    RotaryGLQuotient,
)
from .product import ProductQuotient
from .rescale import RescaleInvQuotient, RescaleMixQuotient, RescaleQuotient
from .scale import ScaleQuotient

__all__ = [
    "AdaptiveGeometry",
    "AtPoint",
    "EuclideanGeometry",
    "GLInvQuotient",
    "GLMixQuotient",
    "GLQuotient",
    "GenericPath",
    "InterpolatedGLQuotient",
    "ProductQuotient",
    "QuotientManifold",
    "RescaleInvQuotient",
    "RescaleMixQuotient",
    "RescaleQuotient",
    "RotaryGLQuotient",
    "ScaleQuotient",
]
