"""Produce docs/figures/curvature_profile.png and docs/figures/curvature_density.png, and print
the small-ρ table of docs/curvature.md.

Run from the repository root: ``python docs/figures/make_curvature.py`` (needs matplotlib).

1. A 3-layer ``nn.TransformerEncoder`` classifier (d = 8, 2 heads, float64) and a copy moved
   along the GL(h) orbits of its attention pairs (``moved_along_orbits``, condition number at
   most 25): the exact trace of each layer's attention block and of each layer's rest, in the
   quotient geometry (mix metric) and in the Euclidean one.
2. The spectral density (stochastic Lanczos quadrature, 4 probes, 80 steps) of the same model
   and its moved copy, both geometries.
3. Least squares through a two-factor layer at its minimiser: ``sharpness(ρ)/ρ²`` against
   ``λ_max/2`` for ``ρ`` halving from 0.2.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from torch import nn

import quotientgeo as qg
from quotientgeo.testing import TinyTransformerClassifier, moved_along_orbits, random_batches
from quotientgeo.testing import cross_entropy as loss_fn

HERE = Path(__file__).parent


def profile(model, moved, batches) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=False)
    for ax, geometry in zip(axes, ("riemannian", "euclidean"), strict=True):
        for m, label, marker in ((model, "model", "o"), (moved, "moved along orbits", "x")):
            result = qg.hessian_trace(
                m, loss_fn, batches, method="exact", per_block=True, geometry=geometry,
                chunk_size=128, progress=False,
            )  # fmt: skip
            blocks = [b for b in result.per_block or [] if b.layer is not None]
            for kind, style in (("attention", "-"), ("rest", ":")):
                rows = [b for b in blocks if b.kind == kind]
                ax.plot(
                    [b.layer for b in rows], [b.value for b in rows], style, marker=marker,
                    label=f"{kind}, {label}",
                )  # fmt: skip
            print(f"{geometry:10s} {label:20s} total {result.value:.12g}")
            for b in blocks:
                print(f"    {b.name:22s} {b.value:.12g}")
        ax.set_title(f"{geometry}: trace of each layer's block")
        ax.set_xlabel("layer")
        ax.set_xticks(range(3))
        ax.legend(fontsize=7)
    axes[0].set_ylabel("trace")
    fig.tight_layout()
    fig.savefig(HERE / "curvature_profile.png", dpi=120)


def density(model, moved, batches) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, geometry in zip(axes, ("riemannian", "euclidean"), strict=True):
        for m, label, style in ((model, "model", "-"), (moved, "moved along orbits", "--")):
            result = qg.hessian_density(
                m, loss_fn, batches, n_probes=4, n_steps=80, geometry=geometry, progress=False
            )
            grid, values = result.density(width=0.02)
            ax.semilogy(grid, values.clamp_min(1e-6), style, label=label)
        ax.set_title(f"{geometry}: spectral density")
        ax.set_xlabel("eigenvalue")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "curvature_density.png", dpi=120)


class TwoFactor(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.G = nn.Parameter(torch.randn(6, 2, generator=gen, dtype=torch.float64))
        self.H = nn.Parameter(torch.randn(4, 2, generator=gen, dtype=torch.float64))

    def forward(self, x):
        return x @ self.G @ self.H.T


def small_rho() -> None:
    model = TwoFactor()
    X = torch.randn(40, 6, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    with torch.no_grad():
        Y = model(X)

    def loss(m, batch):
        return ((m(batch[0]) - batch[1]) ** 2).mean()

    print("| metric | ρ | sharpness(ρ)/ρ² | λ_max/2 | error | order |")
    print("|---|---|---|---|---|---|")
    for metric in ("inv", "mix"):
        geometry = qg.ParameterGeometry(model).add_gl_pair(
            qg.Source("G", axis=1), qg.Source("H", axis=1), metric=metric
        )
        top = qg.hessian_eigenvalues(
            model, loss, [(X, Y)], symmetries=geometry, method="exact", progress=False
        ).values[0]
        previous = None
        for rho in (0.2, 0.1, 0.05, 0.025, 0.0125):
            s = qg.geodesic_sharpness(
                model, loss, [(X, Y)], rho=rho, symmetries=geometry, n_iter=200, restarts=3,
                progress=False,
            ).value  # fmt: skip
            error = abs(s / rho**2 - top / 2)
            order = "" if previous is None else f"{math.log2(previous / error):.3f}"
            print(
                f"| {metric} | {rho} | {s / rho**2:.6f} | {top / 2:.6f} | {error:.3g} | {order} |"
            )
            previous = error


def main() -> int:
    torch.manual_seed(0)
    model = TinyTransformerClassifier(d=8, heads=2, layers=3, dim_feedforward=8).double().eval()
    batches = random_batches(2, batch=8, seq=4, d=8, seed=1)
    moved = moved_along_orbits(model, seed=3, condition=25)
    profile(model, moved, batches)
    density(model, moved, batches)
    small_rho()
    return 0


if __name__ == "__main__":
    sys.exit(main())
