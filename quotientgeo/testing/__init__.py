"""Helpers for tests, examples, experiments and docs.

- :func:`check_quotient`: the contract of a quotient manifold (metric invariance,
  horizontality, equivariance, isotropy, closed forms against the generic derivation), checked
  on random vectors and group elements;
- :func:`moved_along_orbits`, :func:`move_along_orbits_`: a model moved along the orbits of its
  symmetry blocks by well-conditioned group elements (same function, other parameters);
- a tiny transformer classifier, its loss and random data.
"""

from __future__ import annotations

from .contract import QuotientReport, check_quotient
from .models import TinyTransformerClassifier, cross_entropy, random_batches
from .orbits import move_along_orbits_, moved_along_orbits
from .properties import PROPERTIES

__all__ = [
    "PROPERTIES",
    "QuotientReport",
    "TinyTransformerClassifier",
    "check_quotient",
    "cross_entropy",
    "move_along_orbits_",
    "moved_along_orbits",
    "random_batches",
]
