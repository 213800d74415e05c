"""Quotient manifolds: the generic base and the shipped symmetries."""

from .adaptive import AdaptiveGeometry
from .base import DEFAULT_METRIC, AtPoint, QuotientManifold
from .euclidean import EuclideanGeometry
from .gl import (
    BallDamping,
    FrameDamping,
    FramedGLQuotient,
    FramedTotalSpace,
    GLGroup,
    GLInvQuotient,
    GLMixQuotient,
    GLQuotient,
    GLTotalSpace,
    InterpolatedGLQuotient,
    InterpolatedTotalSpace,
    InvTotalSpace,
    MixTotalSpace,
    RotaryGLQuotient,
    RotaryGroup,
)
from .groups import DEFAULT_CONDITION, Group
from .product import ProductGroup, ProductQuotient, ProductTotalSpace
from .quotient import GenericPath, Quotient, TotalSpace
from .rescale import (
    RescaleGroup,
    RescaleInvQuotient,
    RescaleInvTotalSpace,
    RescaleMixQuotient,
    RescaleMixTotalSpace,
    RescaleQuotient,
    RescaleTotalSpace,
)
from .scale import ScaleGroup, ScaleQuotient, ScaleTotalSpace

__all__ = [
    "DEFAULT_CONDITION",
    "DEFAULT_METRIC",
    "AdaptiveGeometry",
    "AtPoint",
    "BallDamping",
    "EuclideanGeometry",
    "FrameDamping",
    "FramedGLQuotient",
    "FramedTotalSpace",
    "GLGroup",
    "GLInvQuotient",
    "GLMixQuotient",
    "GLQuotient",
    "GLTotalSpace",
    "GenericPath",
    "Group",
    "InterpolatedGLQuotient",
    "InterpolatedTotalSpace",
    "InvTotalSpace",
    "MixTotalSpace",
    "ProductGroup",
    "ProductQuotient",
    "ProductTotalSpace",
    "Quotient",
    "QuotientManifold",
    "RescaleGroup",
    "RescaleInvQuotient",
    "RescaleInvTotalSpace",
    "RescaleMixQuotient",
    "RescaleMixTotalSpace",
    "RescaleQuotient",
    "RescaleTotalSpace",
    "RotaryGLQuotient",
    "RotaryGroup",
    "ScaleGroup",
    "ScaleQuotient",
    "ScaleTotalSpace",
    "TotalSpace",
]
