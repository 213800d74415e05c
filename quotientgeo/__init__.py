"""quotientgeo: Riemannian geometry of neural-network parameter symmetries.

Quotient manifolds of parameter symmetries as :class:`geoopt.Manifold` subclasses, and
geodesic sharpness of whole models measured on them (da Silva, Dangel & Oore, ICML 2025).
"""

from .manifolds import AdaptiveGeometry, AtPoint, GLQuotient, QuotientManifold, RescaleQuotient

__version__ = "0.1.0"

__all__ = [
    "AdaptiveGeometry",
    "AtPoint",
    "GLQuotient",
    "QuotientManifold",
    "RescaleQuotient",
    "__version__",
]
