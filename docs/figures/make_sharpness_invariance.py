"""Produce docs/figures/sharpness_invariance.png: sharpness along GL(h) orbits of a transformer.

Run from the repository root: ``python docs/figures/make_sharpness_invariance.py``
(needs matplotlib; about a minute on a laptop CPU).

A 2-layer ``nn.TransformerEncoder`` classifier (d = 32, 4 heads, float64) is re-parametrised
by ``A = a·U diag(σ) Vᵀ`` on every head's QK and VO pair (Haar ``U``, ``V``, condition number
at most 100, a new draw per ``a``), applied
through the geometry (``quotientgeo.testing.moved_along_orbits``: ``manifold.act`` on the
gathered points, scattered back). The network
function is unchanged; geodesic sharpness (both metrics) stays put while adaptive sharpness
moves.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from quotientgeo.sharpness import adaptive_sharpness, geodesic_sharpness
from quotientgeo.testing import TinyTransformerClassifier, moved_along_orbits, random_batches
from quotientgeo.testing import cross_entropy as loss_fn

OUT = Path(__file__).with_name("sharpness_invariance.png")
SCALES = [10.0**e for e in (-2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2)]


def main() -> int:
    torch.manual_seed(0)
    model = TinyTransformerClassifier().double().eval()
    batches = random_batches(2, batch=16, seq=8, d=32, seed=1)
    measures = {
        "geodesic (mix)": lambda m: geodesic_sharpness(
            m, loss_fn, batches, rho=0.05, metric="mix", n_iter=20, progress=False
        ),
        "geodesic (inv)": lambda m: geodesic_sharpness(
            m, loss_fn, batches, rho=0.05, metric="inv", n_iter=20, progress=False
        ),
        "adaptive": lambda m: adaptive_sharpness(
            m, loss_fn, batches, rho=0.05, n_iter=20, progress=False
        ),
    }
    reference = {name: f(model).value for name, f in measures.items()}
    values = {name: [] for name in measures}
    for i, scale in enumerate(SCALES):
        moved = moved_along_orbits(model, scale=scale, seed=100 + i, condition=100.0)
        with torch.no_grad():
            out_change = float((moved(batches[0][0]) - model(batches[0][0])).abs().max())
        for name, f in measures.items():
            values[name].append(f(moved).value)
        print(
            f"a={scale:8.3g}  max |Δ output|={out_change:.1e}  "
            + "  ".join(f"{n}: {v[-1]:.6f}" for n, v in values.items()),
            file=sys.stderr,
        )

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = {"geodesic (mix)": "o-", "geodesic (inv)": "s--", "adaptive": "^-"}
    for name, vals in values.items():
        ratio = [v / reference[name] for v in vals]
        change = [max(abs(r - 1), 1e-16) for r in ratio]
        axes[0].plot(SCALES, ratio, styles[name], label=name)
        axes[1].plot(SCALES, change, styles[name], label=name)
    axes[0].set(xscale="log", xlabel="scale a of A", ylabel="sharpness / sharpness of the original")
    axes[1].set(xscale="log", yscale="log", xlabel="scale a of A", ylabel="relative change")
    axes[1].axhline(1e-3, color="grey", lw=0.8, ls=":")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Same function, re-parametrised per head: only geodesic sharpness is invariant")
    fig.tight_layout()
    fig.savefig(OUT, dpi=130)
    for name, vals in values.items():
        ratio = [v / reference[name] for v in vals]
        print(
            f"{name}: max |after/before - 1| = {max(abs(r - 1) for r in ratio):.1e}, "
            f"after/before in [{min(ratio):.3g}, {max(ratio):.3g}]",
            file=sys.stderr,
        )
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
