r"""``quotientgeo reproduce toy``: the two-parameter network ``x ↦ θ₂ θ₁ x`` (Figure 1, App. D).

Least squares ``L(θ) = mean_i (θ₂ θ₁ x_i - y_i)²`` on synthetic data ``y = c x + noise`` only sees
``p = θ₁ θ₂``, so it is constant along the hyperbolae ``(α θ₁, θ₂ / α)``. Euclidean quantities
(gradient norm, Hessian trace) change along these orbits; their Riemannian counterparts on the
quotient, computed with :class:`~quotientgeo.RescaleQuotient` (the ``d = 1`` case, point
``[θ₁; θ₂]``), do not. On a grid we evaluate

- the Euclidean gradient norm ``||∇L||₂`` and Hessian trace ``tr ∇²L`` (autograd);
- the Riemannian gradient norm ``||grad L||_x`` (``egrad2rgrad`` and ``norm`` of the manifold);
- the Riemannian Hessian trace on the (one-dimensional) quotient, ``Hess L(e, e)`` for the unit
  horizontal vector ``e``: the second derivative of ``L`` along the manifold's exact geodesic
  ``expmap(x, t e)`` at ``t = 0`` (central differences in float64).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import _common as C
from .pipeline import Study, run_study

METRICS = ("inv", "mix")


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = 1.0·x + 0.1·noise``, ``x`` standard Gaussian, float64."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    return x, x + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)


def loss(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Least-squares loss of ``θ`` of shape ``(..., 2, 1)`` (``[θ₁; θ₂]``), batched."""
    p = theta[..., 0, 0] * theta[..., 1, 0]
    return (p[..., None] * x - y).square().mean(-1)


def quantities(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, metric: str, h=1e-4):
    """Loss, Euclidean/Riemannian gradient norms and Hessian traces at every point of ``theta``."""
    from quotientgeo import RescaleQuotient

    m = RescaleQuotient(metric=metric)
    th = theta.detach().requires_grad_(True)
    f = loss(th, x, y)
    (g,) = torch.autograd.grad(f.sum(), th, create_graph=True)
    # Euclidean Hessian trace: Σ_j ∂²L/∂θ_j² (every point is independent, so sum-then-grad is exact)
    diag = [
        torch.autograd.grad(g[..., j, 0].sum(), th, retain_graph=True)[0][..., j, 0]
        for j in range(2)
    ]
    pt = m.at(theta)
    rgrad = m.egrad2rgrad(pt, g.detach())
    e = m.proju(pt, theta)  # horizontal direction b·(θ₁, θ₂), b = 1
    e = e / m.norm(pt, e)[..., None, None]

    def along(t: float) -> torch.Tensor:
        return loss(m.expmap(theta, t * e), x, y)

    rhess = (along(h) - 2 * along(0.0) + along(-h)) / h**2
    return {
        "loss": f.detach(),
        "euclidean_grad_norm": g.detach().flatten(-2).norm(dim=-1),
        "riemannian_grad_norm": m.norm(pt, rgrad),
        "euclidean_hessian_trace": (diag[0] + diag[1]).detach(),
        "riemannian_hessian_trace": rhess,
    }


def closed_form(theta: torch.Tensor, x, y, metric: str) -> dict[str, torch.Tensor]:
    """The same quantities by formula (``L = s (p - c)² + const``, ``p = θ₁θ₂``)."""
    s = x.square().mean()
    c = (x * y).mean() / s
    t1, t2 = theta[..., 0, 0], theta[..., 1, 0]
    p = t1 * t2
    g = 2 * s * (p - c)
    rg = (2**0.5) * g.abs() * (p.abs() if metric == "inv" else 1.0)
    rh = 4 * s * p * (2 * p - c) if metric == "inv" else 4 * s * torch.ones_like(p)
    return {
        "euclidean_grad_norm": g.abs() * torch.hypot(t1, t2),
        "riemannian_grad_norm": rg,
        "euclidean_hessian_trace": 2 * s * (t1.square() + t2.square()),
        "riemannian_hessian_trace": rh,
    }


def orbit_variation(x, y, metric: str, n_points: int = 7) -> dict[str, float]:
    """Relative spread ``(max - min) / |mean|`` of every quantity along orbits ``(αθ₁, θ₂/α)``."""
    gen = torch.Generator().manual_seed(1)
    base = torch.rand(n_points, 2, 1, generator=gen, dtype=torch.float64) + 0.3
    alpha = torch.logspace(-1, 1, 9, dtype=torch.float64)
    orbit = base[:, None] * torch.stack((alpha, 1 / alpha), -1)[None, :, :, None]
    q = quantities(orbit, x, y, metric)
    return {
        k: float(((v.amax(1) - v.amin(1)) / v.mean(1).abs().clamp_min(1e-300)).max())
        for k, v in q.items()
    }


