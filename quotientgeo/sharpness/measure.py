r"""The measures as values: what a measurement is, independent of the model.

:class:`Measure` is the one measure type: a ``name``, :meth:`~Measure.evaluate` (a model, a
loss, batches, the same keywords and ``torch.distributed`` modes for every measure),
:meth:`~Measure.with_rho` and :meth:`~Measure.settings`, and the named constructors. Two
kinds implement it:

- :class:`SharpnessMeasure`, a ball: its radius ``ρ`` and its metric (``norm``), the map that
  moves the symmetry blocks (``perturbation``), the metric and the symmetries of the geometry,
  and the case (worst over the ball by Auto-PGD, or average over its sphere). The public
  functions :func:`~quotientgeo.geodesic_sharpness`, :func:`~quotientgeo.adaptive_sharpness`
  and :func:`~quotientgeo.average_sharpness` build one and evaluate it.
- :class:`RelativeFlatness` (Petzka et al. 2021) of one linear layer: a Hessian measure at one
  point, with no ball; :meth:`~RelativeFlatness.with_rho` returns it unchanged.

Studies, benchmarks, :func:`~quotientgeo.calibrate_rho`, :class:`~quotientgeo.SharpnessTracker`
and the Hugging Face callback take any :class:`Measure`::

    measures = {
        "adaptive": Measure.adaptive(0.1),
        "geodesic_inv": Measure.geodesic(0.1, metric="inv"),
        "relative_flatness": Measure.relative_flatness("head"),
    }
    values = {name: m.evaluate(model, loss_fn, batches).value for name, m in measures.items()}
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import nn

from ..geometry import ParameterGeometry
from ..geometry.symmetries import geometry_of
from ..options import Distributed, Norm, Perturbation, checked_metric, option
from ..validation import integer, positive_int, positive_real, real_in
from .cases import AverageCase, WorstCase
from .flatness import FlatnessResult, relative_flatness
from .result import SharpnessResult
from .run import run

Tensor = torch.Tensor

__all__ = ["Measure", "MeasureResult", "RelativeFlatness", "SharpnessMeasure"]

Case = WorstCase | AverageCase


class MeasureResult(Protocol):
    """What :meth:`Measure.evaluate` returns, whatever the measure: a
    :class:`~quotientgeo.SharpnessResult` or a :class:`~quotientgeo.FlatnessResult`."""

    @property
    def value(self) -> float:
        """The mean over batches of the per-batch value."""
        ...

    @property
    def per_batch(self) -> list[float]:
        """The value of every batch, in (global) batch order."""
        ...

    @property
    def settings(self) -> dict[str, Any]:
        """The measure's settings and the run's (``"measure"``, ``"n_batches"``,
        ``"distributed"``, ``"world_size"``, ...)."""
        ...

    @property
    def wall_time(self) -> float:
        """Seconds."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """Plain ``dict`` of built-in types, ready for :func:`json.dumps`."""
        ...


class Measure(abc.ABC):
    """A measure of a model (module docstring): build one with a named constructor,
    :meth:`geodesic`, :meth:`adaptive`, :meth:`average` or :meth:`relative_flatness`.

    Every measure has the same surface, so code that takes a measure (a tracker, a callback,
    a study's rows) calls it without asking which kind it is.

    Attributes:
        name: what results and tables call it (``"geodesic"``, ``"adaptive"``,
            ``"average"``, ``"relative_flatness"``, or a name of your own).
    """

    name: str

    @abc.abstractmethod
    def evaluate(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], Tensor],
        batches: Iterable,
        *,
        progress: bool = True,
        distributed: Distributed | str = Distributed.AUTO,
        return_perturbation: bool = False,
        compile: bool = False,
    ) -> MeasureResult:
        """Measure ``model``: the mean over ``batches`` of the per-batch value.

        Args:
            model: the network; read only (restored bit-exactly, also on errors and
                ``KeyboardInterrupt``).
            loss_fn: ``loss_fn(model, batch) -> scalar tensor`` (move the batch to the
                model's device inside it if needed).
            batches: any iterable of batches (a list, a ``DataLoader``), iterated once.
            progress: a progress bar, on a terminal (and on rank 0 only).
            distributed: ``"auto"`` (``"split_batch"`` for a model sharded over the ranks,
                ``"batches"`` otherwise), ``"batches"`` (each rank its own batches, every rank
                returns the result over all of them), ``"split_batch"`` (the ``k``-th batches
                of the ranks form one batch) or ``"off"`` (each rank alone) in an initialised
                process group (:mod:`quotientgeo.sharpness.ranks`); nothing without one.
            return_perturbation: worst case only: also return each batch's worst
                perturbation ``ξ*`` in parameter coordinates (``ValueError`` for a measure
                without one).
            compile: run the hot passes by kernels compiled with :func:`torch.compile`
                where the measure has them (worst-case sharpness: the adaptive rest's Gram
                pass and the step, :mod:`quotientgeo.sharpness.fused`); the values agree with the
                eager passes to rounding. A measure without such passes ignores it.
        """

    @abc.abstractmethod
    def with_rho(self, rho: float) -> Measure:
        """This measure on a ball of radius ``rho > 0`` (a new value of the same type; a
        measure that has no ball returns itself)."""

    @abc.abstractmethod
    def settings(self) -> dict[str, Any]:
        """The measure's fields as plain values, as results record them (``"measure"`` is
        :attr:`name`)."""

    # ------------------------------------------------------------------ constructors
    @staticmethod
    def geodesic(
        rho: float,
        *,
        metric: str | float | None = None,
        perturbation: Perturbation | str = Perturbation.DEFAULT,
        norm: Norm | str = Norm.RIEMANNIAN,
        symmetries: str | ParameterGeometry | None = "auto",
        n_iter: int = 100,
        restarts: int = 1,
        seed: int = 0,
        eps: float | None = None,
    ) -> SharpnessMeasure:
        """Worst-case geodesic sharpness ``mean_S max_{||ξ||_x ≤ ρ} L_S(γ_ξ(1)) - L_S(x)``."""
        return SharpnessMeasure(
            name="geodesic",
            rho=rho,
            case=WorstCase(n_iter, restarts),
            perturbation=option(Perturbation, "perturbation", perturbation),
            norm=option(Norm, "norm", norm),
            metric=metric,
            symmetries=symmetries,
            eps=eps,
            seed=seed,
        )

    @staticmethod
    def adaptive(
        rho: float, *, n_iter: int = 100, restarts: int = 1, seed: int = 0
    ) -> SharpnessMeasure:
        """Adaptive sharpness (Andriushchenko et al. 2023):
        ``max_{||ξ ⊙ ŵ⁻¹||₂ ≤ ρ} L(w + ξ) - L(w)``, every parameter in the element-wise
        geometry (``symmetries=None``), straight lines, the same Auto-PGD loop."""
        return SharpnessMeasure(
            name="adaptive",
            rho=rho,
            case=WorstCase(n_iter, restarts),
            perturbation=Perturbation.FIRST_ORDER,
            norm=Norm.ADAPTIVE,
            symmetries=None,
            seed=seed,
        )

    @staticmethod
    def average(
        rho: float,
        *,
        metric: str | float | None = None,
        perturbation: Perturbation | str = Perturbation.DEFAULT,
        norm: Norm | str = Norm.RIEMANNIAN,
        symmetries: str | ParameterGeometry | None = "auto",
        n_samples: int = 100,
        seed: int = 0,
        eps: float | None = None,
    ) -> SharpnessMeasure:
        """Average-case sharpness ``mean_S E_ξ L_S(γ_ξ(1)) - L_S(x)`` over ``||ξ||_x = ρ``."""
        return SharpnessMeasure(
            name="average",
            rho=rho,
            case=AverageCase(n_samples),
            perturbation=option(Perturbation, "perturbation", perturbation),
            norm=option(Norm, "norm", norm),
            metric=metric,
            symmetries=symmetries,
            eps=eps,
            seed=seed,
        )

    @staticmethod
    def relative_flatness(layer: str, *, chunk_size: int = 64) -> RelativeFlatness:
        """Relative flatness (Petzka et al. 2021) of the ``nn.Linear`` named ``layer``
        (:class:`RelativeFlatness`): a measure without a ball."""
        return RelativeFlatness(layer, chunk_size)


@dataclasses.dataclass(frozen=True)
class SharpnessMeasure(Measure):
    """Sharpness in a ball (module docstring): the :class:`Measure` that
    :meth:`Measure.geodesic`, :meth:`Measure.adaptive` and :meth:`Measure.average` build.

    Attributes:
        name: what results and tables call it (``"geodesic"``, ``"adaptive"``,
            ``"average"``, or a name of your own).
        rho: ball radius ``ρ > 0``.
        case: :class:`~quotientgeo.sharpness.cases.WorstCase` (Auto-PGD sizes) or
            :class:`~quotientgeo.sharpness.cases.AverageCase` (samples).
        perturbation: how symmetry blocks move (:class:`~quotientgeo.options.Perturbation`).
        norm: the metric of the ball (:class:`~quotientgeo.options.Norm`).
        metric: ``None`` (each block in the metric it declares), or the metric to declare
            when ``symmetries="auto"``: ``"mix"``, ``"inv"`` or ``s ∈ [0, 1]``. With a
            :class:`~quotientgeo.ParameterGeometry` it must agree with the declared metrics
            (else ``ValueError``: pass ``geometry.with_metric(metric)`` instead).
        symmetries: ``"auto"`` (:func:`~quotientgeo.find_symmetries`), a
            :class:`~quotientgeo.ParameterGeometry` of the model, or ``None`` (every parameter
            adaptive).
        eps: Gram relaxation of the GL kinds (``P + eps·I``); ``None`` keeps the declared.
        seed: seed of the random draws (restarts after the first, average samples), per batch
            ``(seed, batch index)``.
    """

    name: str
    rho: float
    case: Case = dataclasses.field(default_factory=WorstCase)
    perturbation: Perturbation = Perturbation.DEFAULT
    norm: Norm = Norm.RIEMANNIAN
    metric: str | float | None = None
    symmetries: str | ParameterGeometry | None = "auto"
    eps: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        fix = object.__setattr__  # normalise the fields of a frozen value
        fix(self, "rho", positive_real("rho", self.rho))
        fix(self, "perturbation", option(Perturbation, "perturbation", self.perturbation))
        fix(self, "norm", option(Norm, "norm", self.norm))
        fix(self, "metric", checked_metric(self.metric))
        fix(self, "seed", integer("seed", self.seed))
        if self.eps is not None:
            fix(self, "eps", real_in("eps", self.eps, 0.0))
        if not isinstance(self.case, WorstCase | AverageCase):
            raise TypeError(f"case must be a WorstCase or an AverageCase, got {self.case!r}")
        auto = isinstance(self.symmetries, str) and self.symmetries == "auto"
        if not (auto or self.symmetries is None or isinstance(self.symmetries, ParameterGeometry)):
            raise TypeError(
                f"symmetries must be 'auto', None or a ParameterGeometry, got {self.symmetries!r}"
            )

    def with_rho(self, rho: float) -> SharpnessMeasure:
        """This measure on a ball of radius ``rho``."""
        return dataclasses.replace(self, rho=rho)

    def replace(self, **changes: Any) -> SharpnessMeasure:
        """This measure with ``changes`` (field names; ``n_iter``, ``restarts``,
        ``n_samples`` change the case)."""
        case = {k: changes.pop(k) for k in ("n_iter", "restarts", "n_samples") if k in changes}
        if case:
            changes["case"] = dataclasses.replace(changes.get("case", self.case), **case)
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ measuring
    def evaluate(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], Tensor],
        batches: Iterable,
        *,
        progress: bool = True,
        distributed: Distributed | str = Distributed.AUTO,
        return_perturbation: bool = False,
        compile: bool = False,
    ) -> SharpnessResult:
        """Measure ``model``: the mean over ``batches`` of the per-batch value.

        Args:
            model: the network; read only (restored bit-exactly, also on errors and
                ``KeyboardInterrupt``).
            loss_fn: ``loss_fn(model, batch) -> scalar tensor`` (move the batch to the
                model's device inside it if needed).
            batches: any iterable of batches (a list, a ``DataLoader``), iterated once.
            progress: a progress bar, on a terminal (and on rank 0 only).
            distributed: ``"auto"`` (``"split_batch"`` for a model sharded over the ranks,
                ``"batches"`` otherwise), ``"batches"``, ``"split_batch"`` or ``"off"`` in an
                initialised process group (:mod:`quotientgeo.sharpness.ranks`); nothing
                without one.
            return_perturbation: worst case only: also return each batch's worst
                perturbation ``ξ*`` in parameter coordinates.
            compile: take the adaptive rest's Gram pass and the step of every Auto-PGD
                iteration by kernels compiled with :func:`torch.compile`
                (:mod:`quotientgeo.sharpness.fused`; the first iterations compile them, once
                per number of parameters in a call; average sharpness has neither). The
                values agree with the eager passes to rounding.
        """
        if not isinstance(compile, bool):
            raise TypeError(f"compile must be True or False, got {compile!r}")
        geometry = geometry_of(model, self.symmetries, self.metric, eps=self.eps)
        return run(
            model, loss_fn, batches,
            geometry=geometry, case=self.case, rho=self.rho, perturbation=self.perturbation,
            norm=self.norm, seed=self.seed, settings=self.settings(),
            description=f"{self.name} sharpness", progress=progress, distributed=distributed,
            return_perturbation=return_perturbation, compile=compile,
        )  # fmt: skip

    def settings(self) -> dict[str, Any]:
        """The fields as plain values, as results record them."""
        return {
            "measure": self.name,
            "rho": self.rho,
            "metric": self.metric,
            "perturbation": self.perturbation.value,
            "norm": self.norm.value,
            "eps": self.eps,
            "seed": self.seed,
            **self.case.settings(),
        }


@dataclasses.dataclass(frozen=True)
class RelativeFlatness(Measure):
    """Relative flatness (Petzka et al. 2021) of one linear layer as a :class:`Measure`
    (build it with :meth:`Measure.relative_flatness`): :meth:`evaluate` is
    :func:`~quotientgeo.relative_flatness` of the layer :attr:`layer`.

    It is a property of one point, with no ball: no radius, map or case. :meth:`with_rho`
    returns the measure itself, so a grid over ``ρ`` shows it as a constant row, and
    :func:`~quotientgeo.calibrate_rho` refuses it (nothing to calibrate).

    Attributes:
        layer: name of the feature ``nn.Linear`` in ``model.named_modules()``.
        chunk_size: Hessian-vector products per backward pass.
        name: what results and tables call it.
    """

    layer: str
    chunk_size: int = 64
    name: str = "relative_flatness"

    def __post_init__(self) -> None:
        if not isinstance(self.layer, str):
            raise TypeError(f"layer must be the name of an nn.Linear, got {self.layer!r}")
        object.__setattr__(self, "chunk_size", positive_int("chunk_size", self.chunk_size))

    def with_rho(self, rho: float) -> RelativeFlatness:
        """Itself (after checking ``rho > 0``): relative flatness does not depend on a
        radius."""
        positive_real("rho", rho)
        return self

    def evaluate(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], Tensor],
        batches: Iterable,
        *,
        progress: bool = True,
        distributed: Distributed | str = Distributed.AUTO,
        return_perturbation: bool = False,
        compile: bool = False,
    ) -> FlatnessResult:
        """:func:`~quotientgeo.relative_flatness` of ``model``'s layer :attr:`layer`; the
        arguments are :meth:`Measure.evaluate`'s (``return_perturbation=True`` is a
        ``ValueError``: there is no perturbation; ``compile`` changes nothing)."""
        if not isinstance(return_perturbation, bool):
            got = repr(return_perturbation)
            raise TypeError(f"return_perturbation must be True or False, got {got}")
        if return_perturbation:
            raise ValueError("return_perturbation=True needs a worst-case measure")
        return relative_flatness(
            model, loss_fn, batches, layer=self.layer, chunk_size=self.chunk_size,
            progress=progress, distributed=distributed,
        )  # fmt: skip

    def settings(self) -> dict[str, Any]:
        """The fields as plain values."""
        return {"measure": self.name, "layer": self.layer, "chunk_size": self.chunk_size}
