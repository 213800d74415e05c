r"""The curvature rows of the studies' populations: the trace and the top eigenvalue of the
Hessian of every member's loss, in the quotient's Riemannian geometry (invariant) and in the
Euclidean one (what PyHessian reports), ranked against the generalization gap.

A pipeline of its own (:mod:`.pipeline`) that each population study runs beside its sharpness
rows (``--curvature also|only|off``): the study hands over its populations as
:class:`Population` values (its own training or cache; its measurement batches, loss and
symmetries), :func:`collect` measures every member with
:func:`quotientgeo.curvature.hessian_trace` and
:func:`quotientgeo.curvature.hessian_eigenvalues`, :func:`analyse` gives per row Kendall τ-b
with the gap, its bootstrap band, its p-value and the granulated τ and Ψ, :func:`report` prints
the table and writes ``NAME_curvature.json``.

Rows, per geometry ``g`` (each metric of the study's geodesic rows, then ``euclidean``):
``trace_g = tr Hess f`` and ``lambda_max_g = λ_max(Hess f)``, ``f`` the mean loss over the
member's batches. The trace is exact (``D`` products) where the operator has at most
:attr:`Settings.exact_max` coordinates, else Hutchinson's estimate over :attr:`Settings.n_probes`
Rademacher probes; the top eigenvalue is Lanczos' (``scipy.sparse.linalg.eigsh``). A figure
whose computation raises (an ill-conditioned Gram matrix, Lanczos without convergence) is NaN
and a failure, left out of τ.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from . import _common as C
from .pipeline import Study

__all__ = [
    "CHOICES",
    "Config",
    "Population",
    "Settings",
    "add_argument",
    "analyse",
    "collect",
    "measure_member",
    "report",
    "rows",
    "studies",
]

CHOICES = ("also", "only", "off")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The estimators' settings (the protocol's; ``--quick`` takes fewer probes)."""

    exact_max: int = 1024  # operators up to this size get the exact trace
    n_probes: int = 64
    chunk_size: int = 16
    tol: float = 1e-3
    max_iter: int = 50

    @classmethod
    def quick(cls) -> Settings:
        return cls(exact_max=128, n_probes=8, chunk_size=8)


@dataclasses.dataclass(frozen=True)
class Population:
    """What the curvature rows need of one population of a study.

    ``model_of(k)`` and ``batches_of(k)`` give member ``k`` (a model this function may own) and
    its measurement batches; ``gaps`` and ``keys`` (its axes and seed, for the granulated τ)
    every member's; ``skip`` the members left out (diverged). ``symmetries(model, metric)`` is
    the ``symmetries`` argument of the Riemannian rows in ``metric`` (``"auto"``, or a
    declared :class:`~quotientgeo.ParameterGeometry`); ``context(model)`` what the model is
    measured under (e.g. a scope of trainable parameters)."""

    name: str
    model_of: Callable[[int], nn.Module]
    batches_of: Callable[[int], list]
    loss_fn: Callable[[nn.Module, Any], Any]
    gaps: list[float]
    keys: list[dict[str, Hashable]]
    axes: tuple[str, ...]
    metrics: tuple[str, ...]
    symmetries: Callable[[nn.Module, str], Any] = lambda model, metric: "auto"
    eps: Any = None
    context: Callable[[nn.Module], Any] = lambda model: contextlib.nullcontext(model)
    skip: frozenset[int] = frozenset()


def rows(metrics: Sequence[str]) -> list[str]:
    """The rows of the geometries ``metrics`` and Euclidean: every trace, then every top
    eigenvalue."""
    geometries = [*metrics, "euclidean"]
    return [f"trace_{g}" for g in geometries] + [f"lambda_max_{g}" for g in geometries]


