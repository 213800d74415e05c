"""Checks of a measurement's inputs, with the messages a new user needs."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..geometry import ParameterGeometry

Tensor = torch.Tensor

__all__ = ["check_batches", "check_loss_fn", "check_model", "warn_if_resolution"]


def check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def check_loss_fn(loss_fn: Callable) -> None:
    """``loss_fn`` must be callable as ``loss_fn(model, batch)``."""
    if not callable(loss_fn):
        raise TypeError("loss_fn must be callable as loss_fn(model, batch) -> scalar tensor")
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # builtins and some C callables have none: try it
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            f"loss_fn must be callable as loss_fn(model, batch) -> scalar tensor, but its "
            f"signature is {signature}; unpack the batch inside, e.g. "
            "lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])"
        ) from None


def check_batches(batches) -> None:
    """``batches`` must be an iterable of batches, not one batch."""
    if isinstance(batches, Tensor):
        raise TypeError(
            "batches is a tensor: pass an iterable of batches, e.g. [x] for one batch x (a "
            "tensor would be iterated along its first dimension)"
        )
    if isinstance(batches, Mapping):
        raise TypeError(
            "batches is a mapping: it looks like one batch (a dict of inputs); pass [batch]"
        )
    if isinstance(batches, tuple) and batches and all(isinstance(b, Tensor) for b in batches):
        raise TypeError(
            f"batches is a tuple of {len(batches)} tensors: it looks like one batch (x, y); "
            "pass a list of batches, e.g. [(x, y)]"
        )
    try:
        iter(batches)
    except TypeError:
        raise TypeError(
            f"batches must be an iterable of batches (a list, a DataLoader), got "
            f"{type(batches).__name__}"
        ) from None


def warn_if_resolution(records, geometry: ParameterGeometry) -> None:
    """Warn when a half-precision model's sharpness is below the resolution of its loss.

    A forward pass in ``float16`` or ``bfloat16`` resolves a loss ``L`` to about
    ``eps · |L|`` (``torch.finfo(dtype).eps``: 2⁻¹⁰ for float16, 2⁻⁷ for bfloat16), whatever
    dtype the loss is returned in; a mean loss increase below that is rounding, not
    curvature.
    """
    half = geometry.half_dtypes
    if not half:
        return
    eps = max(torch.finfo(getattr(torch, name.removeprefix("torch."))).eps for name in half)
    base = sum(abs(r.base_loss) for r in records) / len(records)
    value = sum(r.loss - r.base_loss for r in records) / len(records)
    resolution = eps * base
    if abs(value) < resolution:
        names = ", ".join(n.removeprefix("torch.") for n in half)
        warnings.warn(
            f"sharpness {value:.3g} is below the resolution of the loss of a {names} model: "
            f"its forward pass resolves the loss {base:.4g} to about eps × |L| = "
            f"{resolution:.3g} (eps = {eps:.3g}), so the value is rounding rather than "
            "curvature. Measure a float32 copy of the model (copy.deepcopy(model).float()), or "
            "a larger radius",
            UserWarning,
            stacklevel=4,
        )
