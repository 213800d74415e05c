r"""``quotientgeo reproduce transformers``: sharpness vs generalization of a ViT population.

Laptop-scale stand-in for the paper's CLIP/BERT study (section 5.3, Figures 4–5, ablations of
Appendix G): a population of small vision transformers (:mod:`._vit`) trained on scikit-learn's
digits with varied learning rate, weight decay, batch size, width and training length. For every
model we measure worst-case sharpness on the same fixed training subset and correlate it (Kendall
τ) with the generalization gap ``test error - train error``. Rows of the ablation table:

- ``adaptive``: Andriushchenko et al.'s adaptive sharpness (the baseline);
- ``geodesic_inv`` / ``geodesic_mix``: geodesic sharpness, second-order geodesics, Riemannian norm;
- ``no_symmetry``: ``symmetries=None`` (adaptive geometry on the attention weights too);
- ``first_order_M`` / ``exact_M``: first-order (straight line) or exact geodesic perturbations;
- ``norm_adaptive_M``: horizontal second-order perturbations, element-wise ``|w|`` ball norm.

- ``spectrum_sS``: second-order geodesic sharpness with the metric ``(1-s)·inv + s·mix``
  (:class:`~quotientgeo.InterpolatedGLQuotient`, geometry derived by the generic base).

Trained models are cached under ``--out/models``, so re-running only re-measures. Under
``torchrun --nproc_per_node N`` the models are split over the ranks (each trains and measures
its share); rank 0 gathers them in population order and writes the same JSON and figure.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

from . import _common as C
from . import _vit

SPECTRUM = (0.25, 0.5, 0.75)
PAPER_NOTE = (
    "the paper's transformer rows (Table 1) are fine-tuned CLIP (ImageNet) and BERT (MNLI) "
    "checkpoints, which cannot be downloaded here; this laptop-scale population is a stand-in, "
    "so compare the ordering of the rows (geodesic vs adaptive), not the values"
)


def rows() -> dict[str, dict]:
    """Ablation rows: name -> keyword arguments of ``geodesic_sharpness``."""
    out = {
        "adaptive": {"symmetries": None, "perturbation": "first_order", "norm": "adaptive"},
        "no_symmetry": {"symmetries": None},
    }
    for metric in ("inv", "mix"):
        out[f"geodesic_{metric}"] = {"metric": metric}
        out[f"first_order_{metric}"] = {"metric": metric, "perturbation": "first_order"}
        out[f"exact_{metric}"] = {"metric": metric, "perturbation": "exact"}
        out[f"norm_adaptive_{metric}"] = {"metric": metric, "norm": "adaptive"}
    for s in SPECTRUM:  # s = 0 and 1 are the inv and mix rows
        out[f"spectrum_s{s:g}"] = {"metric": s}
    return out


def figure(gap, values: dict, taus: dict, path):
    plt = C.pyplot()
    keys = ["adaptive", "geodesic_inv", "geodesic_mix"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key in zip(axes, keys, strict=True):
        ax.scatter(values[key], gap, s=18, alpha=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(f"{key.replace('_', ' ')} sharpness")
        ax.set_title(f"{key.replace('_', ' ')}: τ = {taus[key]:+.2f}")
    axes[0].set_ylabel("generalization gap (test - train error)")
    fig.suptitle("Vision transformers on digits")
    fig.tight_layout()
    return C.save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, "transformers")
    parser.add_argument("--n-models", type=int, default=None, help="population size (32)")
    parser.add_argument("--rho", type=float, default=0.1, help="ball radius (0.1)")
    parser.add_argument("--n-iter", type=int, default=None, help="Auto-PGD iterations (20)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: tiny models)")


def run(args: argparse.Namespace) -> int:
    """ViT population on digits (§5.3, App. G): Kendall τ of every sharpness ablation vs gap."""
    t0 = time.perf_counter()
    out = C.out_dir(args)
    from quotientgeo import sharpness as sh

    n_models = args.n_models or (6 if args.quick else 32)
    n_iter = args.n_iter or (3 if args.quick else 20)
    n_train, batch, n_batches = (200, 64, 1) if args.quick else (500, 128, 2)
    data = _vit.load_digits_split(n_train, args.seed)
    configs = _vit.population(n_models, args.seed, quick=args.quick)
    x, y = data["x_train"], data["y_train"]
    batches = [
        (x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]) for i in range(n_batches)
    ]
    measures = rows()
    with C.Population() as population, C.threads(args.threads):
        args.no_progress = args.no_progress or not population.is_reporter
        records = {}  # model index -> (its record, its sharpness values)
        mine = population.mine(n_models)
        bar = C.progress(None, args=args, desc="models (trained or cached, measured)",
                         total=len(mine))  # fmt: skip
        with bar:
            for k in mine:
                model, metrics = _vit.trained(configs[k], data, out / "models", args.seed)
                values_k = {}
                for key, kw in measures.items():
                    values_k[key] = sh.geodesic_sharpness(
                        model,
                        _vit.cross_entropy,
                        batches,
                        rho=args.rho,
                        n_iter=n_iter,
                        seed=args.seed,
                        progress=False,
                        distributed="off",  # each rank measures its own models
                        **kw,
                    ).value
                records[k] = ({**asdict(configs[k]), **metrics}, values_k)
                bar.update(1)
        gathered = population.gather(records)
        if not population.is_reporter:
            return 0
    info = [record for record, _ in gathered]
    values = {key: [v[key] for _, v in gathered] for key in measures}
    gap = [m["gap"] for m in info]
    taus, pvalues = {}, {}
    for key in measures:
        taus[key], pvalues[key] = C.kendall(values[key], gap)
    table = [[k, taus[k], f"{pvalues[k]:.1e}"] for k in measures]
    C.print_table(
        f"Kendall τ with the generalization gap ({n_models} ViTs on digits, ρ = {args.rho}, "
        f"{n_iter} Auto-PGD iterations, {n_batches}×{batch} training samples)",
        ["measure", "τ (ours)", "p-value"],
        table,
    )
    print(PAPER_NOTE)
    print(
        f"gaps from {min(gap):.3f} to {max(gap):.3f}; "
        f"{sum(m['cached'] for m in info)}/{n_models} models from the cache"
    )
    figure(gap, values, taus, out / "transformers.png")
    for m, k in zip(info, range(n_models), strict=True):
        m.update({key: values[key][k] for key in measures})
    C.write_json(
        out / "transformers.json",
        {
            "command": "transformers",
            "quick": args.quick,
            "seed": args.seed,
            "rho": args.rho,
            "n_iter": n_iter,
            "n_train": n_train,
            "sharpness_samples": n_batches * batch,
            "kendall_tau": {k: C.finite_or_none(v) for k, v in taus.items()},
            "p_value": {k: C.finite_or_none(v) for k, v in pvalues.items()},
            "paper": PAPER_NOTE,
            "models": info,
            "ranks": population.world,
            "seconds": {"total": time.perf_counter() - t0},
        },
    )
    print(f"wrote {out / 'transformers.json'} and {out / 'transformers.png'}")
    return 0
