"""Optimizers that see the quotient: sharpness-aware training in a model's parameter geometry,
and geoopt's Riemannian optimizers on a model's symmetry blocks."""

from .riemannian import QuotientOptimizer, quotient_optimizer
from .sam import GeodesicSAM

__all__ = ["GeodesicSAM", "QuotientOptimizer", "quotient_optimizer"]
