r"""``quotientgeo reproduce invariance``: sharpness along symmetry orbits (paper Figure 7).

A small transformer classifier (:class:`._vit.DigitsViT`, float64, trained briefly on digits) is
re-parametrised on every attention head: each QK and VO pair ``(G, H)`` found by
:func:`quotientgeo.find_symmetries` is mapped to ``(G A⁻¹, H Aᵀ)`` with
``A = a·U diag(σ) Vᵀ`` (Haar-random ``U``, ``V``, ``σ`` log-uniform with ``cond(A) ≤ 100``, one
per head), through the geometry's own gather/act/scatter, for ``a`` from ``1e-2`` to ``1e2``.
The network's outputs do not change; we report the ratio of sharpness after/before for
adaptive sharpness and geodesic sharpness (inv, mix).

A :class:`~.pipeline.Study`: :class:`Config` (the measures as :class:`~quotientgeo.Measure`
values), :func:`collect` (one :class:`Point` per scale, split over the ranks of a ``torchrun``
launch), :func:`analyse` (the ratios) and :func:`report` (table, ``invariance.json`` and
``invariance.png``).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from quotientgeo import Measure

from . import _common as C
from . import _vit
from .pipeline import Study, run_study

CONDITION = 100.0  # of the group elements: a strong move that float64 resolves

QUICK_SCALES = (1e-2, 1e-1, 1.0, 1e1, 1e2)


def measures(rho: float, n_iter: int, seed: int) -> dict[str, Measure]:
    """Adaptive sharpness and second-order geodesic sharpness in the inv and mix metrics."""
    geodesic = Measure.geodesic(rho, perturbation="second_order", n_iter=n_iter, seed=seed)
    return {
        "adaptive": Measure.adaptive(rho, n_iter=n_iter, seed=seed),
        "geodesic_inv": geodesic.replace(metric="inv"),
        "geodesic_mix": geodesic.replace(metric="mix"),
    }


@dataclasses.dataclass(frozen=True)
class Config:
    """The study's settings: orbit scales ``a`` and the measures at radius ``rho``."""

    quick: bool
    seed: int
    rho: float
    n_iter: int
    scales: tuple[float, ...]
    measures: dict[str, Measure]
    progress: bool = True


@dataclasses.dataclass(frozen=True)
class Point:
    """Sharpness of the model moved by ``A = a·U diag(σ) Vᵀ`` on every head (``scale = a``;
    ``None``: the model as trained) and the largest change of its outputs relative to the
    trained model's."""

    scale: float | None
    output_change: float
    sharpness: dict[str, float]


@dataclasses.dataclass(frozen=True)
class Records:
    """The trained model's :class:`Point`, then one per scale; ``started``: when collecting
    began (``time.perf_counter()``)."""

    base: Point
    moved: list[Point]
    started: float


@dataclasses.dataclass(frozen=True)
class Analysis:
    """Sharpness after / before per measure and scale, and the largest deviations from 1."""

    records: Records
    ratios: dict[str, list[float]]
    max_relative_deviation: dict[str, float]
    max_output_change: float


def reparametrize(model, a: float, seed: int):
    """A copy of ``model`` with every head's GL pair acted on by ``A = a·U diag(σ) Vᵀ``
    (Haar ``U``, ``V``; ``cond(A) ≤`` :data:`CONDITION`)."""
    from quotientgeo.testing import moved_along_orbits

    return moved_along_orbits(model, scale=a, seed=seed, condition=CONDITION)


def config(args: argparse.Namespace) -> Config:
    n_iter = 3 if args.quick else 20
    scales = QUICK_SCALES if args.quick else torch.logspace(-2, 2, 9, dtype=torch.float64).tolist()
    return Config(
        quick=args.quick,
        seed=args.seed,
        rho=args.rho,
        n_iter=n_iter,
        scales=tuple(scales),
        measures=measures(args.rho, n_iter, args.seed),
        progress=not args.no_progress,
    )


