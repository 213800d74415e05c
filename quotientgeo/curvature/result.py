"""What the curvature functions return: the figure of the whole model and, with
``per_block=True``, one per group of coordinates (a layer's attention pairs, adapters, the rest).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

Tensor = torch.Tensor

__all__ = [
    "BlockEigenvalues",
    "BlockSpectrum",
    "BlockTrace",
    "EigenvalueResult",
    "Spectrum",
    "SpectrumResult",
    "TraceResult",
]


def _plain(value: Any) -> Any:
    """``value`` with tensors turned into (nested) lists, for :func:`json.dumps`."""
    if isinstance(value, Tensor):
        return value.detach().cpu().tolist()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class _Plain:
    def to_dict(self) -> dict[str, Any]:
        """Plain ``dict`` of built-in types, ready for :func:`json.dumps`."""
        return _plain(self)


@dataclasses.dataclass(frozen=True)
class BlockTrace(_Plain):
    """The trace of one group's diagonal block: ``Σ_{i ∈ group} A_ii``; the groups' values add
    up to the whole trace.

    Attributes:
        name: ``"layer 3 attention"``, ``"rest"``, ...
        layer: the layer index, or ``None``.
        kind: ``"attention"``, ``"adapter"``, ``"scale"``, ``"symmetry"`` or ``"rest"``.
        dim: coordinates in the group.
        value: the (estimated) trace.
        std_error: the standard error of a Hutchinson estimate (``0.0`` when exact).
    """

    name: str
    layer: int | None
    kind: str
    dim: int
    value: float
    std_error: float


@dataclasses.dataclass(frozen=True)
class TraceResult(_Plain):
    """Outcome of :func:`~quotientgeo.hessian_trace`.

    Attributes:
        value: the trace of the Hessian (exact or estimated).
        std_error: standard error of a Hutchinson estimate (sample standard deviation of the
            probes over ``√n``); ``0.0`` for ``method="exact"``; ``nan`` where the method gives
            none (Hutch++, XTrace).
        per_block: with ``per_block=True``, one :class:`BlockTrace` per group, else ``None``.
        loss: the batch-averaged loss at the weights.
        settings: method, probes, seed, geometry, metric, dimension, batches, dtype, device.
        products: Hessian-vector products computed.
        wall_time: seconds.
    """

    value: float
    std_error: float
    per_block: list[BlockTrace] | None
    loss: float
    settings: dict[str, Any]
    products: int
    wall_time: float

    def __repr__(self) -> str:
        error = "" if self.std_error == 0 else f" ± {self.std_error:.3g}"
        return (
            f"TraceResult(value={self.value:.6g}{error}, method={self.settings['method']!r}, "
            f"geometry={self.settings['geometry']!r}, products={self.products})"
        )


@dataclasses.dataclass(frozen=True)
class BlockEigenvalues(_Plain):
    """The extreme eigenvalues of one group's diagonal block (attributes as
    :class:`BlockTrace`; ``values`` in the order of the result's; ``residual_bound`` as
    :class:`EigenvalueResult`'s)."""

    name: str
    layer: int | None
    kind: str
    dim: int
    values: list[float]
    residual_bound: float | None = None


@dataclasses.dataclass(frozen=True)
class EigenvalueResult(_Plain):
    """Outcome of :func:`~quotientgeo.hessian_eigenvalues`.

    Attributes:
        values: the ``k`` eigenvalues, largest first (``which="largest"``) or smallest first.
        per_block: with ``per_block=True``, one :class:`BlockEigenvalues` per group.
        loss: the batch-averaged loss at the weights.
        settings: ``k``, ``which``, method, tolerance, seed, geometry, metric, dimension, ...
        products: Hessian-vector products computed.
        wall_time: seconds.
        residual_bound: with ``method="lanczos_lean"``, ``|β_j y_j|``, the residual
            ``‖A x - θ x‖`` of the value's unit Ritz vector: an eigenvalue of the operator lies
            within it of the value; ``None`` for the other methods.
    """

    values: list[float]
    per_block: list[BlockEigenvalues] | None
    loss: float
    settings: dict[str, Any]
    products: int
    wall_time: float
    residual_bound: float | None = None

    def __repr__(self) -> str:
        shown = ", ".join(f"{v:.6g}" for v in self.values)
        bound = "" if self.residual_bound is None else f" ± {self.residual_bound:.3g}"
        return (
            f"EigenvalueResult(values=[{shown}]{bound}, which={self.settings['which']!r}, "
            f"geometry={self.settings['geometry']!r}, products={self.products})"
        )


