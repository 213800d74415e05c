"""GL(h) two-factor quotients: ``total / group``, a total space with a metric and a group.

- ``total.py``: :class:`GLTotalSpace`, what every metric shares (layout, cached Grams, the
  metric from its weights, Christoffel symbols, geodesics); ``GLTotalSpace(n, metric)``
  constructs the metric's class;
- ``group.py``: :class:`GLGroup`, ``GL(h)`` acting by ``(G, H) ↦ (G A⁻¹, H Aᵀ)``;
- ``quotient.py``: :class:`GLQuotient`, the metric's total space by a :class:`GLGroup`;
  ``GLQuotient(n, metric)`` constructs the metric's class;
- ``inv.py``, ``mix.py``, ``interpolated.py``: one metric each, its total space and its
  quotient (the closed-form projection where there is one);
- ``rotary.py``: the rotary subgroup and its quotient of the same total spaces;
- ``blocks.py``: the block arithmetic they share;
- ``damping.py``: :class:`FrameDamping` and :class:`BallDamping`, dampings scaled to a ball
  (pairs with a zero factor, such as LoRA adapters at ``B = 0``);
- ``framed.py``: the metrics damped in ``H``'s frame (:class:`FrameDamping`), exactly
  invariant.
"""

from .damping import BallDamping, FrameDamping
from .framed import FramedGLQuotient, FramedTotalSpace
from .group import GLGroup
from .interpolated import InterpolatedGLQuotient, InterpolatedTotalSpace
from .inv import GLInvQuotient, InvTotalSpace
from .mix import GLMixQuotient, MixTotalSpace
from .quotient import GLQuotient
from .rotary import RotaryGLQuotient, RotaryGroup
from .total import GLTotalSpace

__all__ = [
    "BallDamping",
    "FrameDamping",
    "FramedGLQuotient",
    "FramedTotalSpace",
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
