"""The transformers study's analyse and report steps on synthetic records (no training)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from quotientgeo import Measure
from quotientgeo_studies import _finetune
from quotientgeo_studies.transformers import collect, config, records, report
from quotientgeo_studies.transformers.analyse import analyse

pytest.importorskip("scipy")


def _config(population="random"):
    args = argparse.Namespace(
        quick=True,
        seed=0,
        target=1.0,
        n_models=None,
        n_iter=None,
        threads=1,
        no_progress=True,
        population=population,
        seeds=None,
    )
    return config.config(args)


def _records(cfg, failed, gaps=None):
    """The members of ``cfg`` whose every measurement grows with the gap (``gaps``, by default
    increasing with the member), except ``failed``."""
    n, rho1 = cfg.size.n_models, {row: 0.5 for row in cfg.calibrated}
    gaps = gaps or [0.01 * (k + 1) for k in range(n)]
    rank = sorted(range(n), key=lambda k: gaps[k])
    grid = collect.grid_plan(cfg, rho1)
    plan = grid + collect.ablation_plan(cfg, rho1, cfg.size.grid, grid)
    measurements = []
    for k in range(n):
        for i, (row, f, m) in enumerate(plan):
            if (k, row, f) == failed:
                reason = f"{row} at rho={m.rho:.4g}: boom"
                measurements.append(records.Measurement.failed(k, row, f, m, reason))
            else:
                v = (rank.index(k) + 1) * (i + 1) * 1e-3
                measurements.append(records.Measurement(k, row, f, m, v, 0.75 * v))
    recipes = cfg.recipes()
    metrics = [
        {
            "train_error": 0.0,
            "test_error": 0.1 + g,
            "gap": g,
            "n_train": 100,
            "n_test": 500,
            "cached": True,
        }
        for g in gaps
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
    assert cfg.ball["relative_flatness"] is None and "relative_flatness" not in cfg.calibrated
    assert cfg.measure("relative_flatness", 3.0, {}) == Measure.relative_flatness("head")
    assert cfg.measures["average"] == Measure.average(
        1.0, perturbation="first_order", norm="adaptive", symmetries=None, n_samples=4
    )
    assert cfg.ball["average"] == "average"
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


def test_grid_population_statistics(tmp_path):
    """Granulated τ and Ψ on the grid, gap spread over noise, only the fixed radius."""
    cfg = _config("grid")
    recipe = cfg.recipe
    assert cfg.size.n_models == len(recipe.noise) * len(recipe.sizes) * recipe.seeds
    # gaps: up with the noise, down with the size; every measure follows the gap exactly
    gaps = [0.1 * r.label_noise - 0.02 * r.subset for r in cfg.recipes()]
    a = analyse(cfg, _records(cfg, failed=None, gaps=gaps))
    assert a.radii == {"fixed": 1.0}
    for row in cfg.measures:
        assert a.granulated[row] == {
            "label_noise": pytest.approx(1.0),
            "subset": pytest.approx(1.0),
            "psi": pytest.approx(1.0),
        }, row
        lo, hi = a.interval["fixed"][row]
        assert lo == pytest.approx(1.0) and hi == pytest.approx(1.0)
    assert all(g["psi"] == pytest.approx(1.0) for g in a.granulated_by_rho["geodesic_mix"])
    p = sum(m.metrics["test_error"] for m in a.records.members) / len(gaps)
    mean = sum(gaps) / len(gaps)
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1))
    assert a.gap_spread_over_noise == pytest.approx(std / math.sqrt(p * (1 - p) / 500))
    payload = report.payload(cfg, a)
    json.dumps(payload, allow_nan=False)
    assert "kendall_tau_best" not in payload and payload["population"] == "grid"
    assert payload["radii"]["fixed"]["rho"]["relative_flatness"] is None
    assert set(payload["granulated_tau"]["average"]) == {"label_noise", "subset", "psi"}
    assert list(payload["granulated_tau_by_rho"]["adaptive"]) == list(
        payload["tau_by_rho"]["adaptive"]
    )


def test_training_labels_nest_in_the_noise_and_the_subset():
    y = torch.randint(0, 5, (400,), generator=torch.Generator().manual_seed(3))
    recipes = _finetune.grid_population(
        0,
        (0.0, 0.1, 0.3),
        (1.0, 0.5),
        2,
        steps=100,
        lr=1e-3,
        weight_decay=0.0,
        batch_size=32,
        pool=400,
    )
    assert len(recipes) == 12 and recipes[0].label_noise == 0.0 and recipes[0].subset == 1.0
    assert {r.seed for r in recipes[:6]} == {0} and {r.seed for r in recipes[6:]} == {1}
    # the same number of optimizer steps in every cell (up to rounding of the epochs)
    steps = [r.epochs * math.ceil(math.ceil(r.subset * 400) / 32) for r in recipes]
    assert max(steps) - min(steps) <= 16
    flipped = {}
    for r in recipes[:3]:
        noisy = _finetune.training_labels(r, y)
        wrong = noisy != y
        flipped[r.label_noise] = wrong
        assert ((noisy >= 0) & (noisy < 5)).all()
        assert abs(wrong.float().mean().item() - r.label_noise) < 0.06
    assert not flipped[0.0].any()
    assert (flipped[0.1] <= flipped[0.3]).all()  # nested: more noise corrupts a superset
    other = _finetune.training_labels(recipes[8], y)  # replicate 1, noise 0.3
    assert (other != _finetune.training_labels(recipes[2], y)).any()  # its own noise draw
