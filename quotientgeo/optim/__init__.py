"""Optimizers that see the quotient: sharpness-aware training in a model's parameter geometry."""

from .sam import GeodesicSAM

__all__ = ["GeodesicSAM"]
