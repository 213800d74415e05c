r"""Worst-case and average sharpness of a model in (geodesic) balls of its parameter geometry.

For a batch ``S`` with loss ``L_S`` and the parameters ``x`` split by a
:class:`~quotientgeo.geometry.ParameterGeometry` into symmetry blocks and an adaptive rest,

    worst-case:  ``max_{ξ horizontal, ||ξ||_x ≤ ρ} L_S(γ_ξ(1)) - L_S(x)``
    average:     ``E_{ξ horizontal, ||ξ||_x = ρ} L_S(γ_ξ(1)) - L_S(x)``

averaged over batches. ``||ξ||²_x = Σ_blocks <ξ_b, ξ_b>`` (square norms add), ``γ_ξ(1)`` is the
exact, second-order (``x + ξ - ½ Γ(ξ, ξ)``) or first-order (``x + ξ``) geodesic step on the
symmetry blocks and the straight line ``w + ξ`` on the adaptive rest, whose metric is
``Σ ξ² / ŵ²`` with ``ŵ = max(|w|, floor)`` (Andriushchenko et al. 2023; ``floor`` is
:class:`~quotientgeo.AdaptiveGeometry`'s, ``1e-12``: a zero weight moves by at most
``ρ · 1e-12``).

The package, one idea per module, data flowing down:

- :mod:`.measure`: :class:`Measure`, the one measure type (``name``, :meth:`Measure.evaluate`,
  :meth:`Measure.with_rho`, :meth:`Measure.settings`, the named constructors), and its two
  kinds: :class:`SharpnessMeasure` (ball, map, metric, symmetries, case, ρ) and
  :class:`RelativeFlatness`; :mod:`.functions`: the public functions built on them;
- :mod:`.run`: the batch driver (checks in :mod:`.checks`, the model guard in :mod:`.state`);
- :mod:`.cases`: worst case (Auto-PGD, :mod:`.apgd`) or average, per batch;
- :mod:`.objective`: the loss of a batch as a function of ``ξ``;
- :mod:`.ranks`: one class per ``torch.distributed`` mode; :mod:`.result`: records and result;
- :mod:`.flatness`: relative flatness (Petzka et al. 2021) of one linear layer, a Hessian
  measure with its own function and result, no ball;
- :mod:`.tracking`: a measure evaluated every ``N`` steps of a training loop;
- :mod:`.calibration`: the radius ``ρ`` at which a measure reaches a target value.

The worst-case measures also report, per batch, the loss ``L_S(x + ξ*)`` at the first-order
move (``retr`` on every block) of the worst perturbation ``ξ*`` found, and from it the
curvature share ``(value - first_order_value) / value``: the fraction of the worst-case
increase that the curvature (Christoffel) term of the map carries, ``O(ρ)`` as ``ρ → 0``.

The model is not copied: during a measurement its own weights hold the perturbed point and its
``.grad`` the gradient there; weights, train/eval mode, buffers and ``.grad`` are restored
bit-exactly on exit, also on exceptions and ``KeyboardInterrupt``. Loss evaluations run in eval
mode (no dropout, batch-norm running statistics).
"""

from .calibration import Calibration, calibrate_rho
from .cases import AverageCase, WorstCase
from .flatness import FlatnessResult, relative_flatness
from .functions import adaptive_sharpness, average_sharpness, geodesic_sharpness
from .measure import Measure, MeasureResult, RelativeFlatness, SharpnessMeasure
from .result import BatchRecord, SharpnessResult
from .tracking import SharpnessTracker, TrackedSharpness

__all__ = [
    "AverageCase",
    "BatchRecord",
    "Calibration",
    "FlatnessResult",
    "Measure",
    "MeasureResult",
    "RelativeFlatness",
    "SharpnessMeasure",
    "SharpnessResult",
    "SharpnessTracker",
    "TrackedSharpness",
    "WorstCase",
    "adaptive_sharpness",
    "average_sharpness",
    "calibrate_rho",
    "geodesic_sharpness",
    "relative_flatness",
]
