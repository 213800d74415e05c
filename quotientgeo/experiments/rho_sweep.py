r"""``quotientgeo reproduce rho-sweep``: how far the second-order geodesic can be trusted.

Geodesic sharpness with second-order (``x + ξ - ½Γ(ξ, ξ)``) and with exact geodesics across
the radius ``ρ``, for one diagonal network (:mod:`.diagonal`, re-scaling pair declared explicitly)
and one small transformer (:mod:`._vit`), both metrics; the figure shows the relative difference
``|S₂ - S_exact| / |S_exact|`` against ``ρ``.
"""

from __future__ import annotations

import argparse
import time

import torch

from . import _common as C
from . import _vit, diagonal


def models(args):
    """``{name: (model, loss_fn, batches, symmetries)}`` for the two networks."""
    cfg = diagonal.Config.quick() if args.quick else diagonal.Config(n_models=1)
    cfg.n_models = 1
    data = diagonal.make_data(cfg, args.seed)
    hp = diagonal.hyperparameters(1, cfg.n, args.seed)
    hp["alpha"][:] = 0.1
    t = diagonal.train_population(data, hp, cfg, args.seed)
    dnet = diagonal.DiagonalNet(t["u"][0], t["v"][0])
    vit, vdata = _vit.small_trained(args.quick, args.seed)
    vbatch = [(vdata["x_train"][:128], vdata["y_train"][:128])]
    return {
        "diagonal": (dnet, diagonal.mse, [(data["X"], data["y"])], diagonal.rescale_geometry(dnet)),
        "transformer": (vit, _vit.cross_entropy, vbatch, "auto"),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, "rho-sweep")


def run(args: argparse.Namespace) -> int:
    """Second-order vs exact geodesics across ρ: relative difference of geodesic sharpness."""
    t0 = time.perf_counter()
    out = C.out_dir(args)
    from quotientgeo import sharpness as sh

    rhos = (
        [1e-3, 1e-2, 1e-1] if args.quick else torch.logspace(-3, 0, 7, dtype=torch.float64).tolist()
    )
    n_iter = 3 if args.quick else 20
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    rows = []
    with C.threads(1):
        nets = models(args)
        jobs = [(n, m, r) for n in nets for m in ("inv", "mix") for r in rhos]
        for name, metric, rho in C.progress(jobs, args=args, desc="rho sweep"):
            model, loss_fn, batches, sym = nets[name]
            entry = results.setdefault(name, {}).setdefault(
                metric, {"second_order": [], "exact": [], "relative_difference": []}
            )
            vals = {}
            for pert in ("second_order", "exact"):
                vals[pert] = sh.geodesic_sharpness(
                    model,
                    loss_fn,
                    batches,
                    rho=rho,
                    metric=metric,
                    perturbation=pert,
                    symmetries=sym,
                    n_iter=n_iter,
                    seed=args.seed,
                    progress=False,
                ).value
                entry[pert].append(vals[pert])
            rel = abs(vals["second_order"] - vals["exact"]) / max(abs(vals["exact"]), 1e-300)
            entry["relative_difference"].append(rel)
            rows.append(
                [
                    name,
                    metric,
                    f"{rho:.3g}",
                    f"{vals['second_order']:.4g}",
                    f"{vals['exact']:.4g}",
                    f"{rel:.2e}",
                ]
            )
    C.print_table(
        "Geodesic sharpness: second-order vs exact geodesics",
        ["network", "metric", "ρ", "second order", "exact", "rel. diff."],
        rows,
    )
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for name, per_metric in results.items():
        for metric, entry in per_metric.items():
            diff = [max(d, 1e-16) for d in entry["relative_difference"]]
            ax.plot(rhos, diff, marker="o", label=f"{name}, {metric}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ρ")
    ax.set_ylabel("|S₂ - S_exact| / |S_exact|")
    ax.set_title("Second-order vs exact geodesic sharpness")
    ax.legend(fontsize=8)
    C.save_figure(fig, out / "rho_sweep.png")
    C.write_json(
        out / "rho_sweep.json",
        {
            "command": "rho-sweep",
            "quick": args.quick,
            "seed": args.seed,
            "rho": rhos,
            "n_iter": n_iter,
            "results": results,
            "seconds": time.perf_counter() - t0,
        },
    )
    print(f"wrote {out / 'rho_sweep.json'} and {out / 'rho_sweep.png'}")
    return 0