def measure_member(
    population: Population, k: int, settings: Settings, seed: int
) -> tuple[dict[str, float], dict[str, str], list[str]]:
    """``(values, methods, failures)`` of member ``k``: every row (NaN where it raised), the
    trace's method per geometry, and the failures' messages."""
    from quotientgeo.curvature import hessian_eigenvalues, hessian_trace

    model, batches = population.model_of(k), population.batches_of(k)
    values: dict[str, float] = {}
    methods: dict[str, str] = {}
    failures: list[str] = []
    with population.context(model):
        dim = sum(p.numel() for p in model.parameters() if p.requires_grad)
        method = "exact" if dim <= settings.exact_max else "hutchinson"
        for g in [*population.metrics, "euclidean"]:
            if g == "euclidean":
                where: dict[str, Any] = {"symmetries": None, "geometry": "euclidean"}
            else:
                symmetries = population.symmetries(model, g)
                declared = not isinstance(symmetries, str)  # a geometry carries its metric
                metric = None if declared else g
                where = {"symmetries": symmetries, "metric": metric, "eps": population.eps}
            common = {**where, "progress": False}
            methods[g] = method
            try:
                trace = hessian_trace(
                    model, population.loss_fn, batches, method=method,
                    n_probes=settings.n_probes, chunk_size=settings.chunk_size, seed=seed,
                    **common,
                )  # fmt: skip
                values[f"trace_{g}"] = trace.value
            except (ValueError, RuntimeError) as err:
                values[f"trace_{g}"] = math.nan
                failures.append(f"member {k}, trace_{g}: {err}")
            try:
                top = hessian_eigenvalues(
                    model, population.loss_fn, batches, k=1, method="lanczos",
                    tol=settings.tol, max_iter=settings.max_iter, seed=seed, **common,
                )  # fmt: skip
                values[f"lambda_max_{g}"] = top.values[0]
            except (ValueError, RuntimeError) as err:  # scipy's ArpackNoConvergence included
                values[f"lambda_max_{g}"] = math.nan
                failures.append(f"member {k}, lambda_max_{g}: {err}")
    return values, methods, failures


@dataclasses.dataclass(frozen=True)
class Config:
    """The curvature rows of study ``study``: its own config ``base``, from which
    ``populations(base, population, out)`` builds the :class:`Population` values."""

    study: str
    base: Any
    populations: Callable[[Any, C.Population, Path], list[Population]]
    settings: Settings
    seed: int
    resamples: int
    progress: bool = True

    @classmethod
    def of_study(cls, study: str, base: Any, populations: Callable[..., list[Population]]):
        """The rows of ``study`` from its config ``base`` (its seed, bootstrap resamples,
        progress and quick mode, which takes :meth:`Settings.quick`)."""
        return cls(
            study=study,
            base=base,
            populations=populations,
            settings=Settings.quick() if base.quick else Settings(),
            seed=base.seed,
            resamples=base.size.resamples,
            progress=base.progress,
        )


@dataclasses.dataclass(frozen=True)
class PopulationRecords:
    name: str
    axes: tuple[str, ...]
    rows: list[str]
    gaps: list[float]
    keys: list[dict[str, Hashable]]
    values: list[dict[str, float]]  # per member (NaN for a skipped one)
    methods: dict[str, str]  # trace method per geometry (of the first member measured)
    failures: list[str]
    seconds: float


@dataclasses.dataclass(frozen=True)
class Records:
    populations: list[PopulationRecords]
    ranks: int
    started: float


def collect(config: Config, population: C.Population, out: Path) -> Records:
    """Every population's members measured (split over the ranks), each phase a progress bar
    (or its start and end lines in a log)."""
    started = time.perf_counter()
    show = config.progress and population.is_reporter
    found = []
    for pop in config.populations(config.base, population, out):
        tick, n = time.perf_counter(), len(pop.gaps)

        def one(k: int, pop: Population = pop):
            if k in pop.skip:
                return {row: math.nan for row in rows(pop.metrics)}, {}, [f"member {k} skipped"]
            return measure_member(pop, k, config.settings, config.seed)

        share = len(population.mine(n))
        with C.counter(f"curvature ({pop.name}, models)", share, enabled=show) as bar:
            measured = population.map(one, list(range(n)), bar=bar)
        methods = next((m for _, m, _ in measured if m), {})
        found.append(
            PopulationRecords(
                name=pop.name,
                axes=pop.axes,
                rows=rows(pop.metrics),
                gaps=list(pop.gaps),
                keys=list(pop.keys),
                values=[v for v, _, _ in measured],
                methods=methods,
                failures=[f for _, _, fs in measured for f in fs],
                seconds=time.perf_counter() - tick,
            )
        )
    return Records(found, population.world, started)


@dataclasses.dataclass(frozen=True)
class RowStatistics:
    """One row's statistics: τ-b with the gap, its 90 % bootstrap band and p-value, the median
    value, how many members it ranks, and the granulated τ per axis and ``"psi"`` (``None``
    where the population is not a grid)."""

    tau: float
    band: tuple[float, float]
    p_value: float
    median: float
    n: int
    granulated: dict[str, float] | None


@dataclasses.dataclass(frozen=True)
class Analysis:
    records: Records
    statistics: dict[str, dict[str, RowStatistics]]  # population -> row -> statistics


def row_statistics(
    values: list[float], records: PopulationRecords, resamples: int, seed: int
) -> RowStatistics:
    """The statistics of one row (:class:`RowStatistics`)."""
    import statistics

    gaps = records.gaps
    finite = [v for v, g in zip(values, gaps, strict=True) if math.isfinite(v) and math.isfinite(g)]
    if len(finite) < 3 or len(set(finite)) < 2:
        nan = math.nan
        return RowStatistics(nan, (nan, nan), nan, nan, len(finite), None)
    tau, p = C.kendall(values, gaps)
    band = C.kendall_interval(values, gaps, resamples=resamples, seed=seed)
    granulated = None
    if records.axes:
        granulated = C.granulated_tau(values, gaps, records.keys, records.axes)
    return RowStatistics(tau, band, p, statistics.median(finite), len(finite), granulated)


