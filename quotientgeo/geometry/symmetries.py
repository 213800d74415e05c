"""Which parameter geometry a measure or the optimizer uses, in the metric it declares."""

from __future__ import annotations

import warnings

from torch import nn

from ..manifolds import BallDamping, FrameDamping
from .discovery import find_symmetries
from .parameters import ParameterGeometry

__all__ = ["geometry_of"]


def geometry_of(
    model: nn.Module,
    symmetries,
    metric: str | float | None,
    *,
    eps: float | BallDamping | FrameDamping | None = None,
    warn_missing: bool = True,
) -> ParameterGeometry:
    """The geometry a measure or the optimizer uses, its manifolds resolved once.

    ``symmetries="auto"``: :func:`~quotientgeo.find_symmetries`, declared in ``metric`` when
    one is named; ``None``: every parameter adaptive; a :class:`ParameterGeometry`: as
    declared, and a ``metric`` that differs from a declared one is an error (the geometry's
    :meth:`~ParameterGeometry.with_metric` measures it in another metric). ``eps``, unless
    ``None``, re-chooses the Gram relaxation of the kinds that have a metric.
    """
    if isinstance(symmetries, str) and symmetries == "auto":
        geometry = find_symmetries(model)
        if metric is not None or eps is not None:
            geometry = geometry.with_metric(metric, eps=eps)
        if not geometry.kinds and warn_missing:
            warnings.warn(_nothing_found(model, geometry), UserWarning, stacklevel=4)
    elif symmetries is None:
        geometry = ParameterGeometry(model)
    elif isinstance(symmetries, ParameterGeometry):
        if symmetries.model is not model:
            raise ValueError("the ParameterGeometry passed as symmetries describes another model")
        geometry = symmetries
        other = [m for m in geometry.metrics if m != metric]
        if metric is not None and other:
            raise ValueError(
                f"metric={metric!r}, but the geometry declares {', '.join(map(repr, other))}: "
                "a geometry is measured in the metric it declares; pass metric=None, or "
                f"symmetries=geometry.with_metric({metric!r}) to measure it in {metric!r}"
            )
        if eps is not None:
            geometry = geometry.with_metric(None, eps=eps)
    else:
        raise TypeError(
            f"symmetries must be 'auto', None or a ParameterGeometry, got {symmetries!r}"
        )
    if not geometry.params:
        raise ValueError("the model has no trainable parameters (requires_grad=True)")
    _check_materialised(model)
    half = geometry.half_dtypes
    if half:
        warnings.warn(
            f"the model has {', '.join(half)} parameters: the geometry (points, projections, "
            "geodesic steps, norms) is computed in float32, a part at a time; the iterates are "
            "kept, and the forward and backward passes run, in the parameters' dtype",
            UserWarning,
            stacklevel=4,
        )
    return geometry


def _nothing_found(model: nn.Module, geometry: ParameterGeometry) -> str:
    """Why a discovered geometry has no symmetry block: nothing recognised, or what discovery
    left out (``geometry.skipped``: frozen or unmappable attention)."""
    adaptive = "every parameter is measured in the adaptive geometry"
    if geometry.skipped:
        shown = "; ".join(geometry.skipped[:3])
        more = f" (+{len(geometry.skipped) - 3} more)" if len(geometry.skipped) > 3 else ""
        return (
            f"no symmetry block to measure in {type(model).__name__}: discovery left out "
            f"{len(geometry.skipped)} block(s): {shown}{more}; {adaptive}"
        )
    return (
        f"no parameter symmetry detected in {type(model).__name__}: {adaptive} (declare "
        "blocks with ParameterGeometry for custom architectures)"
    )


def _check_materialised(model: nn.Module) -> None:
    """Refuse a model whose weights have no values (the ``meta`` device) with a message that
    names the device, rather than failing deep inside the first norm."""
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        shown = ", ".join(meta[:3]) + (f" and {len(meta) - 3} more" if len(meta) > 3 else "")
        raise ValueError(
            f"{type(model).__name__} has parameters on the meta device ({shown}): they have "
            "shapes but no values, so nothing can be measured; materialise them first (for "
            "example model.to_empty(device='cpu') and load a state dict, or build the model "
            "outside a torch.device('meta') context)"
        )