def collect(config: Config, population: C.Population, out: Path) -> Records:
    """Train the model (float64), then measure it and each re-parametrised copy on its first
    128 training digits; the scales are split over the ranks."""
    started = time.perf_counter()
    with C.threads(1):
        model, data = _vit.small_trained(config.quick, config.seed)
        model = model.double()
        x, y = data["x_train"][:128].double(), data["y_train"][:128]
        batches = [(x, y)]
        with torch.no_grad():
            logits = model(x)

        def point(scale: float | None) -> Point:
            moved = model if scale is None else reparametrize(model, scale, config.seed + 1)
            with torch.no_grad():
                change = (moved(x) - logits).abs().max() / logits.abs().max()
            values = {
                name: m.evaluate(
                    moved, _vit.cross_entropy, batches, progress=False, distributed="off"
                ).value
                for name, m in config.measures.items()
            }
            return Point(scale, float(change), values)

        enabled = config.progress and population.is_reporter
        items = [None, *config.scales]
        with C.counter("orbit scales", len(population.mine(len(items))), enabled=enabled) as bar:
            base, *moved = population.map(point, items, bar=bar)
    return Records(base, moved, started)


def analyse(config: Config, records: Records) -> Analysis:
    base = records.base.sharpness
    ratios = {k: [p.sharpness[k] / base[k] for p in records.moved] for k in config.measures}
    return Analysis(
        records=records,
        ratios=ratios,
        max_relative_deviation={k: max(abs(r - 1) for r in v) for k, v in ratios.items()},
        max_output_change=max(p.output_change for p in records.moved),
    )


def figure(config: Config, analysis: Analysis, path: Path) -> Path:
    """Sharpness after / before against ``a``, one line per measure."""
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for k in config.measures:
        ax.plot(config.scales, analysis.ratios[k], marker="o", label=k.replace("_", " "))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("a  (A = a·U diag(σ) Vᵀ on every head)")
    ax.set_ylabel("sharpness after / before")
    ax.legend()
    ax.set_title("Invariance along symmetry orbits")
    return C.save_figure(fig, path)


def report(config: Config, analysis: Analysis, out: Path) -> dict[str, Any]:
    """Print the ratios, write ``invariance.json`` and ``invariance.png``."""
    moved = analysis.records.moved
    C.print_table(
        f"Sharpness after / before moving every head by A = a·U diag(σ) Vᵀ (ρ = {config.rho})",
        ["a", "max |Δ output| (rel.)", *config.measures],
        [
            [f"{p.scale:.3g}", f"{p.output_change:.1e}"]
            + [f"{analysis.ratios[k][i]:.6g}" for k in config.measures]
            for i, p in enumerate(moved)
        ],
    )
    figure(config, analysis, out / "invariance.png")
    payload = {
        "command": "invariance",
        "quick": config.quick,
        "seed": config.seed,
        "rho": config.rho,
        "n_iter": config.n_iter,
        "scales": list(config.scales),
        "base_sharpness": analysis.records.base.sharpness,
        "ratio": analysis.ratios,
        "max_relative_deviation": analysis.max_relative_deviation,
        "max_output_change": analysis.max_output_change,
        "seconds": time.perf_counter() - analysis.records.started,
    }
    C.write_json(out / "invariance.json", payload)
    print(f"wrote {out / 'invariance.json'} and {out / 'invariance.png'}")
    return payload


STUDY = Study(config, collect, analyse, report)
"""The study (:class:`~.pipeline.Study`): :class:`Config` and this module's functions."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, "invariance")
    parser.add_argument("--rho", type=float, default=0.1, help="ball radius (0.1)")


def run(args: argparse.Namespace) -> int:
    """Sharpness along symmetry orbits (Fig. 7): after/before ratio for ``A = a·U diag(σ) Vᵀ``."""
    return run_study(STUDY, args)
