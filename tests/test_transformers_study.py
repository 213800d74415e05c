"""The transformers study's analyse and report steps on synthetic records (no training)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from quotientgeo import Measure
from quotientgeo.experiments import _finetune
from quotientgeo.experiments.transformers import collect, config, records, report
from quotientgeo.experiments.transformers.analyse import analyse

pytest.importorskip("scipy")


def _config():
    args = argparse.Namespace(
        quick=True, seed=0, target=1.0, n_models=None, n_iter=None, threads=1, no_progress=True
    )
    return config.config(args)


def _records(cfg, failed):
    """Six members whose every measurement grows with the gap, except ``failed``."""
    n, rho1 = cfg.size.n_models, {row: 0.5 for row in cfg.calibrated}
    grid = collect.grid_plan(cfg, rho1)
    plan = grid + collect.ablation_plan(cfg, rho1, cfg.size.grid, grid)
    measurements = []
    for k in range(n):
        for i, (row, f, m) in enumerate(plan):
            if (k, row, f) == failed:
                reason = f"{row} at rho={m.rho:.4g}: boom"
                measurements.append(records.Measurement.failed(k, row, f, m, reason))
            else:
                v = (k + 1) * (i + 1) * 1e-3
                measurements.append(records.Measurement(k, row, f, m, v, 0.75 * v))
    recipes = _finetune.population(n, 0, quick=True)
    metrics = [
        {"train_error": 0.0, "test_error": g, "gap": g, "n_train": 100, "cached": True}
        for g in (0.01 * (k + 1) for k in range(n))
    ]
    return records.Records(
        members=[records.Member(r, m) for r, m in zip(recipes, metrics, strict=True)],
        pretrained={"train_error": 0.0},
        calibration={row: records.Calibrated(0.5, 1.0, 3) for row in cfg.calibrated},
        measurements=measurements,
        ranks=1,
        seconds={},
        started=0.0,
    )


def test_rows_are_measures_and_shared_balls():
    cfg = _config()
    assert (
        cfg.measures["no_symmetry"] == cfg.measures["adaptive"] == Measure.adaptive(1.0, n_iter=2)
    )
    assert cfg.measures["exact_inv"] == cfg.measures["geodesic_inv"].replace(perturbation="exact")
    assert cfg.ball["first_order_mix"] == "geodesic_mix"
    assert cfg.measures["spectrum_s0.5"].metric == 0.5
    assert cfg.calibrated[:3] == ["adaptive", "geodesic_inv", "norm_adaptive_inv"]


def test_a_failed_measurement_is_left_out_of_tau_and_reported(tmp_path):
    cfg = _config()
    a = analyse(cfg, _records(cfg, failed=(2, "exact_inv", 1.0)))
    assert a.radii == {"fixed": 1.0, "best": cfg.size.grid[0]}  # τ = 1 everywhere: the first
    assert a.failures == ["exact_inv at rho=0.5: boom"]
    assert math.isnan(a.at["fixed"]["exact_inv"][2])
    assert a.kendall["fixed"]["exact_inv"][0] == pytest.approx(1.0)  # over the other 5
    assert a.at["best"]["no_symmetry"] == a.at["best"]["adaptive"]
    assert a.share["geodesic_inv"] == pytest.approx([0.25] * len(cfg.size.grid))
    payload = report.payload(cfg, a)
    json.dumps(payload, allow_nan=False)
    assert payload["models"][2]["ablations"]["fixed"]["exact_inv"] is None
    assert payload["failures"] == a.failures
    assert payload["radii"]["fixed"]["rho"]["exact_inv"] == 0.5
