"""Quotient manifolds: the generic base and the shipped symmetries."""

from .adaptive import AdaptiveGeometry
from .base import AtPoint, QuotientManifold
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
from .groups import DEFAULT_CONDITION, Group
from .product import ProductQuotient
from .quotient import GenericPath, GroupAction, Quotient
from .rescale import RescaleInvQuotient, RescaleMixQuotient, RescaleQuotient
from .scale import ScaleQuotient
from .variants import DEFAULT_METRIC, MetricVariants

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
