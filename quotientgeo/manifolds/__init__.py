"""Quotient manifolds: the generic base and the shipped symmetries."""

from .adaptive import AdaptiveGeometry
from .base import (
    DEFAULT_CONDITION,
    DEFAULT_METRIC,
    AtPoint,
    GenericPath,
    Group,
    GroupAction,
    MetricVariants,
    Quotient,
    QuotientManifold,
)
from .euclidean import EuclideanGeometry
from .gl import (
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
from .product import ProductQuotient
from .rescale import RescaleInvQuotient, RescaleMixQuotient, RescaleQuotient
from .scale import ScaleQuotient

__all__ = [
    "DEFAULT_CONDITION",
    "DEFAULT_METRIC",
    "AdaptiveGeometry",
    "AtPoint",
    "EuclideanGeometry",
    "GLGroup",
    "GLInvQuotient",
    "GLMixQuotient",
    "GLQuotient",
    "GLTotalSpace",
    "GenericPath",
    "Group",
    "GroupAction",
    "InterpolatedGLQuotient",
    "InterpolatedTotalSpace",
    "InvTotalSpace",
    "MetricVariants",
    "MixTotalSpace",
    "ProductQuotient",
    "Quotient",
    "QuotientManifold",
    "RescaleInvQuotient",
    "RescaleMixQuotient",
    "RescaleQuotient",
    "RotaryGLQuotient",
    "RotaryGroup",
    "ScaleQuotient",
]
