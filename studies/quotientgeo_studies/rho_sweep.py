r"""``quotientgeo reproduce rho-sweep``: how far the second-order map and the integrator go.

Geodesic sharpness with second-order (``x + ξ - ½Γ(ξ, ξ)``) and with exact geodesics across
the radius ``ρ``, for one diagonal network (:mod:`.diagonal`, re-scaling pair declared explicitly)
and one small transformer (:mod:`._vit`), both metrics; the figure shows the relative difference
``|S₂ - S_exact| / |S_exact|`` against ``ρ``.

At each radius the maps are also compared where it matters, at the worst perturbation ``ξ*`` of
the exact measure: per symmetry kind, the relative error ``||y - y_exact|| / ||y_exact - x||`` of
the end point of the second-order map and, on GL kinds, of RK4 with the 10 fixed steps that
``expmap`` took before (``rk4_10``) and with the automatic step count (``rk4_auto``). For the inv
metric ``y_exact`` is the closed form, so the ``rk4_10`` column is the error of the "exact"
numbers measured before the closed form existed; for mix the exact map is itself ``rk4_auto``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from quotientgeo import Measure
from quotientgeo.manifolds import GLQuotient
from quotientgeo.sharpness import SharpnessMeasure

from . import _common as C
from . import _vit, diagonal
from .pipeline import Study, run_study

MAPS = ("second_order", "rk4_10", "rk4_auto")


def map_errors(model, symmetries, metric: str, perturbation: dict) -> dict[str, float]:
    """Largest relative end-point error (over kinds) of each map in :data:`MAPS` against
    ``expmap`` at the tangent vector ``perturbation`` (parameter coordinates), in float64 and
    relative to the kind's whole displacement ``||y_exact - x||`` (heads that ``ξ*`` hardly moves
    would otherwise measure rounding)."""
    geometry = symmetries.with_metric(metric)
    points, _ = geometry.gather(dtype=torch.float64)
    xis, _ = geometry.gather(perturbation, dtype=torch.float64)
    worst: dict[str, float] = dict.fromkeys(MAPS, 0.0)
    for m, x, xi in zip(geometry.manifolds(), points, xis, strict=True):
        exact = m.expmap(x, xi)
        span = torch.linalg.vector_norm(exact - x).clamp_min(1e-300)
        ys: dict[str, torch.Tensor] = {"second_order": m.expmap2(x, xi)}
        if isinstance(m, GLQuotient):
            ys["rk4_10"] = GLQuotient.geodesic(m, x, xi, steps=10)[0]
            ys["rk4_auto"] = GLQuotient.geodesic(m, x, xi)[0]
        for name, y in ys.items():
            err = (torch.linalg.vector_norm(y - exact) / span).item()
            worst[name] = max(worst[name], err)
    return worst


def models(quick: bool, seed: int):
    """``{name: (model, loss_fn, batches, geometry)}`` for the two networks."""
    from quotientgeo import find_symmetries

    cfg = diagonal.TrainingConfig.quick() if quick else diagonal.TrainingConfig()
    cfg = replace(cfg, n_models=1)
    data = diagonal.make_data(cfg, seed)
    hp = diagonal.hyperparameters(1, cfg.n, seed)
    hp["alpha"][:] = 0.1
    t = diagonal.train_population(data, hp, cfg, seed)
    dnet = diagonal.DiagonalNet(t["u"][0], t["v"][0])
    vit, vdata = _vit.small_trained(quick, seed)
    vbatch = [(vdata["x_train"][:128], vdata["y_train"][:128])]
    return {
        "diagonal": (dnet, diagonal.mse, [(data["X"], data["y"])], diagonal.rescale_geometry(dnet)),
        "transformer": (vit, _vit.cross_entropy, vbatch, find_symmetries(vit)),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, "rho-sweep")


# ---------------------------------------------------------------------- the study
@dataclass(frozen=True)
class Config:
    """The radii, the Auto-PGD budget and the seed; both metrics on both networks."""

    quick: bool
    seed: int
    rhos: tuple[float, ...]
    n_iter: int
    metrics: tuple[str, ...] = ("inv", "mix")
    progress: bool = True

    def measures(self, rho: float, geometry) -> dict[str, SharpnessMeasure]:
        """Geodesic sharpness with the second-order map and with the exact geodesic, on
        ``geometry`` (declared in the metric to measure)."""
        return {
            p: Measure.geodesic(
                rho, perturbation=p, symmetries=geometry, n_iter=self.n_iter, seed=self.seed
            )
            for p in ("second_order", "exact")
        }


@dataclass(frozen=True)
class Point:
    """Both values at one (network, metric, ρ) and the end-point errors of the maps at ξ*."""

    network: str
    metric: str
    rho: float
    second_order: float
    exact: float
    map_errors: dict[str, float]

    @property
    def relative_difference(self) -> float:
        return abs(self.second_order - self.exact) / max(abs(self.exact), 1e-300)


def config(args: argparse.Namespace) -> Config:
    rhos = (
        [1e-3, 1e-2, 1e-1] if args.quick else torch.logspace(-3, 0, 7, dtype=torch.float64).tolist()
    )
    n_iter = 3 if args.quick else 20
    return Config(args.quick, args.seed, tuple(rhos), n_iter, progress=not args.no_progress)


@dataclass(frozen=True)
class Records:
    """Every point, in (network, metric, ρ) order, and when collecting started."""

    points: list[Point]
    started: float


@dataclass(frozen=True)
class Analysis:
    """The records and the per-ρ series of :func:`analyse`."""

    records: Records
    results: dict[str, dict[str, dict[str, list[float]]]]


def collect(config: Config, population: C.Population, out: Path) -> Records:
    """Every (network, metric, ρ): both measures, and the map errors at the exact ξ* (one
    process measures everything)."""
    from quotientgeo.progress import progress_bar

    started = time.perf_counter()
    points = []
    with C.threads(1):
        nets = models(config.quick, config.seed)
        jobs = [(n, m, r) for n in nets for m in config.metrics for r in config.rhos]
        bar = progress_bar(jobs, desc="rho sweep", enabled=config.progress, leave=True, lines=True)
        for name, metric, rho in bar:
            model, loss_fn, batches, geometry = nets[name]
            found = {
                p: m.evaluate(
                    model, loss_fn, batches, progress=False, return_perturbation=p == "exact"
                )
                for p, m in config.measures(rho, geometry.with_metric(metric)).items()
            }
            perturbations = found["exact"].perturbations or [{}]
            errors = map_errors(model, geometry, metric, perturbations[0])
            points.append(
                Point(name, metric, rho, found["second_order"].value, found["exact"].value, errors)
            )
    return Records(points, started)


def analyse(config: Config, records: Records) -> Analysis:
    """``{network: {metric: {second_order, exact, relative_difference, map_error_*: [per ρ]}}}``."""
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    for p in records.points:
        entry = results.setdefault(p.network, {}).setdefault(
            p.metric,
            {
                "second_order": [],
                "exact": [],
                "relative_difference": [],
                **{f"map_error_{k}": [] for k in MAPS},
            },
        )
        entry["second_order"].append(p.second_order)
        entry["exact"].append(p.exact)
        entry["relative_difference"].append(p.relative_difference)
        for k in MAPS:
            entry[f"map_error_{k}"].append(p.map_errors[k])
    return Analysis(records, results)


def report(config: Config, analysis: Analysis, out: Path) -> dict[str, Any]:
    """The table, ``rho_sweep.json`` and ``rho_sweep.png``."""
    points, results = analysis.records.points, analysis.results
    rows = [
        [p.network, p.metric, f"{p.rho:.3g}", f"{p.second_order:.4g}", f"{p.exact:.4g}"]
        + [f"{p.relative_difference:.2e}"]
        + [f"{p.map_errors[k]:.1e}" for k in MAPS]
        for p in points
    ]
    C.print_table(
        "Geodesic sharpness: second-order vs exact geodesics; end-point errors of the maps at ξ*",
        ["network", "metric", "ρ", "S second order", "S exact", "rel. diff."]
        + [f"err {k}" for k in MAPS],
        rows,
    )
    rhos = list(config.rhos)
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for name, per_metric in results.items():
        for metric, entry in per_metric.items():
            diff = [max(d, 1e-16) for d in entry["relative_difference"]]
            ax.plot(rhos, diff, marker="o", label=f"{name}, {metric}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ρ")
    ax.set_ylabel("|S₂ - S_exact| / |S_exact|")
    ax.set_title("Second-order vs exact geodesic sharpness")
    ax.legend(fontsize=8)
    C.save_figure(fig, out / "rho_sweep.png")
    payload = {
        "command": "rho-sweep",
        "quick": config.quick,
        "seed": config.seed,
        "rho": rhos,
        "n_iter": config.n_iter,
        "results": results,
        "seconds": time.perf_counter() - analysis.records.started,
    }
    C.write_json(out / "rho_sweep.json", payload)
    print(f"wrote {out / 'rho_sweep.json'} and {out / 'rho_sweep.png'}")
    return payload


STUDY = Study(config, collect, analyse, report)
"""The study (:class:`~.pipeline.Study`): :class:`Config` and this module's functions."""


def run(args: argparse.Namespace) -> int:
    """Second-order vs exact geodesics across ρ: ``config`` → ``collect`` → ``analyse`` →
    ``report`` (one process measures everything)."""
    return run_study(STUDY, args)
