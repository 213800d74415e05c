r"""``quotientgeo reproduce transformers``: sharpness vs generalization of a fine-tuned ViT
population, across the radius ``ρ``.

The paper's study (section 5.3, Table 1, Appendix G) at laptop scale, in the paper's regime:

- **population**: one small ViT pretrained on the digits 0–4, fine-tuned ``--n-models`` times on
  the held-out digits 5–9 with random learning rate, weight decay, epochs, batch size, label
  smoothing, training subset and augmentation (:mod:`._finetune`); the generalization gap is
  test error minus train error;
- **data of every measure**: the same fixed training batches (inside every member's subset);
- **radii**: each measure with its own ball (adaptive, geodesic inv and mix, and the ablations
  that change the ball) is calibrated on a reference member (member 0) with
  :func:`quotientgeo.calibrate_rho`: ``ρ₁`` is the radius at which its worst-case loss increase
  is ``--target`` nats (1). The study runs on the grid ``ρ = f · ρ₁`` with
  ``f ∈ 10^{-2}, 10^{-1.5}, …, 10^{1}``, from first-order sharpness to several nats;
- **τ(ρ)**: Kendall τ of each measure with the gap at every grid point, with a bootstrap band
  over models, and the *curvature share* of geodesic sharpness: ``(S₂ - S₁) / S₂`` with ``S₂``
  the second-order value and ``S₁`` the loss increase at the first-order move ``x + ξ*`` of the
  same maximiser ``ξ*`` (population median);
- **ablations** at two radii, ``f = 1`` (fixed in advance: the ``--target`` radius) and the grid
  point where geodesic sharpness predicts best (largest mean ``|τ|`` of inv and mix): symmetry
  off (``symmetries=None``, which is adaptive sharpness exactly), first-order, second-order and
  exact perturbation (same ball as the second-order row), adaptive instead of Riemannian norm,
  and the metric spectrum ``(1-s)·inv + s·mix``; rows with their own ball use ``f`` times their
  own calibrated ``ρ₁``.

Models are cached under ``--out/models``, so re-running only re-measures. The work is split over
``--workers`` local processes (2 by default, one per core of a laptop; ``--quick``: 1), or over
the ranks of ``torchrun --nproc_per_node N``; rank 0 writes ``transformers.json``,
``transformers.png`` (sharpness vs gap at both radii) and ``tau_by_rho.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from pathlib import Path

from . import _common as C
from . import _finetune, _vit

GRID = tuple(10 ** (k / 2) for k in range(-4, 3))  # f = 0.01 … 10, half-decade steps
QUICK_GRID = (0.1, 1.0, 10.0)
FIXED_FACTOR = 1.0
MEASURES = ("adaptive", "geodesic_inv", "geodesic_mix")  # the τ(ρ) study
SPECTRUM = (0.25, 0.5, 0.75)
PAPER = {  # Table 1 of the paper: Kendall τ with the generalization gap
    "ImageNet (CLIP ViT-B/32, 72 models)": {
        "adaptive": -0.41,
        "geodesic_inv": -0.71,
        "geodesic_mix": -0.70,
    },
    "MNLI (BERT, 35 models)": {"adaptive": 0.06, "geodesic_inv": 0.28, "geodesic_mix": 0.38},
}


def balls() -> dict[str, dict]:
    """Measures with a ball of their own (each calibrated): name -> ``geodesic_sharpness``
    keyword arguments."""
    out = {"adaptive": {"symmetries": None, "perturbation": "first_order", "norm": "adaptive"}}
    second = {"perturbation": "second_order"}  # the paper's map, on every row
    for metric in ("inv", "mix"):
        out[f"geodesic_{metric}"] = {"metric": metric, **second}
        out[f"norm_adaptive_{metric}"] = {"metric": metric, "norm": "adaptive", **second}
    for s in SPECTRUM:  # s = 0 and 1 are the inv and mix rows
        out[f"spectrum_s{s:g}"] = {"metric": s, **second}
    return out


def same_ball() -> dict[str, tuple[str, dict]]:
    """Perturbation ablations: name -> (the measure whose ball and ``ρ`` they share, kwargs)."""
    return {
        f"{kind}_{metric}": (f"geodesic_{metric}", {"metric": metric, "perturbation": kind})
        for metric in ("inv", "mix")
        for kind in ("first_order", "exact")
    }


def ablation_rows() -> list[str]:
    """Rows of the ablation table, in print order (``no_symmetry`` is ``adaptive``)."""
    rows = ["adaptive", "no_symmetry"]
    for metric in ("inv", "mix"):
        rows += [f"{k}_{metric}" for k in ("geodesic", "first_order", "exact", "norm_adaptive")]
    return rows + [f"spectrum_s{s:g}" for s in SPECTRUM]


@dataclasses.dataclass(frozen=True)
class Size:
    """How big the study is."""

    n_models: int = 40
    n_iter: int = 20
    n_batches: int = 2
    batch: int = 128
    grid: tuple[float, ...] = GRID
    pretrain_epochs: int = 40
    width: int = 32
    calibration_rtol: float = 0.05
    calibration_evals: int = 24
    resamples: int = 2000

    @classmethod
    def quick(cls) -> Size:
        return cls(
            n_models=6,
            n_iter=2,
            n_batches=1,
            batch=64,
            grid=QUICK_GRID,
            pretrain_epochs=3,
            width=16,
            calibration_rtol=0.3,
            resamples=200,
        )


def key(rho: float) -> str:
    """A radius as a JSON key."""
    return f"{rho:.4g}"


@dataclasses.dataclass
class Failed:
    """A measurement that raised (e.g. an exact geodesic leaving the manifold at a large ρ):
    its value is NaN, left out of τ, and the reason is reported."""

    reason: str
    value: float = math.nan
    first_order_value: float = math.nan


def measure(model, batches, size: Size, seed: int, rho: float, kwargs: dict):
    """``geodesic_sharpness`` with the study's settings, or :class:`Failed` if it raised."""
    from quotientgeo import geodesic_sharpness

    try:
        return geodesic_sharpness(
            model,
            _vit.cross_entropy,
            batches,
            rho=rho,
            n_iter=size.n_iter,
            seed=seed,
            progress=False,
            distributed="off",
            **kwargs,
        )
    except ValueError as err:
        return Failed(f"{kwargs} at rho={rho:.4g}: {err}")


