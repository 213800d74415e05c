"""The LoRA study's report: the accuracy and τ tables, ``lora.json`` and ``lora.png``."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from .. import _common as C
from .analyse import AXES, Analysis, Comparison
from .config import MEASURES, Config
from .figures import figure, key
from .model import SCOPES


def _cell(mean: float, sd: float) -> str:
    return f"{mean:.3f} ± {sd:.3f}" if sd == sd else f"{mean:.3f}"  # sd is NaN for one seed


def _difference(c: Comparison) -> str:
    se = c.standard_error
    return f"{c.difference:+.3f}" + (f" ± {se:.3f}" if se == se else "") + (" *" if c.beats else "")


def print_accuracy(config: Config, a: Analysis) -> None:
    """Test accuracy per arm and learning rate (``*``: beats AdamW there), and robustness."""
    grid, n = config.size.learning_rates, config.size.replicates
    rows = []
    for arm in config.arms:
        marks = [c.beats for c in a.per_lr[arm]] if arm in a.per_lr else [False] * len(grid)
        r = a.robustness[arm]
        worst = a.worst.get(arm)
        rows.append(
            [
                arm,
                *(
                    _cell(s.mean, s.sd) + (" *" if mark else "")
                    for s, mark in zip(a.accuracy[arm], marks, strict=True)
                ),
                f"{r.worst:.3f} ({r.worst_lr:.2g})",
                f"{r.range:.3f}",
                "—" if worst is None else _difference(worst),
            ]
        )
    C.print_table(
        f"Test accuracy (mean ± sd over {n} replicate(s); * beats AdamW by more than 2 standard "
        f"errors); worst learning rate, range over the grid, worst against AdamW's worst",
        ["optimizer", *(f"lr {lr:.2g}" for lr in grid), "worst (lr)", "range", "worst − AdamW's"],
        rows,
    )


def print_tau(config: Config, a: Analysis) -> None:
    """τ, band, p-value, granulated τ and Ψ of every measure in both scopes, then failures."""
    rows = []
    for where in SCOPES:
        for name in MEASURES:
            t = a.tau[where, name]
            rho = a.records.calibration[where, name].rho
            rows.append(
                [
                    where,
                    name,
                    f"{rho:.3g}",
                    f"{t.tau:+.2f} [{t.band[0]:+.2f}, {t.band[1]:+.2f}]",
                    f"{t.p_value:.1e}",
                    *(t.granulated[x] for x in (*AXES, "psi")),
                    t.reason or "",
                ]
            )
    size = config.size
    C.print_table(
        f"Kendall τ with the gap ({len(a.gap)} members; {size.n_iter} Auto-PGD iterations, "
        f"{size.n_batches}×{size.batch} training samples, {size.measure_dtype}; ρ₁: "
        f"{config.target:g} nat on the reference member; τ [90 % bootstrap band]; granulated τ "
        "per axis and Ψ)",
        ["scope", "measure", "ρ₁", "τ [band]", "p", *(f"τ {x}" for x in AXES), "Ψ", "undefined"],
        rows,
    )
    if a.failures:
        print(
            f"{len(a.failures)} measurement(s) failed (NaN, left out of τ); first: {a.failures[0]}"
        )
    cached = sum(m.metrics["cached"] for m in a.records.members)
    diverged = sum(m.metrics["diverged"] for m in a.records.members)
    print(
        f"gaps from {min(a.gap):.3f} to {max(a.gap):.3f}; {diverged} member(s) diverged; "
        f"{cached}/{len(a.gap)} members from the cache"
    )


def _comparison(c: Comparison) -> dict[str, Any]:
    return {
        "difference": c.difference,
        "standard_error": C.finite_or_none(c.standard_error),
        "beats": c.beats,
        "p_value": C.finite_or_none(c.p_value),
    }


def payload(config: Config, a: Analysis) -> dict[str, Any]:
    """``lora.json`` (its fields: ``docs/reproductions.md``)."""
    records, grid = a.records, config.size.learning_rates

    def per_ball(fn) -> dict[str, dict[str, Any]]:
        return {where: {name: fn(where, name) for name in MEASURES} for where in SCOPES}

    models = []
    for k, member in enumerate(records.members):
        models.append(
            {
                **dataclasses.asdict(member.recipe),
                **member.metrics,
                "sharpness": per_ball(lambda w, n, k=k: C.finite_or_none(a.values[w, n][k])),
            }
        )
    reference = records.members[records.reference].recipe
    return {
        "command": "lora",
        "quick": config.quick,
        "seed": config.seed,
        "optimizers": list(config.arms),
        "learning_rates": list(grid),
        "replicates": config.size.replicates,
        "training": dataclasses.asdict(config.training),
        "size": dataclasses.asdict(config.size),
        "target_nats": config.target,
        "reference": dataclasses.asdict(reference),
        "accuracy": {
            arm: {
                key(lr): {
                    "mean": s.mean,
                    "sd": C.finite_or_none(s.sd),
                    "per_replicate": s.values,
                }
                for lr, s in zip(grid, a.accuracy[arm], strict=True)
            }
            for arm in config.arms
        },
        "robustness": {arm: dataclasses.asdict(r) for arm, r in a.robustness.items()},
        "against_adamw": {
            arm: {
                "per_learning_rate": {
                    key(c.lr): _comparison(c) for c in a.per_lr[arm] if c.lr is not None
                },
                "worst": _comparison(a.worst[arm]),
            }
            for arm in a.per_lr
        },
        "calibration": per_ball(lambda w, n: dataclasses.asdict(records.calibration[w, n])),
        "geometry": records.geometry,
        "kendall_tau": per_ball(lambda w, n: C.finite_or_none(a.tau[w, n].tau)),
        "p_value": per_ball(lambda w, n: C.finite_or_none(a.tau[w, n].p_value)),
        "tau_interval": per_ball(lambda w, n: [C.finite_or_none(v) for v in a.tau[w, n].band]),
        "granulated_tau": per_ball(
            lambda w, n: {x: C.finite_or_none(v) for x, v in a.tau[w, n].granulated.items()}
        ),
        "tau_undefined": {
            where: {
                name: a.tau[where, name].reason for name in MEASURES if a.tau[where, name].reason
            }
            for where in SCOPES
        },
        "failures": a.failures,
        "pretrained": records.pretrained,
        "models": models,
        "ranks": records.ranks,
        "seconds": {**records.seconds, "total": time.perf_counter() - records.started},
    }


def report(config: Config, analysis: Analysis, out: Path) -> dict[str, Any]:
    """Print both tables, write ``lora.json`` and ``lora.png``; returns the JSON payload."""
    print_accuracy(config, analysis)
    print_tau(config, analysis)
    data = payload(config, analysis)
    C.write_json(out / "lora.json", data)
    figure(data, out / "lora.png")
    print(f"wrote {out / 'lora.json'}, {out / 'lora.png'}")
    return data
