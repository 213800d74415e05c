"""The modular study's report: its tables, ``modular.json`` and the figures (drawn from the
JSON payload, so a finished run can be re-drawn with ``figures(json.load(f), out)``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .. import _common as C
from .config import AXES, GEODESIC, SWEPT, Config


def print_results(payload: dict[str, Any]) -> None:
    """The τ(ρ) table and the table of every row at ``f = 1``."""
    grid = payload["grid_factors"]
    keys = [f"{f:.3g}" for f in grid]

    def num(v) -> float:
        return math.nan if v is None else float(v)

    C.print_table(
        f"Kendall τ with the gap across ρ = f·ρ₁ ({payload['n_models']} members, "
        f"{payload['n_iter']} Auto-PGD iterations; τ [90 % bootstrap band]; curvature share "
        "(S₂ - S₁)/S₂, median)",
        ["f", *(f"τ {row}" for row in SWEPT), "share inv / mix"],
        [
            [
                k,
                *(
                    f"{num(payload['tau_by_rho'][row][k]):+.2f} "
                    f"[{num(payload['tau_interval_by_rho'][row][k][0]):+.2f}, "
                    f"{num(payload['tau_interval_by_rho'][row][k][1]):+.2f}]"
                    for row in SWEPT
                ),
                " / ".join(f"{num(payload['curvature_share_by_rho'][g][k]):.2f}" for g in GEODESIC),
            ]
            for k in keys
        ],
    )
    psi = payload["granulated_tau"]
    C.print_table(
        "Every row at f = 1 (fixed in advance): Kendall τ with the gap, band, p-value, "
        "granulated τ per axis and Ψ",
        ["row", "ρ", "τ", "90 % band", "p", *(f"τ|{a}" for a in AXES), "Ψ"],
        [
            [
                row,
                "—" if payload["rho"][row] is None else f"{payload['rho'][row]:.3g}",
                num(t),
                " ".join(f"{num(b):+.2f}" for b in payload["kendall_interval"][row]),
                f"{num(payload['p_value'][row]):.1e}",
                *(num(psi[row][a]) for a in AXES),
                num(psi[row]["psi"]),
            ]
            for row, t in payload["kendall_tau"].items()
        ],
    )
    print(
        "paper (Table 1, context only: no modular study there): "
        + "; ".join(
            f"{task}: " + ", ".join(f"{m} {t:+.2f}" for m, t in v.items())
            for task, v in payload["paper"].items()
        )
    )
    if payload["failures"]:
        print(f"{len(payload['failures'])} failed measurement(s); first: {payload['failures'][0]}")


def figures(payload: dict[str, Any], out: Path) -> list[Path]:
    """``modular_tau_by_rho.png`` (τ(ρ) with bands, curvature share) and ``modular.png``
    (every row at ``f = 1`` against the gap, coloured by training fraction, one marker per
    weight decay)."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.ticker import NullFormatter

    plt = C.pyplot()

    def num(v) -> float:
        return math.nan if v is None else float(v)

    grid, keys = payload["grid_factors"], [f"{f:.3g}" for f in payload["grid_factors"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for row in SWEPT:
        tau = [num(payload["tau_by_rho"][row][k]) for k in keys]
        (line,) = axes[0].plot(grid, tau, marker="o", label=row.replace("_", " "))
        lo, hi = ([num(payload["tau_interval_by_rho"][row][k][i]) for k in keys] for i in (0, 1))
        axes[0].fill_between(grid, lo, hi, color=line.get_color(), alpha=0.15)
        if row in GEODESIC:
            share = [num(payload["curvature_share_by_rho"][row][k]) for k in keys]
            axes[1].plot(grid, share, marker="o", color=line.get_color(), label=row)
    axes[0].axhline(0.0, color="black", lw=0.5)
    axes[0].set_ylabel("Kendall τ with the gap (90 % band)")
    axes[1].set_ylabel("median curvature share (S₂ - S₁) / S₂")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("ρ / ρ₁")
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [C.save_figure(fig, out / "modular_tau_by_rho.png")]

    models, rows_ = payload["models"], list(payload["kendall_tau"])
    cols = 4
    fig, axes = plt.subplots(
        math.ceil(len(rows_) / cols), cols, figsize=(14, 3.2 * 3), squeeze=False
    )
    decays = sorted({m["weight_decay"] for m in models})
    marker = dict(zip(decays, "os^Dv<>p", strict=False))
    lo, hi = min(m["fraction"] for m in models), max(m["fraction"] for m in models)
    for ax, row in zip(axes.flat, rows_, strict=False):
        x = [num(m["values"][row]) for m in models]
        for wd in decays:  # one marker per weight decay, colour by training fraction
            mine = [k for k, m in enumerate(models) if m["weight_decay"] == wd]
            ax.scatter(
                [x[k] for k in mine],
                [models[k]["gap"] for k in mine],
                c=[models[k]["fraction"] for k in mine],
                cmap="viridis",
                vmin=lo,
                vmax=hi,
                marker=marker[wd],
                s=18,
                label=f"weight decay {wd:g}",
            )
        if all(v > 0 for v in x if math.isfinite(v)):
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{row}: τ = {num(payload['kendall_tau'][row]):+.2f}", fontsize=9)
    for ax in axes.flat[len(rows_) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("gap (test - train error)")
    axes.flat[0].legend(fontsize=7)
    scale = ScalarMappable(norm=Normalize(lo, hi), cmap="viridis")
    fig.colorbar(scale, ax=axes, label="training fraction")
    fig.suptitle(f"{len(models)} transformers on (a + b) mod {payload['task']['p']}, f = 1")
    paths.append(C.save_figure(fig, out / "modular.png"))
    return paths


def report(config: Config, payload: dict[str, Any] | None, out: Path) -> dict[str, Any]:
    """The tables, ``modular.json`` and the figures; nothing after ``--gaps-only``."""
    if payload is None:
        return {}
    print_results(payload)
    C.write_json(out / "modular.json", payload)
    figures(payload, out)
    print(f"wrote {out / 'modular.json'}, {out / 'modular.png'}, {out / 'modular_tau_by_rho.png'}")
    return payload