def analyse(config: Config, records: Records) -> Analysis:
    """Every row's statistics in every population."""
    return Analysis(
        records,
        {
            r.name: {
                row: row_statistics([v[row] for v in r.values], r, config.resamples, config.seed)
                for row in r.rows
            }
            for r in records.populations
        },
    )


def _f(x: float, spec: str) -> str:
    return "—" if not math.isfinite(x) else format(x, spec)


def print_population(r: PopulationRecords, stats: dict[str, RowStatistics]) -> None:
    """The population's curvature table: τ [band], p, Ψ and its axes, the median figure."""
    methods = ", ".join(f"{g}: {m}" for g, m in r.methods.items())
    C.print_table(
        f"{r.name}: curvature rows, Kendall τ with the gap [90 % bootstrap band] "
        f"({len(r.gaps)} members; trace {methods}; λ_max by Lanczos)",
        ["row", "n", "τ [band]", "p", *(f"τ|{a}" for a in r.axes), "Ψ", "median"],
        [
            [
                row,
                s.n,
                f"{_f(s.tau, '+.2f')} [{_f(s.band[0], '+.2f')}, {_f(s.band[1], '+.2f')}]",
                _f(s.p_value, ".1e"),
                *(_f(s.granulated[a], "+.3f") if s.granulated else "—" for a in r.axes),
                _f(s.granulated["psi"], "+.3f") if s.granulated else "—",
                _f(s.median, ".4g"),
            ]
            for row, s in stats.items()
        ],
    )
    if r.failures:
        print(f"{len(r.failures)} figure(s) failed (NaN, left out); first: {r.failures[0]}")


def _none(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _none(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_none(v) for v in x]
    if isinstance(x, float):
        return C.finite_or_none(x)
    return x


def payload(config: Config, analysis: Analysis) -> dict[str, Any]:
    """``NAME_curvature.json``: the settings, and per population the statistics of every row
    and every member's figures."""
    out: dict[str, Any] = {}
    for r in analysis.records.populations:
        stats = analysis.statistics[r.name]
        out[r.name] = {
            "axes": list(r.axes),
            "rows": r.rows,
            "trace_method": r.methods,
            "kendall_tau": {row: _none(s.tau) for row, s in stats.items()},
            "tau_interval": {row: _none(list(s.band)) for row, s in stats.items()},
            "p_value": {row: _none(s.p_value) for row, s in stats.items()},
            "n_ranked": {row: s.n for row, s in stats.items()},
            "granulated_tau": {row: _none(s.granulated) for row, s in stats.items()},
            "median": {row: _none(s.median) for row, s in stats.items()},
            "failures": r.failures,
            "seconds": r.seconds,
            "members": [
                {**_none(dict(key)), "gap": _none(gap), **_none(values)}
                for key, gap, values in zip(r.keys, r.gaps, r.values, strict=True)
            ],
        }
    return {
        "command": f"{config.study} --curvature",
        "seed": config.seed,
        "ranks": analysis.records.ranks,
        "settings": dataclasses.asdict(config.settings),
        "resamples": config.resamples,
        "populations": out,
        "seconds": {"total": time.perf_counter() - analysis.records.started},
    }


def report(config: Config, analysis: Analysis, out: Path) -> dict[str, Any]:
    """Print every population's curvature table and write ``NAME_curvature.json``."""
    for r in analysis.records.populations:
        print_population(r, analysis.statistics[r.name])
    data = payload(config, analysis)
    path = C.write_json(out / f"{config.study}_curvature.json", data)
    print(f"wrote {path}")
    return data


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--curvature also|only|off``."""
    parser.add_argument(
        "--curvature",
        choices=CHOICES,
        default="also",
        help="the curvature rows (Hessian trace and top eigenvalue, invariant and Euclidean): "
        "after the sharpness rows (also, default), alone on the trained or cached members "
        "(only), or not (off)",
    )


def studies(
    sharpness: Study, build: Callable[[argparse.Namespace], Config], args: argparse.Namespace
) -> list[Study]:
    """The studies ``--curvature`` asks for: the sharpness study, the curvature rows (built by
    ``build(args)``), or both in that order."""
    choice = getattr(args, "curvature", "off")
    curvature = Study(build, collect, analyse, report)
    return {"also": [sharpness, curvature], "only": [curvature], "off": [sharpness]}[choice]
