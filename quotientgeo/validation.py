"""Validation of scalar arguments, shared by the manifolds, the model layer and the measures.

Numbers may be given as Python numbers, numpy scalars or 0-dim tensors (read once with
``.item()``); they come back as Python ``int`` / ``float``. Bools are rejected everywhere: a
``True`` passed as a size is always a mistake.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["integer", "is_real", "positive_int", "positive_real", "real_in"]


def _number(value):
    """A 0-dim non-bool tensor as its Python number; anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool:
        return value.item()
    return value


def _is_real(number) -> bool:
    return isinstance(number, numbers.Real) and not isinstance(number, bool)


def integer(name: str, value) -> int:
    """``value`` as a Python ``int``: a ``numbers.Integral`` (numpy integers, 0-dim tensors)."""
    number = _number(value)
    if isinstance(number, bool) or not isinstance(number, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(number)


def positive_int(name: str, value, meaning: str = "") -> int:
    """``value`` as a Python ``int`` if it is an integer ``>= 1``."""
    number = _number(value)
    if isinstance(number, bool) or not isinstance(number, numbers.Integral) or number < 1:
        meaning = f" ({meaning})" if meaning else ""
        raise ValueError(f"{name} must be a positive integer{meaning}, got {value!r}")
    return int(number)


def positive_real(name: str, value) -> float:
    """``value`` as a Python ``float`` if it is a finite real number ``> 0``."""
    number = _number(value)
    if not _is_real(number) or not math.isfinite(float(number)):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if number <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(number)


def real_in(name: str, value, low: float, high: float = math.inf) -> float:
    """``value`` as a Python ``float`` if it is a real number in ``[low, high]`` (and finite
    when ``high`` is)."""
    number = _number(value)
    if not _is_real(number) or math.isnan(float(number)):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    number = float(number)
    if not low <= number <= high or number == math.inf:
        span = f"[{low:g}, {high:g}]" if high < math.inf else f"[{low:g}, inf) and be finite"
        raise ValueError(f"{name} must lie in {span}, got {value!r}")
    return number


def is_real(value) -> bool:
    """Is ``value`` a real number (Python, numpy or 0-dim tensor; not a bool)?"""
    return _is_real(_number(value))
