"""GL(h) two-factor quotients, one class per metric (``GLQuotient(n, metric)`` dispatches)."""

from .base import GLQuotient
from .interpolated import InterpolatedGLQuotient
from .inv import GLInvQuotient
from .mix import GLMixQuotient
from .rotary import RotaryGLQuotient

__all__ = [
    "GLInvQuotient",
    "GLMixQuotient",
    "GLQuotient",
    "InterpolatedGLQuotient",
    "RotaryGLQuotient",
]
