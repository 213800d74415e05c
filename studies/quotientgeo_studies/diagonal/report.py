"""The diagonal study's report: per population the gap spread, the τ(ρ) and granulated-τ
tables, then ``diagonal.json`` and the figures (:mod:`.figures`)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from .. import _common as C
from .analyse import Analysis, PopulationAnalysis
from .config import PAPER_TAU, Config
from .figures import figures, key

DESIGN = {
    "init": "initialisation scale α on a log grid in random order, learning-rate factor and "
    "batch size drawn at random; one batch order",
    "sgd": "one initialisation scale; learning-rate factor × batch size × batch-order seed grid",
}
RADIUS_RULE = (
    "per population, each ball calibrated with quotientgeo.calibrate_rho on the reference "
    "member (index len(members) // 2) to a loss increase of target_fraction times the mean "
    "square of the training labels; rho = factor * rho1 on grid_factors"
)
NOISE = (
    "noise_scale: mean over members of the standard error of the test MSE, "
    "std_i(e_i) / sqrt(n_test) over the per-sample squared errors e_i; "
    "gap_spread_over_noise = std of the gaps over members / noise_scale"
)
NOT_A_GRID = (
    "not defined: the hyperparameters are random draws, so no two members agree on every "
    "axis but one"
)


def _none(x):
    """A float, or ``None`` when it is not finite (JSON), inside dicts, lists and tuples."""
    if isinstance(x, dict):
        return {k: _none(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_none(v) for v in x]
    return None if x is None else C.finite_or_none(x)


def print_population(config: Config, a: PopulationAnalysis) -> None:
    """The gap spread line, the τ(ρ) table with bands, p-values and the granulated τ."""
    r, grid = a.records, config.size.grid
    print(
        f"\npopulation {r.name}: {len(r.members)} networks ({r.n_converged}/{r.n_models} reached "
        f"the training loss target); gap from {min(a.gap):.3g} to {max(a.gap):.3g}, std "
        f"{a.gap_std:.3g}; noise scale (mean SE of a test loss) {a.noise:.3g}; gap spread over "
        f"noise {a.gap_spread_over_noise:.3g}"
    )
    C.print_table(
        f"{r.name}: Kendall τ with the gap [90 % bootstrap band] at ρ = f·ρ₁ (ρ₁ on member "
        f"{r.reference}: loss increase {r.target:.3g})",
        ["measure", "ρ₁", *(f"f = {f:.3g}" for f in grid)],
        [
            [
                row,
                f"{r.rho1[config.ball[row]]:.3g}",
                *(
                    f"{a.tau[row][i]:+.2f} [{a.band[row][i][0]:+.2f}, {a.band[row][i][1]:+.2f}]"
                    for i in range(len(grid))
                ),
            ]
            for row in config.measures
        ],
    )
    C.print_table(
        f"{r.name}: p-values of τ; median sharpness; median curvature share (S₂ - S₁)/S₂",
        ["measure", *(f"f = {f:.3g}" for f in grid)],
        [
            [
                row,
                *(
                    f"p {a.p_value[row][i]:.1e}; S {a.median[row][i]:.3g}"
                    + (f"; share {a.share[row][i]:.2f}" if row in a.share else "")
                    for i in range(len(grid))
                ),
            ]
            for row in config.measures
        ],
    )
    if a.granulated is None:
        print(f"{r.name}: granulated τ {NOT_A_GRID}")
    else:
        h = a.headline
        C.print_table(
            f"{r.name}: granulated Kendall τ at ρ = ρ₁ (per axis: mean τ within groups that "
            "differ only in it; Ψ: their mean)",
            ["measure", *r.axes, "Ψ"],
            [
                [row, *(a.granulated[row][h][axis] for axis in (*r.axes, "psi"))]
                for row in config.measures
            ],
        )
    if r.failures:
        print(f"{len(r.failures)} measurement(s) failed (NaN, left out); first: {r.failures[0]}")


def population_payload(config: Config, a: PopulationAnalysis) -> dict[str, Any]:
    """One population's part of ``diagonal.json``."""
    r, h, rows = a.records, a.headline, config.measures

    def by_rho(row: str, series) -> dict[str, Any]:
        return {key(rho): _none(v) for rho, v in zip(a.rho_grid[row], series, strict=True)}

    models = [
        {
            **{
                k: v for k, v in dataclasses.asdict(m).items() if k not in ("values", "first_order")
            },
            "gap": m.gap,
            **{row: C.finite_or_none(m.values[row][h]) for row in rows},
            "grid": _none(m.values),
            "grid_first_order": _none(m.first_order),
        }
        for m in r.members
    ]
    granulated = None if a.granulated is None else {row: a.granulated[row][h] for row in rows}
    return {
        "design": DESIGN[r.name],
        "axes": list(r.axes),
        "n_models": r.n_models,
        "n_converged": r.n_converged,
        "n_diverged": r.n_models - len(r.members),
        "reference_member": r.reference,
        "target_loss_increase": r.target,
        "calibration": {row: dataclasses.asdict(c) for row, c in r.calibration.items()},
        "grid_factors": list(config.size.grid),
        "rho_grid": a.rho_grid,
        "gap_std": a.gap_std,
        "noise_scale": a.noise,
        "gap_spread_over_noise": a.gap_spread_over_noise,
        "kendall_tau": {row: C.finite_or_none(a.tau[row][h]) for row in rows},
        "p_value": {row: C.finite_or_none(a.p_value[row][h]) for row in rows},
        "tau_interval": {row: _none(a.band[row][h]) for row in rows},
        "tau_by_rho": {row: by_rho(row, a.tau[row]) for row in rows},
        "tau_interval_by_rho": {row: by_rho(row, a.band[row]) for row in rows},
        "p_value_by_rho": {row: by_rho(row, a.p_value[row]) for row in rows},
        "median_sharpness_by_rho": {row: by_rho(row, a.median[row]) for row in rows},
        "curvature_share_by_rho": {row: by_rho(row, a.share[row]) for row in a.share},
        "granulated_tau": _none(granulated),
        "granulated_tau_note": NOT_A_GRID if granulated is None else None,
        "granulated_tau_by_rho": None
        if a.granulated is None
        else {row: by_rho(row, a.granulated[row]) for row in rows},
        "failures": r.failures,
        "seconds": r.seconds,
        "models": models,
    }


