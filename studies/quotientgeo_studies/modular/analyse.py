"""Statistics of the modular study from its records only: Kendall τ with bands and p-values,
the granulated coefficient Ψ, τ(ρ) and the curvature share; the result is the JSON payload."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from .. import _common as C
from ..transformers.config import PAPER
from .collect import Records, gap_spread
from .config import AXES, FIXED_FACTOR, GEODESIC, SWEPT, Config


def analyse(config: Config, records: Records | None) -> dict[str, Any] | None:
    """Every statistic of the report, as the JSON payload's fields; None after ``--gaps-only``
    (no records)."""
    if records is None:
        return None
    size, gap = config.size, [m["gap"] for m in records.metrics]
    members = [
        {"fraction": r.fraction, "weight_decay": r.weight_decay, "seed": r.seed}
        for r in records.recipes
    ]

    def column(row: str, f: float) -> list[float]:
        return [v[row, f].value for v in records.values]

    def band(values: list[float]) -> list[float]:
        lo, hi = C.kendall_interval(values, gap, resamples=size.resamples, seed=config.seed)
        return [lo, hi]

    def share(row: str, f: float) -> float:
        s = [
            (c.value - c.first_order) / c.value
            for c in (v[row, f] for v in records.values)
            if c.value > 0 and math.isfinite(c.first_order)
        ]
        return statistics.median(s) if s else math.nan

    def key(f: float) -> str:
        return f"{f:.3g}"

    fixed = {row: column(row, FIXED_FACTOR) for row in config.measures}
    kendall = {row: C.kendall(v, gap) for row, v in fixed.items()}
    sweep = {row: {key(f): column(row, f) for f in size.grid} for row in SWEPT}
    sweep_tau = {row: {k: C.kendall(v, gap) for k, v in s.items()} for row, s in sweep.items()}
    none = C.finite_or_none
    return {
        "command": "modular",
        "quick": config.quick,
        "seed": config.seed,
        "task": {
            "operation": "(a + b) mod p",
            "p": size.p,
            "steps": size.steps,
            "width": size.width,
            "optimizer": f"AdamW, full batch, constant lr {size.lr:g}, betas (0.9, 0.98)",
        },
        "axes": {
            "fraction": list(size.fractions),
            "weight_decay": list(size.weight_decays),
            "seeds": size.seeds,
        },
        "n_models": len(gap),
        "n_iter": size.n_iter,
        "measure_dtype": size.measure_dtype,
        "n_samples_average": size.n_samples,
        "sharpness_samples": size.n_batches * size.batch,
        "target_nats": config.target,
        **{k: v if isinstance(v, int) else none(v) for k, v in gap_spread(records.metrics).items()},
        "calibration": records.calibration,
        "grid_factors": list(size.grid),
        "rho": {
            row: (
                none(config.measure(row, FIXED_FACTOR, records.rho1).rho)
                if config.ball[row]
                else None
            )
            for row in config.measures
        },
        "kendall_tau": {row: none(t) for row, (t, _) in kendall.items()},
        "p_value": {row: none(p) for row, (_, p) in kendall.items()},
        "kendall_interval": {row: [none(b) for b in band(v)] for row, v in fixed.items()},
        "granulated_tau": {
            row: {k: none(t) for k, t in C.granulated_tau(v, gap, members, AXES).items()}
            for row, v in fixed.items()
        },
        "tau_by_rho": {
            row: {k: none(t) for k, (t, _) in s.items()} for row, s in sweep_tau.items()
        },
        "p_value_by_rho": {
            row: {k: none(p) for k, (_, p) in s.items()} for row, s in sweep_tau.items()
        },
        "tau_interval_by_rho": {
            row: {k: [none(b) for b in band(v)] for k, v in s.items()} for row, s in sweep.items()
        },
        "median_sharpness_by_rho": {
            row: {k: none(statistics.median(v)) for k, v in s.items()} for row, s in sweep.items()
        },
        "curvature_share_by_rho": {
            row: {key(f): none(share(row, f)) for f in size.grid} for row in GEODESIC
        },
        "failures": [v.failure for vs in records.values for v in vs.values() if v.failure],
        "paper": PAPER,
        "models": [
            {
                **members[k],
                **records.metrics[k],
                "values": {row: none(v[k]) for row, v in fixed.items()},
                "grid": {row: {kf: none(v[k]) for kf, v in s.items()} for row, s in sweep.items()},
            }
            for k in range(len(gap))
        ],
        "ranks": records.ranks,
        "seconds": {**records.seconds, "total": time.perf_counter() - records.started},
    }