def figure(grid, q: dict, metric: str, path):
    plt = C.pyplot()
    import matplotlib.colors as mcolors

    t1, t2 = grid[..., 0, 0].numpy(), grid[..., 1, 0].numpy()
    panels = [
        ("loss", "loss L(θ)"),
        ("euclidean_grad_norm", "Euclidean ‖∇L‖"),
        ("riemannian_grad_norm", f"Riemannian ‖grad L‖ ({metric})"),
        ("euclidean_hessian_trace", "Euclidean tr ∇²L"),
        ("riemannian_hessian_trace", f"Riemannian Hessian trace ({metric})"),
    ]
    fig, axes = plt.subplots(1, 5, figsize=(22, 4.2))
    for ax, (key, title) in zip(axes, panels, strict=True):
        z = q[key].numpy()
        if key == "riemannian_hessian_trace":
            lim = float(abs(z).max())
            im = ax.pcolormesh(
                t1,
                t2,
                z,
                cmap="RdBu_r",
                shading="auto",
                norm=mcolors.SymLogNorm(1e-1, vmin=-lim, vmax=lim),
            )
        else:
            im = ax.pcolormesh(
                t1,
                t2,
                z,
                cmap="viridis",
                shading="auto",
                norm=mcolors.LogNorm(vmin=max(z.min(), 1e-6), vmax=z.max()),
            )
        loss = q["loss"].numpy()
        levels = np.geomspace(loss.min() * 2, loss.max() * 0.9, 10)
        ax.contour(t1, t2, loss, levels=levels, colors="white", linewidths=0.6)
        ax.set_title(title)
        ax.set_xlabel("θ₁")
        ax.set_aspect("equal")
        fig.colorbar(im, ax=ax, fraction=0.046)
    axes[0].set_ylabel("θ₂")
    fig.suptitle("x ↦ θ₂θ₁x: white lines are loss level sets (orbits of the re-scaling symmetry)")
    fig.tight_layout()
    return C.save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, "toy")
    parser.add_argument("--metric", choices=METRICS, default="inv", help="quotient metric (inv)")


QUANTITIES = (
    "euclidean_grad_norm",
    "riemannian_grad_norm",
    "euclidean_hessian_trace",
    "riemannian_hessian_trace",
)


@dataclass(frozen=True)
class Config:
    """The data seed, the grid size and the metric of the figure."""

    quick: bool
    seed: int
    metric: str
    size: int


@dataclass(frozen=True)
class Records:
    """The quantities on the grid (library and closed form) and their variation along orbits."""

    grid: torch.Tensor
    library: dict[str, torch.Tensor]
    formula: dict[str, torch.Tensor]
    variation: dict[str, dict[str, float]]
    started: float


@dataclass(frozen=True)
class Analysis:
    """The records and the largest relative error of each library quantity against its closed
    form."""

    records: Records
    agreement: dict[str, float]


def config(args: argparse.Namespace) -> Config:
    return Config(args.quick, args.seed, args.metric, 60 if args.quick else 300)


def collect(config: Config, population: C.Population, out: Path) -> Records:
    """The quantities on the grid and along orbits (one process computes everything)."""
    started = time.perf_counter()
    x, y = make_data(200, config.seed)
    axis = torch.linspace(-2.5, 2.5, config.size, dtype=torch.float64)  # even size: no zeros
    T1, T2 = torch.meshgrid(axis, axis, indexing="xy")
    grid = torch.stack((T1, T2), -1)[..., None]
    return Records(
        grid,
        quantities(grid, x, y, config.metric),
        closed_form(grid, x, y, config.metric),
        {m: orbit_variation(x, y, m) for m in METRICS},
        started,
    )


def analyse(config: Config, records: Records) -> Analysis:
    """Largest relative error of each library quantity against its closed form."""
    agreement = {
        k: float(((records.library[k] - v).abs() / v.abs().clamp_min(1e-3)).max())
        for k, v in records.formula.items()
    }
    return Analysis(records, agreement)


def report(config: Config, analysis: Analysis, out: Path) -> dict[str, Any]:
    """The table, ``toy.json`` and ``toy.png``."""
    records, agreement = analysis.records, analysis.agreement
    variation = records.variation
    rows = [
        [k, f"{variation['inv'][k]:.2e}", f"{variation['mix'][k]:.2e}", f"{agreement[k]:.1e}"]
        for k in QUANTITIES
    ]
    C.print_table(
        "Relative change along orbits (α θ₁, θ₂/α), α ∈ [0.1, 10] (Euclidean rows: same for "
        "both columns); last column: library vs closed form",
        ["quantity", "inv", "mix", f"vs formula ({config.metric})"],
        rows,
    )
    figure(records.grid, records.library, config.metric, out / "toy.png")
    payload = {
        "command": "toy",
        "quick": config.quick,
        "seed": config.seed,
        "metric": config.metric,
        "grid_size": config.size,
        "orbit_relative_variation": variation,
        "closed_form_max_relative_error": agreement,
        "seconds": time.perf_counter() - records.started,
    }
    C.write_json(out / "toy.json", payload)
    print(f"wrote {out / 'toy.json'} and {out / 'toy.png'}")
    return payload


STUDY = Study(config, collect, analyse, report)
"""The study (:class:`~.pipeline.Study`): :class:`Config` and this module's functions."""


def run(args: argparse.Namespace) -> int:
    """Toy network x ↦ θ₂θ₁x (Fig. 1, App. D): Euclidean vs Riemannian gradient and Hessian.

    ``config`` → ``collect`` → ``analyse`` → ``report``."""
    return run_study(STUDY, args)