def payload(config: Config, analysis: Analysis) -> dict[str, Any]:
    """``diagonal.json`` (its fields: ``docs/reproductions.md``)."""
    records, pops = analysis.records, analysis.populations
    parts = {name: population_payload(config, a) for name, a in pops.items()}
    size = config.size
    return {
        "command": "diagonal",
        "quick": config.quick,
        "seed": config.seed,
        "ranks": records.ranks,
        "config": dataclasses.asdict(size),
        "radius_rule": RADIUS_RULE,
        "noise_definition": NOISE,
        # each row's settings but its radius (rho_grid of each population)
        "measures": {
            row: {k: v for k, v in m.settings().items() if k != "rho"}
            for row, m in config.measures.items()
        },
        "ball": config.ball,
        "kendall_tau": {name: p["kendall_tau"] for name, p in parts.items()},
        "p_value": {name: p["p_value"] for name, p in parts.items()},
        "gap_spread_over_noise": {name: p["gap_spread_over_noise"] for name, p in parts.items()},
        "paper_kendall_tau": PAPER_TAU,
        "populations": parts,
        "seconds": {"total": time.perf_counter() - records.started},
    }


def report(config: Config, analysis: Analysis, out: Path) -> dict[str, Any]:
    """Print every population's tables, write ``diagonal.json``, ``diagonal.png`` and
    ``diagonal_tau_by_rho.png``; returns the JSON payload."""
    for a in analysis.populations.values():
        print_population(config, a)
    print("paper (Table 1, row 1): " + ", ".join(f"{k} {v:+.2f}" for k, v in PAPER_TAU.items()))
    data = payload(config, analysis)
    C.write_json(out / "diagonal.json", data)
    figures(data, out)
    print(
        f"wrote {out / 'diagonal.json'}, {out / 'diagonal.png'}, {out / 'diagonal_tau_by_rho.png'}"
    )
    return data
