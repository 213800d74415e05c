"""The transformers study's report: the τ(ρ) and ablation tables, ``transformers.json`` and the
figures (:mod:`.figures`)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from .. import _common as C
from .analyse import Analysis
from .config import MEASURES, PAPER, Config
from .figures import figures, key

HOW = {
    "fixed": "fixed before any τ: the radius where each measure reaches the target on member 0",
    "best": "the grid factor with the largest mean |τ| of geodesic inv and mix",
}


def print_grid(config: Config, a: Analysis) -> None:
    """τ, its band, median sharpness and curvature share at every grid factor."""
    size = config.size
    C.print_table(
        f"Kendall τ with the gap across ρ ({size.n_models} fine-tuned ViTs, {size.n_iter} "
        f"Auto-PGD iterations, {size.n_batches}×{size.batch} training samples; ρ₁: "
        f"{config.target:g} nat on member 0; τ [90 % bootstrap interval]; curvature share "
        "(S₂ - S₁)/S₂, median)",
        [
            "ρ/ρ₁",
            *(f"{m} ρ" for m in MEASURES),
            *(f"τ {m}" for m in MEASURES),
            "median S adaptive / inv / mix",
            "share inv / mix",
        ],
        [
            [
                f"{f:.3g}",
                *(f"{a.rho_grid[m][i]:.3g}" for m in MEASURES),
                *(
                    f"{a.tau[m][i]:+.2f} [{a.band[m][i][0]:+.2f}, {a.band[m][i][1]:+.2f}]"
                    for m in MEASURES
                ),
                " / ".join(f"{a.median[m][i]:.3g}" for m in MEASURES),
                " / ".join(f"{a.share[m][i]:.2f}" for m in a.share),
            ]
            for i, f in enumerate(size.grid)
        ],
    )


def print_granulated(config: Config, a: Analysis) -> None:
    """The granulated τ per axis and Ψ of every row at the fixed radius and of the τ(ρ)
    measures at every grid factor (grid population only)."""
    if not config.axes:
        return
    axes = [*config.axes, "psi"]
    C.print_table(
        f"Granulated Kendall τ (Jiang et al. 2020) at f = {a.radii['fixed']:.3g}: τ within groups "
        "that differ only in one axis (same seed), averaged; Ψ = mean over the axes",
        ["row", *axes],
        [[row, *(a.granulated[row][x] for x in axes)] for row in config.measures],
    )
    C.print_table(
        "Ψ across ρ",
        ["ρ/ρ₁", *MEASURES],
        [
            [f"{f:.3g}", *(a.granulated_by_rho[m][i]["psi"] for m in MEASURES)]
            for i, f in enumerate(config.size.grid)
        ],
    )


def print_ablations(config: Config, a: Analysis) -> None:
    """The ablation rows' τ, band and p-value at each radius, the paper's numbers, failures,
    gaps and their spread over test-set noise."""
    headers, names = ["row"], list(a.radii)
    for name in names:
        headers += [f"ρ {name}", f"τ {name} [90 % band]", "p"]
    C.print_table(
        "Ablations (Kendall τ with the gap; p-value): "
        + ", ".join(f"{name} radius f = {f:.3g}" for name, f in a.radii.items())
        + " (ρ = f·ρ₁ of the row's ball; relative flatness has none)",
        headers,
        [
            [
                row,
                *(
                    cell
                    for name in names
                    for cell in (
                        f"{a.rho[name][row]:.3g}",
                        f"{a.kendall[name][row][0]:+.3f} [{a.interval[name][row][0]:+.2f}, "
                        f"{a.interval[name][row][1]:+.2f}]",
                        f"{a.kendall[name][row][1]:.1e}",
                    )
                ),
            ]
            for row in config.measures
        ],
    )
    print(
        "paper (Table 1): "
        + "; ".join(
            f"{task}: " + ", ".join(f"{m} {t:+.2f}" for m, t in v.items())
            for task, v in PAPER.items()
        )
    )
    if a.failures:
        print(
            f"{len(a.failures)} measurement(s) failed (NaN, left out of τ); first: {a.failures[0]}"
        )
    cached = sum(member.metrics["cached"] for member in a.records.members)
    print(
        f"gaps from {min(a.gap):.3f} to {max(a.gap):.3f}, spread over test-set noise "
        f"{a.gap_spread_over_noise:.2f}; {cached}/{config.size.n_models} models from the cache"
    )


def model_records(config: Config, a: Analysis) -> list[dict[str, Any]]:
    """One JSON record per member: recipe, errors, values at the fixed radius, on the grid
    (and their first-order values) and of every ablation row at both radii."""
    out = []
    for k, member in enumerate(a.records.members):
        grid = {m: a.grid[m][k] for m in MEASURES}
        out.append(
            {
                **dataclasses.asdict(member.recipe),
                **member.metrics,
                **{m: C.finite_or_none(a.at["fixed"][m][k]) for m in MEASURES},
                "grid": {m: [C.finite_or_none(c.value) for c in g] for m, g in grid.items()},
                "grid_first_order": {
                    m: [C.finite_or_none(c.first_order_value) for c in g] for m, g in grid.items()
                },
                "ablations": {
                    name: {row: C.finite_or_none(values[k]) for row, values in rows.items()}
                    for name, rows in a.at.items()
                },
            }
        )
    return out


def payload(config: Config, a: Analysis) -> dict[str, Any]:
    """``transformers.json`` (its fields: ``docs/reproductions.md``)."""
    size, records = config.size, a.records

    def by_rho(m: str, series) -> dict[str, Any]:
        return {key(r): C.finite_or_none(v) for r, v in zip(a.rho_grid[m], series, strict=True)}

    def taus(name: str, i: int) -> dict[str, Any]:
        return {row: C.finite_or_none(t[i]) for row, t in a.kendall[name].items()}

    def finite(tree: dict[str, float]) -> dict[str, Any]:
        return {k: C.finite_or_none(v) for k, v in tree.items()}

    best = {}
    if "best" in a.radii:
        best = {"kendall_tau_best": taus("best", 0), "p_value_best": taus("best", 1)}
    return {
        "command": "transformers",
        "population": config.population,
        "grid_recipe": None if config.recipe is None else dataclasses.asdict(config.recipe),
        "axes": list(config.axes),
        "gap_spread_over_noise": C.finite_or_none(a.gap_spread_over_noise),
        "n_test": a.records.members[0].metrics["n_test"],
        "quick": config.quick,
        "seed": config.seed,
        "n_models": size.n_models,
        "n_iter": size.n_iter,
        "sharpness_samples": size.n_batches * size.batch,
        "sharpness_batches": size.n_batches,
        "target_nats": config.target,
        "calibration": {row: dataclasses.asdict(c) for row, c in records.calibration.items()},
        "grid_factors": list(size.grid),
        "rho_grid": a.rho_grid,
        "tau_by_rho": {m: by_rho(m, a.tau[m]) for m in MEASURES},
        "tau_interval_by_rho": {
            m: {
                key(r): [C.finite_or_none(v) for v in b]
                for r, b in zip(a.rho_grid[m], a.band[m], strict=True)
            }
            for m in MEASURES
        },
        "p_value_by_rho": {m: by_rho(m, a.p_value[m]) for m in MEASURES},
        "median_sharpness_by_rho": {m: by_rho(m, a.median[m]) for m in MEASURES},
        "curvature_share_by_rho": {m: by_rho(m, a.share[m]) for m in a.share},
        "radii": {
            name: {"factor": f, "how": HOW[name], "rho": finite(a.rho[name])}
            for name, f in a.radii.items()
        },
        "kendall_tau": taus("fixed", 0),
        "p_value": taus("fixed", 1),
        "tau_interval": {
            row: [C.finite_or_none(v) for v in band] for row, band in a.interval["fixed"].items()
        },
        **best,
        "granulated_tau": {row: finite(g) for row, g in a.granulated.items()},
        "granulated_tau_by_rho": {
            m: {key(r): finite(g) for r, g in zip(a.rho_grid[m], gs, strict=True)}
            for m, gs in a.granulated_by_rho.items()
        },
        "failures": a.failures,
        "paper": PAPER,
        "pretrained": records.pretrained,
        "models": model_records(config, a),
        "ranks": records.ranks,
        "seconds": {**records.seconds, "total": time.perf_counter() - records.started},
    }


def report(config: Config, analysis: Analysis, out: Path) -> dict[str, Any]:
    """Print both tables, write ``transformers.json``, ``transformers.png`` and
    ``tau_by_rho.png``; returns the JSON payload."""
    print_grid(config, analysis)
    print_ablations(config, analysis)
    print_granulated(config, analysis)
    data = payload(config, analysis)
    C.write_json(out / "transformers.json", data)
    figures(data, out)
    print(
        f"wrote {out / 'transformers.json'}, {out / 'transformers.png'}, {out / 'tau_by_rho.png'}"
    )
    return data