def outcome(result) -> tuple[float, float, str | None]:
    """``(value, first-order value, failure reason or None)`` of a measurement."""
    return result.value, result.first_order_value, getattr(result, "reason", None)


def calibrate(model, batches, size: Size, seed: int, target: float, kwargs: dict) -> dict:
    from quotientgeo import calibrate_rho

    cal = calibrate_rho(
        model,
        _vit.cross_entropy,
        batches,
        target=target,
        low=0.01,
        high=1.0,
        rtol=size.calibration_rtol,
        max_evals=size.calibration_evals,
        progress=False,
        n_iter=size.n_iter,
        seed=seed,
        distributed="off",
        **kwargs,
    )
    return {"rho": cal.rho, "value": cal.value, "evaluations": len(cal.evaluations)}


def median(values) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def best_factor(tau: dict[str, list[float]], grid) -> float:
    """The grid factor where geodesic sharpness predicts best: largest mean ``|τ|`` of inv/mix."""
    score = [
        (abs(tau["geodesic_inv"][i]) + abs(tau["geodesic_mix"][i])) / 2 for i in range(len(grid))
    ]
    score = [v if math.isfinite(v) else -1.0 for v in score]  # τ undefined: constant values
    return grid[max(range(len(grid)), key=lambda i: (score[i], -i))]


def _number(value) -> float:
    """A JSON value back as a float (``None``, written for NaN, becomes NaN)."""
    return math.nan if value is None else float(value)


