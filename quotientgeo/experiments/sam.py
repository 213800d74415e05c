r"""``quotientgeo reproduce sam``: training with SAM, ASAM and geodesic SAM on the small-ViT task.

The task of the transformer study (:class:`._vit.DigitsViT` on scikit-learn's digits, AdamW with
cosine decay) is trained with AdamW alone and with :class:`quotientgeo.optim.GeodesicSAM`
around the same AdamW in four variants: SAM, ASAM, geodesic SAM with the mix metric and with
the inv metric. For each variant ``ρ`` is chosen from a small grid by the mean validation
accuracy of ``--val-seeds`` runs (the validation split is carved out of the training data; the
test split is never looked at for the choice); then ``--seeds`` fresh seeds are trained with
the chosen ``ρ`` and evaluated on the test split. Time per step relative to SAM is measured
separately, with the contenders interleaved (:func:`quotientgeo.bench.sam.step_times`, as in
``quotientgeo bench sam``).

Writes ``sam.json`` (``test_accuracy``: ``{method: [per-seed values]}``,
``step_time_over_sam``: ``{method: ratio}``, the grids, validation accuracies and chosen radii)
and ``sam.png``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass

import torch

from ..bench.sam import step_times
from ..optim.training import METHODS, make_optimizer, train_step
from . import _common as C
from . import _vit

# the ρ grid of each SAM-type method
RHO_GRID = {
    "sam": (0.003, 0.01, 0.03, 0.1),
    "asam": (0.01, 0.03, 0.1, 0.3),
    "geodesic_mix": (0.003, 0.01, 0.03, 0.1),
    "geodesic_inv": (0.003, 0.01, 0.03, 0.1),
}


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


def splits(setting: Setting, seed: int) -> dict[str, torch.Tensor]:
    """Train / validation / test digits (the validation split is cut from the training data)."""
    data = _vit.load_digits_split(setting.n_train + setting.n_val, seed)
    x, y = data["x_train"], data["y_train"]
    return {
        "x_train": x[: setting.n_train],
        "y_train": y[: setting.n_train],
        "x_val": x[setting.n_train :],
        "y_val": y[setting.n_train :],
        "x_test": data["x_test"],
        "y_test": data["y_test"],
    }


def optimizer(method: str, model, rho: float | None, setting: Setting):
    return make_optimizer(method, model, rho, lr=setting.lr, weight_decay=setting.weight_decay)


def train(method: str, rho: float | None, setting: Setting, data, seed: int):
    """A DigitsViT trained with ``method``; returns it in eval mode."""
    torch.manual_seed(seed)
    model = _vit.DigitsViT(setting.width)
    opt = optimizer(method, model, rho, setting)
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


def accuracy(model, x, y) -> float:
    return 1.0 - _vit.error(model, x, y)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, "sam")
    parser.add_argument("--seeds", type=int, default=5, help="test seeds per method (5)")
    parser.add_argument(
        "--val-seeds", type=int, default=2, help="seeds per ρ for the validation choice (2)"
    )
    parser.add_argument("--epochs", type=int, default=30, help="training epochs (30)")
    parser.add_argument("--rounds", type=int, default=20, help="timing rounds (20)")


def run(args: argparse.Namespace) -> int:
    """Test accuracy and time per step of AdamW, SAM, ASAM and geodesic SAM (mix, inv)."""
    t0 = time.perf_counter()
    out = C.out_dir(args)
    quick = args.quick
    setting = Setting(
        n_train=200 if quick else 700,
        n_val=100 if quick else 300,
        width=16 if quick else 32,
        epochs=2 if quick else args.epochs,
    )
    seeds = 2 if quick else args.seeds
    val_seeds = 1 if quick else args.val_seeds
    grid = {m: g[:2] if quick else g for m, g in RHO_GRID.items()}
    data = splits(setting, args.seed)
    jobs = [(m, r, s) for m, g in grid.items() for r in g for s in range(val_seeds)]
    validation: dict[str, dict[float, list[float]]] = {m: {} for m in grid}
    with C.threads(1):
        for method, rho, s in C.progress(jobs, args=args, desc="choosing ρ (validation)"):
            model = train(method, rho, setting, data, seed=10_000 + s)
            acc = accuracy(model, data["x_val"], data["y_val"])
            validation[method].setdefault(rho, []).append(acc)
        chosen = {
            m: max(accs, key=lambda r, a=accs: statistics.mean(a[r]))
            for m, accs in validation.items()
        }
        test: dict[str, list[float]] = {m: [] for m in METHODS}
        final = [(m, s) for m in METHODS for s in range(seeds)]
        for method, s in C.progress(final, args=args, desc="training (test seeds)"):
            model = train(method, chosen.get(method), setting, data, seed=s)
            test[method].append(accuracy(model, data["x_test"], data["y_test"]))
        x, y = data["x_train"][: setting.batch_size], data["y_train"][: setting.batch_size]
        _, ratios = step_times(
            lambda: _vit.DigitsViT(setting.width),
            x,
            y,
            chosen,
            rounds=2 if quick else args.rounds,
            lr=setting.lr,
            weight_decay=setting.weight_decay,
        )
    rows = [
        (
            m,
            "—" if m not in chosen else f"{chosen[m]:g}",
            f"{statistics.mean(a):.4f} ± {statistics.stdev(a) if len(a) > 1 else 0.0:.4f}",
            f"{ratios[m]:.2f}",
        )
        for m, a in test.items()
    ]
    C.print_table(
        f"small ViT on digits, AdamW base, {seeds} seeds; ρ chosen on validation",
        ["method", "ρ", "test accuracy (mean ± std)", "time/step ÷ SAM"],
        rows,
    )
    payload = {
        "quick": quick,
        "setting": setting.__dict__,
        "seeds": seeds,
        "val_seeds": val_seeds,
        "rho_grid": {m: list(g) for m, g in grid.items()},
        "validation_accuracy": {
            m: {f"{r:g}": statistics.mean(a) for r, a in accs.items()}
            for m, accs in validation.items()
        },
        "rho_chosen": chosen,
        "test_accuracy": test,
        "step_time_over_sam": ratios,
        "seconds": time.perf_counter() - t0,
    }
    C.write_json(out / "sam.json", payload)
    _figure(test, ratios, chosen, out)
    print(f"wrote {out / 'sam.json'} and {out / 'sam.png'}")
    return 0


def _figure(test, ratios, chosen, out) -> None:
    plt = C.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = list(test)
    for i, m in enumerate(names):
        values = test[m]
        left.scatter([i] * len(values), values, color="0.6", s=12, zorder=2)
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        left.errorbar(i, statistics.mean(values), yerr=sd, fmt="o", color="C0", capsize=4)
    labels = [m if m not in chosen else f"{m}\nρ={chosen[m]:g}" for m in names]
    left.set_xticks(range(len(names)), labels, fontsize=8)
    left.set_ylabel("test accuracy")
    left.set_title("test accuracy (seeds, mean ± std)")
    right.bar(range(len(names)), [ratios[m] for m in names], color="C1")
    right.axhline(1.15, color="k", ls="--", lw=1, label="target for geodesic SAM")
    right.set_xticks(range(len(names)), names, fontsize=8)
    right.set_ylabel("time per step ÷ SAM")
    right.legend(fontsize=8)
    right.set_title("time per training step")
    C.save_figure(fig, out / "sam.png")
