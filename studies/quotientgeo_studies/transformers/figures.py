"""The transformers study's figures, drawn from its JSON payload (so a finished run can be
re-drawn with ``figures(json.load(f), out)``)."""

from __future__ import annotations

import math
from pathlib import Path

from .. import _common as C
from .config import MEASURES


def key(rho: float) -> str:
    """A radius as a JSON key."""
    return f"{rho:.4g}"


def _number(value) -> float:
    """A JSON value back as a float (``None``, written for NaN, becomes NaN)."""
    return math.nan if value is None else float(value)


SCATTERED = (*MEASURES, "average", "relative_flatness")  # the columns of transformers.png


def scatter_figure(payload: dict, path: Path) -> Path:
    """Sharpness vs gap of the τ(ρ) measures, average sharpness and relative flatness, one row
    per distinct radius, coloured by the members' label noise (grid population) or
    augmentation (random population)."""
    from matplotlib.ticker import NullFormatter

    plt = C.pyplot()
    models, radii = payload["models"], payload["radii"]
    taus = {"fixed": payload["kendall_tau"], "best": payload.get("kendall_tau_best")}
    rows: dict[float, list[str]] = {}
    for name, radius in radii.items():
        rows.setdefault(radius["factor"], []).append(name)
    colour = "label_noise" if payload.get("population") == "grid" else "augment"
    groups = sorted({r[colour] for r in models})
    columns = [m for m in SCATTERED if m in payload["kendall_tau"]]
    fig, axes = plt.subplots(
        len(rows), len(columns), figsize=(4.3 * len(columns), 3.8 * len(rows)), squeeze=False
    )
    for r, (factor, names) in enumerate(rows.items()):
        name = names[0]
        for c, m in enumerate(columns):
            ax = axes[r][c]
            for group in groups:
                mine = [k for k in models if k[colour] == group]
                x = [_number(k["ablations"][name][m]) for k in mine]
                ax.scatter(
                    x,
                    [k["gap"] for k in mine],
                    s=18,
                    alpha=0.8,
                    label=f"{group:g}" if isinstance(group, float) else group,
                )
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            rho = radii[name]["rho"][m]
            where = "" if rho is None else f" (ρ = {rho:.3g})"
            ax.set_xlabel(f"{m.replace('_', ' ')}{where}")
            ax.set_title(
                f"{' = '.join(names)} radius, f = {factor:.3g}: τ = {_number(taus[name][m]):+.2f}"
            )
        axes[r][0].set_ylabel("gap (test - train error)")
    axes[0][0].legend(title=colour.replace("_", " "), fontsize=8)
    fig.suptitle(f"{len(models)} ViTs fine-tuned on digits 5–9 from one pretrained model")
    fig.tight_layout()
    return C.save_figure(fig, path)


def tau_figure(payload: dict, path: Path) -> Path:
    """τ(ρ) with bootstrap bands, median sharpness and curvature share, against ``ρ / ρ₁``."""
    plt = C.pyplot()
    grid = payload["grid_factors"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for m in MEASURES:
        label = m.replace("_", " ")
        keys = [key(r) for r in payload["rho_grid"][m]]
        tau = [_number(payload["tau_by_rho"][m][k]) for k in keys]
        (line,) = axes[0].plot(grid, tau, marker="o", label=label)
        band = [payload["tau_interval_by_rho"][m][k] for k in keys]
        lo, hi = ([_number(b[i]) for b in band] for i in (0, 1))
        axes[0].fill_between(grid, lo, hi, color=line.get_color(), alpha=0.15)
        med = [_number(payload["median_sharpness_by_rho"][m][k]) for k in keys]
        axes[1].plot(grid, med, marker="o", label=label)
        if m in payload["curvature_share_by_rho"]:
            share = [_number(payload["curvature_share_by_rho"][m][k]) for k in keys]
            axes[2].plot(grid, share, marker="o", label=label, color=line.get_color())
    for name, radius in payload["radii"].items():
        axes[0].axvline(radius["factor"], color="grey", ls=":" if name == "fixed" else "--", lw=1)
    axes[0].axhline(0.0, color="black", lw=0.5)
    axes[0].set_ylabel("Kendall τ with the gap (90 % bootstrap band)")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("median worst-case loss increase (nats)")
    axes[2].set_ylabel("median curvature share (S₂ - S₁) / S₂")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("ρ / ρ₁ (ρ₁: the measure reaches 1 nat on the reference model)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return C.save_figure(fig, path)


def figures(payload: dict, out: Path) -> list[Path]:
    """Draw ``transformers.png`` and ``tau_by_rho.png`` in ``out`` from the command's JSON
    (``json.load`` of ``transformers.json``), so a finished run can be re-drawn."""
    return [
        scatter_figure(payload, out / "transformers.png"),
        tau_figure(payload, out / "tau_by_rho.png"),
    ]