def scatter_figure(payload: dict, path: Path) -> Path:
    """Sharpness vs gap of the three measures, one row per distinct radius, coloured by the
    members' augmentation."""
    from matplotlib.ticker import NullFormatter

    plt = C.pyplot()
    models, radii = payload["models"], payload["radii"]
    taus = {"fixed": payload["kendall_tau"], "best": payload["kendall_tau_best"]}
    rows: dict[float, list[str]] = {}
    for name, radius in radii.items():
        rows.setdefault(radius["factor"], []).append(name)
    augments = sorted({r["augment"] for r in models})
    fig, axes = plt.subplots(len(rows), 3, figsize=(13, 3.8 * len(rows)), squeeze=False)
    for r, (factor, names) in enumerate(rows.items()):
        name = names[0]
        for c, m in enumerate(MEASURES):
            ax = axes[r][c]
            for augment in augments:
                mine = [k for k in models if k["augment"] == augment]
                x = [_number(k["ablations"][name][m]) for k in mine]
                ax.scatter(x, [k["gap"] for k in mine], s=18, alpha=0.8, label=augment)
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(f"{m.replace('_', ' ')} sharpness (ρ = {radii[name]['rho'][m]:.3g})")
            ax.set_title(
                f"{' = '.join(names)} radius, f = {factor:.3g}: τ = {_number(taus[name][m]):+.2f}"
            )
        axes[r][0].set_ylabel("gap (test - train error)")
    axes[0][0].legend(title="augmentation", fontsize=8)
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, "transformers")
    parser.add_argument("--n-models", type=int, default=None, help="population size (40)")
    parser.add_argument("--n-iter", type=int, default=None, help="Auto-PGD iterations (20)")
    parser.add_argument(
        "--target",
        type=float,
        default=1.0,
        help="loss increase (nats) that calibrates ρ₁ of every measure (1)",
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="local processes sharing the work (2; --quick: 1)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (1)")