@dataclasses.dataclass(frozen=True)
class Spectrum(_Plain):
    r"""A spectral density from stochastic Lanczos quadrature.

    Probe ``p`` (a unit vector ``v_p``) gives the Gauss quadrature of its spectral measure
    ``Σ_i (u_iᵀ v_p)² δ(λ - λ_i)``: ``steps`` nodes ``θ_pj`` (Ritz values) and weights
    ``w_pj ≥ 0`` summing to 1, exact for polynomials of degree ``≤ 2·steps - 1``:
    ``Σ_j w_pj θ_pj^k = v_pᵀ A^k v_p``. Their mean over probes estimates the density
    ``φ(λ) = (1/D) Σ_i δ(λ - λ_i)``: ``D · φ`` counts eigenvalues.

    Attributes:
        nodes: ``(probes, steps)`` Ritz values.
        weights: ``(probes, steps)`` quadrature weights.
        dim: ``D``, the operator's size.
    """

    nodes: Tensor
    weights: Tensor
    dim: int

    def moment(self, k: int) -> float:
        """The estimate of ``(1/D) tr(A^k)``: the mean over probes of ``Σ_j w_pj θ_pj^k``."""
        return float((self.weights * self.nodes**k).sum(-1).mean())

    def density(
        self, grid: Tensor | None = None, width: float | None = None, points: int = 512
    ) -> tuple[Tensor, Tensor]:
        """``(grid, φ_σ(grid))``: the density with every node a Gaussian of standard deviation
        ``width`` (default: 1 % of the nodes' range), on ``grid`` (default: ``points`` points
        over the nodes' range widened by ``5·width``); it integrates to 1."""
        lo, hi = float(self.nodes.min()), float(self.nodes.max())
        if width is None:
            width = 0.01 * (hi - lo) if hi > lo else max(abs(hi), 1.0) * 1e-3
        if not width > 0:
            raise ValueError(f"width must be positive, got {width}")
        if grid is None:
            grid = torch.linspace(lo - 5 * width, hi + 5 * width, points, dtype=self.nodes.dtype)
        grid = grid.to(self.nodes.device, self.nodes.dtype)
        gauss = torch.exp(-0.5 * ((grid[:, None, None] - self.nodes) / width) ** 2)
        values = (gauss * self.weights).sum(-1).mean(-1) / (width * math.sqrt(2 * math.pi))
        return grid, values


@dataclasses.dataclass(frozen=True)
class BlockSpectrum(_Plain):
    """The spectral density of one group's diagonal block (attributes as :class:`BlockTrace`)."""

    name: str
    layer: int | None
    kind: str
    dim: int
    spectrum: Spectrum


@dataclasses.dataclass(frozen=True)
class SpectrumResult(_Plain):
    """Outcome of :func:`~quotientgeo.hessian_density`.

    Attributes:
        spectrum: the :class:`Spectrum` of the whole operator.
        per_block: with ``per_block=True``, one :class:`BlockSpectrum` per group.
        loss: the batch-averaged loss at the weights.
        settings: probes, steps, seed, geometry, metric, dimension, ...
        products: Hessian-vector products computed.
        wall_time: seconds.
    """

    spectrum: Spectrum
    per_block: list[BlockSpectrum] | None
    loss: float
    settings: dict[str, Any]
    products: int
    wall_time: float

    def density(
        self, grid: Tensor | None = None, width: float | None = None, points: int = 512
    ) -> tuple[Tensor, Tensor]:
        """:meth:`Spectrum.density` of the whole operator."""
        return self.spectrum.density(grid, width, points)

    def __repr__(self) -> str:
        s = self.spectrum
        return (
            f"SpectrumResult(probes={s.nodes.shape[0]}, steps={s.nodes.shape[1]}, "
            f"range=[{float(s.nodes.min()):.4g}, {float(s.nodes.max()):.4g}], "
            f"geometry={self.settings['geometry']!r}, products={self.products})"
        )
