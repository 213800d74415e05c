"""The diagonal study's figures, drawn from its JSON payload (so a finished run can be re-drawn
with ``figures(json.load(f), out)``)."""

from __future__ import annotations

import math
from pathlib import Path

from .. import _common as C
from .config import MAIN, PAPER_TAU

#: what colours each population's scatter: the hyperparameter that drives its gap
COLOUR = {"init": ("alpha", "initialisation scale α"), "sgd": ("batch_size", "batch size")}
MARKERS = "osD^v<>px"


def key(rho: float) -> str:
    """A radius as a JSON key."""
    return f"{rho:.4g}"


def _number(value) -> float:
    """A JSON value back as a float (``None``, written for NaN, becomes NaN)."""
    return math.nan if value is None else float(value)


def scatter_figure(payload: dict, path: Path) -> Path:
    """Sharpness at ``ρ = ρ₁`` against the gap, one row per population, one column per measure
    of the paper, coloured by the population's main hyperparameter (log scale)."""
    from matplotlib.ticker import NullFormatter

    plt = C.pyplot()
    pops = payload["populations"]
    fig, axes = plt.subplots(len(pops), 3, figsize=(13, 3.9 * len(pops)), squeeze=False)
    for r, (name, pop) in enumerate(pops.items()):
        models = pop["models"]
        field, label = COLOUR[name]
        colour = [math.log10(m[field]) for m in models]
        gap = [m["gap"] for m in models]
        for c, row in enumerate(MAIN):
            ax = axes[r][c]
            x = [_number(m[row]) for m in models]
            points = ax.scatter(x, gap, c=colour, s=18, alpha=0.85, cmap="viridis")
            positive = [v for v in x if v > 0]
            if positive and max(positive) > 10 * min(positive):  # log only across decades
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(NullFormatter())
            if min(gap) > 0:
                ax.set_yscale("log")
            rho = pop["rho_grid"][row][pop["grid_factors"].index(1.0)]
            ax.set_xlabel(f"{row.replace('_', ' ')} sharpness (ρ = ρ₁ = {rho:.3g})")
            tau = _number(pop["kendall_tau"][row])
            ax.set_title(f"{name}: τ = {tau:+.2f} (paper {PAPER_TAU[row]:+.2f})")
        axes[r][0].set_ylabel("generalization gap (test - train MSE)")
        fig.colorbar(points, ax=axes[r][2], label=f"log10 {label}")
    fig.suptitle("Diagonal linear networks, sparse regression")
    fig.tight_layout()
    return C.save_figure(fig, path)


def tau_figure(payload: dict, path: Path) -> Path:
    """τ(ρ) of every measure with its 90 % bootstrap band against ``ρ / ρ₁``, one panel per
    population."""
    plt = C.pyplot()
    pops = payload["populations"]
    fig, axes = plt.subplots(1, len(pops), figsize=(7 * len(pops), 4.5), squeeze=False)
    for ax, (name, pop) in zip(axes[0], pops.items(), strict=True):
        grid = pop["grid_factors"]
        for i, row in enumerate(pop["tau_by_rho"]):
            keys = [key(r) for r in pop["rho_grid"][row]]
            tau = [_number(pop["tau_by_rho"][row][k]) for k in keys]
            (line,) = ax.plot(grid, tau, marker=MARKERS[i % len(MARKERS)], label=row)
            band = [pop["tau_interval_by_rho"][row][k] for k in keys]
            lo, hi = ([_number(b[j]) for b in band] for j in (0, 1))
            ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.08)
        ax.axhline(0.0, color="black", lw=0.5)
        ax.axvline(1.0, color="grey", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_ylim(-1.05, 1.05)
        ax.set_xlabel("ρ / ρ₁ (ρ₁: the ball's calibrated radius on the reference member)")
        ax.set_ylabel("Kendall τ with the gap (90 % bootstrap band)")
        ratio = _number(pop["gap_spread_over_noise"])
        ax.set_title(f"{name} ({len(pop['models'])} networks; gap spread / noise = {ratio:.3g})")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return C.save_figure(fig, path)


def figures(payload: dict, out: Path) -> list[Path]:
    """Draw ``diagonal.png`` and ``diagonal_tau_by_rho.png`` in ``out`` from the command's
    JSON (``json.load`` of ``diagonal.json``)."""
    return [
        scatter_figure(payload, out / "diagonal.png"),
        tau_figure(payload, out / "diagonal_tau_by_rho.png"),
    ]
