r"""``quotientgeo reproduce invariance``: sharpness along symmetry orbits (paper Figure 7).

A small transformer classifier (:class:`._vit.DigitsViT`, float64, trained briefly on digits) is
re-parametrised on every attention head: each QK and VO pair ``(G, H)`` found by
:func:`quotientgeo.find_symmetries` is mapped to ``(G A⁻¹, H Aᵀ)`` with ``A = a·N`` (``N``
Gaussian, one per head), through the geometry's own gather/act/scatter, for ``a`` from ``1e-2`` to
``1e2``. The network's outputs do not change; we report the ratio of sharpness after/before for
adaptive sharpness and geodesic sharpness (inv, mix).
"""

from __future__ import annotations

import argparse
import time

import torch

from . import _common as C
from . import _vit

MEASURES = {
    "adaptive": {"symmetries": None, "perturbation": "first_order", "norm": "adaptive"},
    "geodesic_inv": {"metric": "inv", "perturbation": "second_order"},
    "geodesic_mix": {"metric": "mix", "perturbation": "second_order"},
}


def reparametrize(model, a: float, seed: int):
    """A copy of ``model`` with every head's GL pair acted on by ``A = a·N``."""
    from quotientgeo.testing import moved_along_orbits

    return moved_along_orbits(model, scale=a, seed=seed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, "invariance")
    parser.add_argument("--rho", type=float, default=0.1, help="ball radius (0.1)")


def run(args: argparse.Namespace) -> int:
    """Sharpness along symmetry orbits (Fig. 7): after/before ratio for A = a·N on every head."""
    t0 = time.perf_counter()
    out = C.out_dir(args)
    from quotientgeo import sharpness as sh

    n_iter = 3 if args.quick else 20
    scales = (
        [1e-2, 1e-1, 1.0, 1e1, 1e2]
        if args.quick
        else torch.logspace(-2, 2, 9, dtype=torch.float64).tolist()
    )
    with C.threads(1):
        model, data = _vit.small_trained(args.quick, args.seed)
        model = model.double()
        x, y = data["x_train"][:128].double(), data["y_train"][:128]
        batches = [(x, y)]
        with torch.no_grad():
            logits = model(x)
        kw = {"rho": args.rho, "n_iter": n_iter, "seed": args.seed, "progress": False}
        base = {
            k: sh.geodesic_sharpness(model, _vit.cross_entropy, batches, **kw, **m).value
            for k, m in MEASURES.items()
        }
        ratios = {k: [] for k in MEASURES}
        output_change = []
        for a in C.progress(scales, args=args, desc="orbit scales"):
            moved = reparametrize(model, a, args.seed + 1)
            with torch.no_grad():
                change = (moved(x) - logits).abs().max() / logits.abs().max()
            output_change.append(float(change))
            for k, m in MEASURES.items():
                value = sh.geodesic_sharpness(moved, _vit.cross_entropy, batches, **kw, **m).value
                ratios[k].append(value / base[k])
    C.print_table(
        f"Sharpness after / before re-parametrising every head by A = a·N (ρ = {args.rho})",
        ["a", "max |Δ output| (rel.)", *MEASURES],
        [
            [f"{a:.3g}", f"{c:.1e}", *(f"{ratios[k][i]:.6g}" for k in MEASURES)]
            for i, (a, c) in enumerate(zip(scales, output_change, strict=True))
        ],
    )
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for k in MEASURES:
        ax.plot(scales, ratios[k], marker="o", label=k.replace("_", " "))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("a  (A = a·N on every head)")
    ax.set_ylabel("sharpness after / before")
    ax.legend()
    ax.set_title("Invariance along symmetry orbits")
    C.save_figure(fig, out / "invariance.png")
    max_dev = {k: max(abs(r - 1) for r in v) for k, v in ratios.items()}
    C.write_json(
        out / "invariance.json",
        {
            "command": "invariance",
            "quick": args.quick,
            "seed": args.seed,
            "rho": args.rho,
            "n_iter": n_iter,
            "scales": scales,
            "base_sharpness": base,
            "ratio": ratios,
            "max_relative_deviation": max_dev,
            "max_output_change": max(output_change),
            "seconds": time.perf_counter() - t0,
        },
    )
    print(f"wrote {out / 'invariance.json'} and {out / 'invariance.png'}")
    return 0
