"""GL(h) two-factor quotients: total spaces (one class per metric), the group, the quotients.

``GLQuotient(n, metric)`` and ``GLTotalSpace(n, metric)`` construct the metric's class
(:class:`~quotientgeo.manifolds.variants.MetricVariants`); each metric's module registers its
classes when imported, here.
"""

from .base import GLQuotient, GLTotalSpace
from .group import GLGroup
from .interpolated import InterpolatedGLQuotient, InterpolatedTotalSpace
from .inv import GLInvQuotient, InvTotalSpace
from .mix import GLMixQuotient, MixTotalSpace
from .rotary import RotaryGLQuotient, RotaryGroup

__all__ = [
    "GLGroup",
    "GLInvQuotient",
    "GLMixQuotient",
    "GLQuotient",
    "GLTotalSpace",
    "InterpolatedGLQuotient",
    "InterpolatedTotalSpace",
    "InvTotalSpace",
    "MixTotalSpace",
    "RotaryGLQuotient",
    "RotaryGroup",
]
