"""The LoRA study's figure, drawn from its JSON payload (so a finished run can be re-drawn with
``figure(json.load(f), path)``)."""

from __future__ import annotations

import math
from pathlib import Path

from .. import _common as C

SCOPE_LABELS = {"adapters": "adapters only", "whole": "whole model"}


def key(lr: float) -> str:
    """A learning rate as a JSON key."""
    return f"{lr:.4g}"


def _number(value) -> float:
    """A JSON value back as a float (``None``, written for NaN, becomes NaN)."""
    return math.nan if value is None else float(value)


def figure(payload: dict, path: Path) -> Path:
    """Two panels: test accuracy against the learning rate, one line per optimizer (the mean
    over replicates, its band ± one standard deviation, the replicates as dots); Kendall τ with
    the gap of every measure in both scopes (bars, 90 % bootstrap band) and Ψ (diamonds)."""
    plt = C.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    grid = payload["learning_rates"]
    for arm in payload["optimizers"]:
        cells = [payload["accuracy"][arm][key(lr)] for lr in grid]
        mean = [c["mean"] for c in cells]
        sd = [_number(c["sd"]) for c in cells]
        (line,) = left.plot(grid, mean, marker="o", label=arm.replace("_", " "))
        if all(math.isfinite(s) for s in sd):
            lo = [m - s for m, s in zip(mean, sd, strict=True)]
            hi = [m + s for m, s in zip(mean, sd, strict=True)]
            left.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.15)
        for lr, c in zip(grid, cells, strict=True):
            left.scatter([lr] * len(c["per_replicate"]), c["per_replicate"], s=8,
                         color=line.get_color(), alpha=0.5)  # fmt: skip
    left.set_xscale("log")
    left.set_xlabel("learning rate (peak of the cosine schedule)")
    left.set_ylabel("test accuracy (clean labels)")
    left.set_title(f"LoRA fine-tuning, {payload['replicates']} replicate(s) per point")
    left.legend(fontsize=8)

    scopes = list(payload["kendall_tau"])
    measures = list(payload["kendall_tau"][scopes[0]])
    width = 0.8 / len(scopes)
    for j, where in enumerate(scopes):
        xs = [i + (j - (len(scopes) - 1) / 2) * width for i in range(len(measures))]
        tau = [_number(payload["kendall_tau"][where][m]) for m in measures]
        band = [[_number(v) for v in payload["tau_interval"][where][m]] for m in measures]
        err = [
            [t - b[0] if math.isfinite(t) else 0.0 for t, b in zip(tau, band, strict=True)],
            [b[1] - t if math.isfinite(t) else 0.0 for t, b in zip(tau, band, strict=True)],
        ]
        bars = right.bar(xs, tau, width, yerr=err, capsize=3, label=f"τ, {SCOPE_LABELS[where]}")
        psi = [_number(payload["granulated_tau"][where][m]["psi"]) for m in measures]
        right.scatter(xs, psi, marker="D", color="black", s=18, zorder=3,
                      label="Ψ" if j == 0 else None)  # fmt: skip
        for bar in bars:
            bar.set_alpha(0.8)
    right.axhline(0.0, color="black", lw=0.5)
    right.set_xticks(range(len(measures)), [m.replace("_", " ") for m in measures])
    right.set_ylim(-1.05, 1.05)
    right.set_ylabel("Kendall τ with the gap (90 % bootstrap band)")
    right.set_title("sharpness vs generalization gap")
    right.legend(fontsize=8)
    fig.tight_layout()
    return C.save_figure(fig, path)