def run(args: argparse.Namespace) -> int:
    """Fine-tuned ViT population (§5.3, App. G): Kendall τ across ρ, curvature share, ablations."""
    workers = args.workers or (1 if args.quick else 2)
    if workers > 1 and not C.under_torchrun():
        return C.spawn(run, args, workers)
    t0 = time.perf_counter()
    out = C.out_dir(args)
    cache = out / "models"
    size = Size.quick() if args.quick else Size()
    size = dataclasses.replace(
        size, n_models=args.n_models or size.n_models, n_iter=args.n_iter or size.n_iter
    )
    seed, target, grid = args.seed, args.target, list(size.grid)
    data = _finetune.tasks(seed)
    pre = _finetune.Pretraining(width=size.width, epochs=size.pretrain_epochs, seed=seed)
    configs = _finetune.population(size.n_models, seed, quick=args.quick)
    batches = _finetune.sharpness_batches(data, size.n_batches, size.batch)
    own, shared = balls(), same_ball()
    seconds = {}

    def bar(desc, total):
        return C.progress(None, args=args, desc=desc, total=total)

    with C.Population() as population, C.threads(args.threads):
        args.no_progress = args.no_progress or not population.is_reporter
        share_of = len(population.mine(size.n_models))
        tick = time.perf_counter()
        base = population.map(lambda _: _finetune.pretrained(pre, data, cache), [None])[0]
        with bar("models (fine-tuned or cached)", share_of) as b:
            members = population.map(
                lambda cfg: _finetune.finetuned(cfg, base, pre, data, cache), configs, bar=b
            )
        models = [m for m, _ in members]
        seconds["training"] = time.perf_counter() - tick

        tick = time.perf_counter()
        names = list(own)
        with bar("calibrating ρ₁", len(population.mine(len(names)))) as b:
            found = population.map(
                lambda n: calibrate(models[0], batches, size, seed, target, own[n]), names, bar=b
            )
        calibration = dict(zip(names, found, strict=True))
        rho1 = {n: c["rho"] for n, c in calibration.items()}
        seconds["calibration"] = time.perf_counter() - tick

        def on_grid(model):
            """``{measure: [(value, first-order value, failure) per grid factor]}``."""
            return {
                m: [outcome(measure(model, batches, size, seed, f * rho1[m], own[m])) for f in grid]
                for m in MEASURES
            }

        tick = time.perf_counter()
        with bar("τ(ρ) grid", share_of) as b:
            on_grids = population.map(on_grid, models, bar=b)
        seconds["grid"] = time.perf_counter() - tick
        gap = [metrics["gap"] for _, metrics in members]
        value = {m: [[g[m][i][0] for g in on_grids] for i in range(len(grid))] for m in MEASURES}
        tau = {m: [C.kendall(value[m][i], gap)[0] for i in range(len(grid))] for m in MEASURES}
        radii = {"fixed": FIXED_FACTOR, "best": best_factor(tau, grid)}
        factors = sorted(set(radii.values()))

        def radius_of(row: str, f: float) -> float:
            return f * rho1[shared[row][0] if row in shared else row]

        extra = [n for n in names if n not in MEASURES] + list(shared)

        def ablate(model):
            """``{factor: {row: (value, first-order value, failure)}}`` for the rows the grid
            does not hold."""
            kw = {**own, **{n: k for n, (_, k) in shared.items()}}
            return {
                f: {
                    n: outcome(measure(model, batches, size, seed, radius_of(n, f), kw[n]))
                    for n in extra
                }
                for f in factors
            }

        tick = time.perf_counter()
        with bar(f"ablations at f = {', '.join(f'{f:.3g}' for f in factors)}", share_of) as b:
            ablations = population.map(ablate, models, bar=b)
        seconds["ablations"] = time.perf_counter() - tick
        if not population.is_reporter:
            return 0
        world = population.world

    # ------------------------------------------------------------------ report (rank 0)
    n = size.n_models
    rhos = {m: [f * rho1[m] for f in grid] for m in MEASURES}
    band, pvalue = {}, {}
    for m in MEASURES:
        band[m] = [
            C.kendall_interval(value[m][i], gap, resamples=size.resamples, seed=seed)
            for i in range(len(grid))
        ]
        pvalue[m] = [C.kendall(value[m][i], gap)[1] for i in range(len(grid))]
    med = {m: [median(value[m][i]) for i in range(len(grid))] for m in MEASURES}
    share = {
        m: [
            median((g[m][i][0] - g[m][i][1]) / g[m][i][0] for g in on_grids if g[m][i][0] > 0)
            for i in range(len(grid))
        ]
        for m in ("geodesic_inv", "geodesic_mix")
    }
    C.print_table(
        f"Kendall τ with the gap across ρ ({n} fine-tuned ViTs, {size.n_iter} Auto-PGD "
        f"iterations, {size.n_batches}×{size.batch} training samples; ρ₁: {target:g} nat on "
        "member 0; τ [90 % bootstrap interval]; curvature share (S₂ - S₁)/S₂, median)",
        [
            "ρ/ρ₁",
            *(f"{m} ρ" for m in MEASURES),
            *(f"τ {m}" for m in MEASURES),
            "median S adaptive / inv / mix",
            "share inv / mix",
        ],
        [
            [
                f"{f:.3g}",
                *(f"{rhos[m][i]:.3g}" for m in MEASURES),
                *(
                    f"{tau[m][i]:+.2f} [{band[m][i][0]:+.2f}, {band[m][i][1]:+.2f}]"
                    for m in MEASURES
                ),
                " / ".join(f"{med[m][i]:.3g}" for m in MEASURES),
                " / ".join(f"{share[m][i]:.2f}" for m in share),
            ]
            for i, f in enumerate(grid)
        ],
    )

    def row_value(k: int, row: str, f: float) -> float:
        source = "adaptive" if row == "no_symmetry" else row
        if source in MEASURES:
            return on_grids[k][source][grid.index(f)][0]
        return ablations[k][f][source][0]

    rows = ablation_rows()
    at = {
        name: {row: [row_value(k, row, f) for k in range(n)] for row in rows}
        for name, f in radii.items()
    }
    taus = {name: {row: C.kendall(v, gap) for row, v in at[name].items()} for name in radii}
    radius_info = {
        name: {
            "factor": f,
            "how": "fixed before any τ: the radius where each measure reaches the target on "
            "member 0"
            if name == "fixed"
            else "the grid factor with the largest mean |τ| of geodesic inv and mix",
            "rho": {row: radius_of("adaptive" if row == "no_symmetry" else row, f) for row in rows},
        }
        for name, f in radii.items()
    }
    C.print_table(
        f"Ablations (Kendall τ with the gap; p-value): fixed radius f = {radii['fixed']:.3g}, "
        f"best radius f = {radii['best']:.3g} (ρ = f·ρ₁ of the row's ball)",
        ["row", "ρ fixed", "τ fixed", "p", "ρ best", "τ best", "p"],
        [
            [
                row,
                f"{radius_info['fixed']['rho'][row]:.3g}",
                taus["fixed"][row][0],
                f"{taus['fixed'][row][1]:.1e}",
                f"{radius_info['best']['rho'][row]:.3g}",
                taus["best"][row][0],
                f"{taus['best'][row][1]:.1e}",
            ]
            for row in rows
        ],
    )
    print(
        "paper (Table 1): "
        + "; ".join(
            f"{task}: " + ", ".join(f"{m} {t:+.2f}" for m, t in v.items())
            for task, v in PAPER.items()
        )
    )
    failures = [r for g in on_grids for m in MEASURES for *_, r in g[m] if r] + [
        r for a in ablations for per_row in a.values() for *_, r in per_row.values() if r
    ]
    if failures:
        print(f"{len(failures)} measurement(s) failed (NaN, left out of τ); first: {failures[0]}")
    print(
        f"gaps from {min(gap):.3f} to {max(gap):.3f}; "
        f"{sum(m['cached'] for _, m in members)}/{n} models from the cache"
    )

    def by_rho(m, series):
        return {key(r): C.finite_or_none(v) for r, v in zip(rhos[m], series, strict=True)}

    records = []
    for k, (cfg, (_, metrics)) in enumerate(zip(configs, members, strict=True)):
        records.append(
            {
                **dataclasses.asdict(cfg),
                **metrics,
                **{m: C.finite_or_none(at["fixed"][m][k]) for m in MEASURES},
                "grid": {m: [C.finite_or_none(v) for v, *_ in on_grids[k][m]] for m in MEASURES},
                "grid_first_order": {
                    m: [C.finite_or_none(s) for _, s, _ in on_grids[k][m]] for m in MEASURES
                },
                "ablations": {
                    name: {row: C.finite_or_none(at[name][row][k]) for row in rows}
                    for name in radii
                },
            }
        )
    payload = {
        "command": "transformers",
        "quick": args.quick,
        "seed": seed,
        "n_models": n,
        "n_iter": size.n_iter,
        "sharpness_samples": size.n_batches * size.batch,
        "sharpness_batches": size.n_batches,
        "target_nats": target,
        "calibration": calibration,
        "grid_factors": grid,
        "rho_grid": rhos,
        "tau_by_rho": {m: by_rho(m, tau[m]) for m in MEASURES},
        "tau_interval_by_rho": {
            m: {
                key(r): [C.finite_or_none(v) for v in b]
                for r, b in zip(rhos[m], band[m], strict=True)
            }
            for m in MEASURES
        },
        "p_value_by_rho": {m: by_rho(m, pvalue[m]) for m in MEASURES},
        "median_sharpness_by_rho": {m: by_rho(m, med[m]) for m in MEASURES},
        "curvature_share_by_rho": {m: by_rho(m, share[m]) for m in share},
        "radii": radius_info,
        "kendall_tau": {row: C.finite_or_none(t) for row, (t, _) in taus["fixed"].items()},
        "p_value": {row: C.finite_or_none(p) for row, (_, p) in taus["fixed"].items()},
        "kendall_tau_best": {row: C.finite_or_none(t) for row, (t, _) in taus["best"].items()},
        "p_value_best": {row: C.finite_or_none(p) for row, (_, p) in taus["best"].items()},
        "failures": failures,
        "paper": PAPER,
        "pretrained": base["metrics"],
        "models": records,
        "ranks": world,
        "seconds": {**seconds, "total": time.perf_counter() - t0},
    }
    C.write_json(out / "transformers.json", payload)
    figures(payload, out)
    print(
        f"wrote {out / 'transformers.json'}, {out / 'transformers.png'}, {out / 'tau_by_rho.png'}"
    )
    return 0
