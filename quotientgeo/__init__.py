"""quotientgeo: Riemannian geometry of neural-network parameter symmetries.

Quotient manifolds of parameter symmetries as :class:`geoopt.Manifold` subclasses, and
geodesic sharpness of whole models measured on them (da Silva, Dangel & Oore, ICML 2025).
"""

from . import optim
from .curvature import (
    RiemannianHessian,
    hessian_density,
    hessian_eigenvalues,
    hessian_trace,
)
from .geometry import ParameterGeometry, Source, find_symmetries
from .manifolds import (
    AdaptiveGeometry,
    AtPoint,
    BallDamping,
    EuclideanGeometry,
    FrameDamping,
    GLQuotient,
    ProductQuotient,
    QuotientManifold,
    RescaleQuotient,
    RotaryGLQuotient,
    ScaleQuotient,
)
from .sharpness import (
    Calibration,
    FlatnessResult,
    Measure,
    SharpnessResult,
    SharpnessTracker,
    adaptive_sharpness,
    average_sharpness,
    calibrate_rho,
    geodesic_sharpness,
    relative_flatness,
)

__version__ = "0.2.0"

__all__ = [
    "AdaptiveGeometry",
    "AtPoint",
    "BallDamping",
    "Calibration",
    "EuclideanGeometry",
    "FlatnessResult",
    "FrameDamping",
    "GLQuotient",
    "Measure",
    "ParameterGeometry",
    "ProductQuotient",
    "QuotientManifold",
    "RescaleQuotient",
    "RiemannianHessian",
    "RotaryGLQuotient",
    "ScaleQuotient",
    "SharpnessResult",
    "SharpnessTracker",
    "Source",
    "__version__",
    "adaptive_sharpness",
    "average_sharpness",
    "calibrate_rho",
    "find_symmetries",
    "geodesic_sharpness",
    "hessian_density",
    "hessian_eigenvalues",
    "hessian_trace",
    "optim",
    "relative_flatness",
]
