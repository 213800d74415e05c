r"""``quotientgeo reproduce sam``: SAM, ASAM and geodesic SAM under label noise.

The small-ViT task of the transformer study (:class:`._vit.DigitsViT` on scikit-learn's digits,
AdamW with cosine decay) with a fraction η of the training and validation labels replaced by
a uniformly drawn other class; test labels are clean. Every method steps the same AdamW
(:mod:`quotientgeo.optim.training`): AdamW alone, SAM, ASAM and geodesic SAM with the mix and
inv metrics. Per method and η, ``ρ`` is the point of a fixed grid with the best accuracy on
the *noisy* validation split (a user with noisy data has no clean one); ``--seeds`` new seeds
are then trained with it and evaluated on the test split. Method A *beats* B at η when the
difference of mean test accuracies exceeds twice its standard error
``√(s_A²/n + s_B²/n)``; Welch's t-test p-values are reported beside it. Time per step
relative to SAM is measured with the contenders interleaved
(:func:`quotientgeo.bench.sam.step_times`, as in ``quotientgeo bench sam``).

``config`` → ``collect`` (training runs split over ``--workers`` processes) → ``analyse`` →
``report``: ``sam.json`` (``test_accuracy_by_noise``: ``{η: {method: [per seed]}}``,
``rho_by_noise``: ``{η: {method: ρ}}``, ``validation_accuracy_by_noise``, ``comparisons``,
``step_time_over_sam``; ``test_accuracy``, ``rho_chosen`` and ``validation_accuracy`` are the
η = 0 entries) and ``sam.png`` (test accuracy against η per method; time per step).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from quotientgeo.optim.training import METHODS, make_optimizer, train_step

from . import _common as C
from . import _vit
from .bench.sam import step_times
from .pipeline import Study, add_workers_argument, run_with_workers

NOISE = (0.0, 0.2, 0.4)
#: the ρ grid of each SAM-type method (ASAM's adaptive ball is larger at equal ρ)
RHO_GRID = {
    "sam": (0.003, 0.01, 0.03, 0.1, 0.3),
    "asam": (0.01, 0.03, 0.1, 0.3, 1.0),
    "geodesic_mix": (0.003, 0.01, 0.03, 0.1, 0.3),
    "geodesic_inv": (0.003, 0.01, 0.03, 0.1, 0.3),
}
GEODESIC = ("geodesic_mix", "geodesic_inv")


@dataclass(frozen=True)
class Setting:
    """Data and training settings shared by every run."""

    n_train: int
    n_val: int
    width: int
    epochs: int
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.05


@dataclass(frozen=True)
class Config:
    """Everything that decides the result."""

    setting: Setting
    noise: tuple[float, ...]
    grid: dict[str, tuple[float, ...]]
    seeds: int
    rounds: int
    seed: int
    quick: bool
    progress: bool


@dataclass(frozen=True)
class Run:
    """One training run: ``method`` at radius ``rho`` (``None`` for AdamW) on labels with noise
    fraction ``noise``, seed ``seed``, evaluated on ``split`` (``"validation"`` or ``"test"``)."""

    method: str
    noise: float
    rho: float | None
    seed: int
    split: str


@dataclass(frozen=True)
class Records:
    """Every run's accuracy, the chosen radii and the step-time ratios."""

    validation: dict[Run, float]
    test: dict[Run, float]
    chosen: dict[float, dict[str, float]]
    step_ratios: dict[str, float]
    started: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class Comparison:
    """Mean test accuracy of ``a`` minus that of ``b``, its standard error, the 2-SE verdict and
    Welch's t-test p-value (two-sided)."""

    a: str
    b: str
    difference: float
    standard_error: float
    beats: bool
    p_value: float


@dataclass(frozen=True)
class Analysis:
    records: Records
    test: dict[float, dict[str, list[float]]]
    comparisons: dict[float, list[Comparison]]


# ---------------------------------------------------------------------- data and training
def with_label_noise(y: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """``y`` with ``round(fraction · len(y))`` labels, drawn uniformly, replaced by a uniformly
    drawn *other* class of the 10."""
    y = y.clone()
    k = round(fraction * len(y))
    idx = torch.randperm(len(y), generator=gen)[:k]
    y[idx] = (y[idx] + torch.randint(1, 10, (k,), generator=gen)) % 10
    return y


def splits(setting: Setting, noise: float, seed: int) -> dict[str, torch.Tensor]:
    """Train / validation / test digits; the validation split is cut from the training data and
    both carry label noise ``noise`` (one draw per ``(seed, noise)``); test labels are clean."""
    data = _vit.load_digits_split(setting.n_train + setting.n_val, seed)
    x, y = data["x_train"], data["y_train"]
    gen = torch.Generator().manual_seed(seed * 1000 + round(noise * 100))
    n = setting.n_train
    return {
        "x_train": x[:n],
        "y_train": with_label_noise(y[:n], noise, gen),
        "x_val": x[n:],
        "y_val": with_label_noise(y[n:], noise, gen),
        "x_test": data["x_test"],
        "y_test": data["y_test"],
    }


def train(method: str, rho: float | None, setting: Setting, data, seed: int):
    """A DigitsViT trained with ``method``; returns it in eval mode."""
    torch.manual_seed(seed)
    model = _vit.DigitsViT(setting.width)
    opt = make_optimizer(method, model, rho, lr=setting.lr, weight_decay=setting.weight_decay)
    x, y = data["x_train"], data["y_train"]
    steps = setting.epochs * math.ceil(len(y) / setting.batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(setting.epochs):
        for idx in torch.randperm(len(y), generator=gen).split(setting.batch_size):
            train_step(method, model, opt, x[idx], y[idx])
            schedule.step()
    model.eval()
    return model


def accuracy(run: Run, config: Config) -> float:
    """Train ``run`` and return its accuracy on its split."""
    data = splits(config.setting, run.noise, config.seed)
    with C.threads(1):
        model = train(run.method, run.rho, config.setting, data, run.seed)
        split = "val" if run.split == "validation" else "test"
        return 1.0 - _vit.error(model, data[f"x_{split}"], data[f"y_{split}"])


# ---------------------------------------------------------------------- the four steps
def config(args: argparse.Namespace) -> Config:
    quick = args.quick
    if args.seeds < 2:
        raise ValueError(f"--seeds must be at least 2 (a spread is compared), got {args.seeds}")
    setting = Setting(
        n_train=200 if quick else 700,
        n_val=100 if quick else 300,
        width=16 if quick else 32,
        epochs=2 if quick else args.epochs,
    )
    return Config(
        setting=setting,
        noise=(0.0, 0.4) if quick else NOISE,
        grid={m: g[:2] if quick else g for m, g in RHO_GRID.items()},
        seeds=2 if quick else args.seeds,
        rounds=2 if quick else args.rounds,
        seed=args.seed,
        quick=quick,
        progress=not args.no_progress,
    )


def _map(population: C.Population, runs: list[Run], config: Config, desc: str) -> dict[Run, float]:
    enabled = config.progress and population.is_reporter
    with C.counter(desc, len(population.mine(len(runs))), enabled=enabled) as bar:
        values = population.map(lambda r: accuracy(r, config), runs, bar=bar)
    return dict(zip(runs, values, strict=True))


def collect(config: Config, population: C.Population, out: Path) -> Records:
    """Validation runs on every grid point, the choice of ``ρ``, then the test seeds."""
    started = time.perf_counter()
    validation = _map(
        population,
        [
            Run(m, eta, rho, 10_000, "validation")
            for eta in config.noise
            for m, grid in config.grid.items()
            for rho in grid
        ],
        config,
        "choosing ρ (validation runs)",
    )
    chosen = {
        eta: {
            m: max(
                grid, key=lambda r, m=m, eta=eta: validation[Run(m, eta, r, 10_000, "validation")]
            )
            for m, grid in config.grid.items()
        }
        for eta in config.noise
    }
    test = _map(
        population,
        [
            Run(m, eta, chosen[eta].get(m), s, "test")
            for eta in config.noise
            for m in METHODS
            for s in range(config.seeds)
        ],
        config,
        "training (test seeds)",
    )
    ratios: dict[str, float] = {}
    if population.is_reporter:
        s = config.setting
        data = splits(s, 0.0, config.seed)
        x, y = data["x_train"][: s.batch_size], data["y_train"][: s.batch_size]
        with C.threads(1):
            _, ratios = step_times(
                lambda: _vit.DigitsViT(s.width),
                x,
                y,
                chosen[config.noise[0]],
                rounds=config.rounds,
                lr=s.lr,
                weight_decay=s.weight_decay,
            )
    return Records(validation, test, chosen, ratios, started)


def compare(a: str, b: str, test: dict[str, list[float]]) -> Comparison:
    """``a`` against ``b`` by the 2-SE rule, with Welch's t-test (module docstring)."""
    from scipy import stats

    xa, xb = test[a], test[b]
    difference = statistics.mean(xa) - statistics.mean(xb)
    se = math.sqrt(statistics.variance(xa) / len(xa) + statistics.variance(xb) / len(xb))
    p = float("nan")  # no spread: no test
    if se > 0:
        p = float(cast("tuple[float, float]", stats.ttest_ind(xa, xb, equal_var=False))[1])
    return Comparison(a, b, difference, se, difference > 2 * se, p)


def analyse(config: Config, records: Records) -> Analysis:
    test = {
        eta: {
            m: [
                records.test[Run(m, eta, records.chosen[eta].get(m), s, "test")]
                for s in range(config.seeds)
            ]
            for m in METHODS
        }
        for eta in config.noise
    }
    comparisons = {}
    for eta, accs in test.items():
        best = max(("sam", "asam"), key=lambda m, a=accs: statistics.mean(a[m]))
        comparisons[eta] = [
            compare("sam", "adamw", accs),
            compare("asam", "adamw", accs),
            *(compare(g, best, accs) for g in GEODESIC),
        ]
    return Analysis(records, test, comparisons)


def _key(eta: float) -> str:
    return f"{eta:g}"


def report(config: Config, analysis: Analysis, out: Path) -> dict[str, Any]:
    rec = analysis.records
    for eta in config.noise:
        accs = analysis.test[eta]
        C.print_table(
            f"label noise η = {eta:g}: small ViT on digits, AdamW base, {config.seeds} seeds; "
            "ρ chosen on the noisy validation split",
            ["method", "ρ", "test accuracy (mean ± std)", "time/step ÷ SAM"],
            [
                (
                    m,
                    "—" if m not in rec.chosen[eta] else f"{rec.chosen[eta][m]:g}",
                    f"{statistics.mean(a):.4f} ± {statistics.stdev(a):.4f}",
                    f"{rec.step_ratios[m]:.2f}",
                )
                for m, a in accs.items()
            ],
        )
        for c in analysis.comparisons[eta]:
            verdict = "beats" if c.beats else "does not beat"
            print(
                f"  {c.a} {verdict} {c.b}: {c.difference:+.4f} (2·SE {2 * c.standard_error:.4f}, "
                f"Welch p = {c.p_value:.3g})"
            )
    validation = {
        _key(eta): {
            m: {_key(r): rec.validation[Run(m, eta, r, 10_000, "validation")] for r in grid}
            for m, grid in config.grid.items()
        }
        for eta in config.noise
    }
    test = {_key(eta): analysis.test[eta] for eta in config.noise}
    rho = {_key(eta): rec.chosen[eta] for eta in config.noise}
    clean = _key(config.noise[0])
    payload = {
        "quick": config.quick,
        "setting": asdict(config.setting),
        "noise": list(config.noise),
        "seeds": config.seeds,
        "validation_seeds": 1,
        "rho_grid": {m: list(g) for m, g in config.grid.items()},
        "validation_accuracy_by_noise": validation,
        "rho_by_noise": rho,
        "test_accuracy_by_noise": test,
        "comparisons": {
            _key(eta): [{**asdict(c), "p_value": C.finite_or_none(c.p_value)} for c in cs]
            for eta, cs in analysis.comparisons.items()
        },
        "validation_accuracy": validation[clean],
        "rho_chosen": rho[clean],
        "test_accuracy": test[clean],
        "step_time_over_sam": rec.step_ratios,
        "seconds": time.perf_counter() - rec.started,
    }
    C.write_json(out / "sam.json", payload)
    figure(config, analysis, out / "sam.png")
    print(f"wrote {out / 'sam.json'} and {out / 'sam.png'}")
    return payload


STUDY = Study(config, collect, analyse, report)
"""The study (:class:`~.pipeline.Study`): :class:`Config` and this module's functions."""


def figure(config: Config, analysis: Analysis, path: Path) -> None:
    plt = C.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), width_ratios=(3, 2))
    names = list(METHODS)
    offsets = torch.linspace(-0.012, 0.012, len(names)).tolist()
    for i, m in enumerate(names):
        etas = [eta + offsets[i] for eta in config.noise]
        values = [analysis.test[eta][m] for eta in config.noise]
        for x, v in zip(etas, values, strict=True):
            left.scatter([x] * len(v), v, color=f"C{i}", s=8, alpha=0.4)
        means = [statistics.mean(v) for v in values]
        sds = [statistics.stdev(v) for v in values]
        left.errorbar(etas, means, yerr=sds, fmt="-o", color=f"C{i}", capsize=3, label=m, ms=4)
    left.set_xlabel("label noise η (training and validation labels)")
    left.set_ylabel("clean test accuracy")
    left.set_xticks(list(config.noise))
    left.legend(fontsize=8)
    left.set_title(f"test accuracy ({config.seeds} seeds, mean ± std)")
    ratios = analysis.records.step_ratios
    right.bar(range(len(names)), [ratios[m] for m in names], color=[f"C{i}" for i in range(5)])
    right.axhline(1.15, color="k", ls="--", lw=1, label="target for geodesic SAM")
    right.set_xticks(range(len(names)), names, fontsize=7, rotation=20)
    right.set_ylabel("time per step ÷ SAM")
    right.legend(fontsize=8)
    right.set_title("time per training step")
    C.save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, "sam")
    parser.add_argument("--seeds", type=int, default=5, help="test seeds per method and η (5)")
    parser.add_argument("--epochs", type=int, default=60, help="training epochs (60)")
    parser.add_argument("--rounds", type=int, default=20, help="timing rounds (20)")
    add_workers_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Test accuracy under label noise and time per step of AdamW, SAM, ASAM, geodesic SAM."""
    return run_with_workers(run, STUDY, args)
