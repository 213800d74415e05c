"""Every ``quotientgeo reproduce NAME --quick`` runs end to end and writes sane JSON and PNGs."""

from __future__ import annotations

import json
import math
import re
import statistics

import pytest

from quotientgeo.cli import main
from quotientgeo_studies import COMMANDS

pytest.importorskip("matplotlib")
pytest.importorskip("scipy")
pytest.importorskip("sklearn")
from scipy.stats import kendalltau

# command -> (JSON file, PNG files, required keys of kendall_tau or None)
EXPECTED = {
    "diagonal": ("diagonal.json", ["diagonal.png", "diagonal_tau_by_rho.png"], None),
    "toy": ("toy.json", ["toy.png"], None),
    "invariance": ("invariance.json", ["invariance.png"], None),
    "transformers": (
        "transformers.json",
        ["transformers.png", "tau_by_rho.png"],
        [
            "adaptive",
            "no_symmetry",
            *(
                f"{row}_{metric}"
                for metric in ("inv", "mix")
                for row in ("geodesic", "first_order", "exact", "norm_adaptive")
            ),
            "spectrum_s0.5",
            "average",
            "relative_flatness",
        ],
    ),
    "rho-sweep": ("rho_sweep.json", ["rho_sweep.png"], None),
    "sam": ("sam.json", ["sam.png"], None),
    "modular": (
        "modular.json",
        ["modular.png", "modular_tau_by_rho.png"],
        [
            "adaptive",
            *(
                f"{row}_{metric}"
                for metric in ("inv", "mix")
                for row in ("geodesic", "first_order", "exact")
            ),
            "average",
            "relative_flatness",
        ],
    ),
}


def _numbers(obj):
    """Every number in a JSON tree (bools excluded)."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield obj


# commands whose quick run is tested in a file of their own
TESTED_ELSEWHERE = {"lora": "test_lora_study.py"}


def test_every_command_is_tested():
    assert set(COMMANDS) == set(EXPECTED) | set(TESTED_ELSEWHERE)
    assert not set(EXPECTED) & set(TESTED_ELSEWHERE)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """``quick(name) -> (out folder, JSON payload)``; each command runs once per module."""
    done = {}

    def get(name):
        if name not in done:
            out = tmp_path_factory.mktemp(name)
            assert main(["reproduce", name, "--quick", "--no-progress", "--out", str(out)]) == 0
            done[name] = out, json.loads((out / EXPECTED[name][0]).read_text())
        return done[name]

    return get


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_quick_run(name, quick):
    _, pngs, tau_keys = EXPECTED[name]
    tmp_path, payload = quick(name)
    assert payload["quick"] is True
    numbers = list(_numbers(payload))
    assert numbers and all(math.isfinite(x) for x in numbers)
    if tau_keys is not None:
        taus = payload["kendall_tau"]
        for key in tau_keys:
            assert isinstance(taus[key], float) and -1.0 <= taus[key] <= 1.0, key
    for png in pngs:
        path = tmp_path / png
        assert path.stat().st_size > 1000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


CURVATURE = {  # command -> (populations, their axes, the Riemannian metrics of the rows)
    "diagonal": ({"init": [], "sgd": ["lr_factor", "batch_size"]}, ("inv", "mix")),
    "transformers": ({"grid": ["label_noise", "subset"]}, ("inv", "mix")),
    "modular": ({"modular": ["fraction", "weight_decay"]}, ("inv", "mix")),
}


@pytest.mark.parametrize("name", sorted(CURVATURE))
def test_quick_run_has_the_curvature_rows(name, quick):
    """The default run also writes ``NAME_curvature.json``: every member of every population
    with its gap, every row finite, τ that of the members' figures, Ψ on the grids."""
    out, _ = quick(name)
    populations, metrics = CURVATURE[name]
    payload = json.loads((out / f"{name}_curvature.json").read_text())
    assert payload["settings"]["n_probes"] == 8  # --quick
    assert {k: v["axes"] for k, v in payload["populations"].items()} == populations
    for pop in payload["populations"].values():
        rows = [f"{kind}_{g}" for kind in ("trace", "lambda_max") for g in (*metrics, "euclidean")]
        assert pop["rows"] == rows and pop["failures"] == []
        gaps = [m["gap"] for m in pop["members"]]
        for row in rows:
            values = [m[row] for m in pop["members"]]
            assert all(math.isfinite(v) for v in values), row
            assert pop["kendall_tau"][row] == pytest.approx(kendalltau(values, gaps)[0])
            psi = pop["granulated_tau"][row]
            assert (psi is None) == (not pop["axes"])


def test_diagonal_quick_fields(quick):
    """Both populations: τ across calibrated radii with bands, granulated τ on the grid one
    only, the gap spread over the noise from the members' records, the shared balls."""
    _, d = quick("diagonal")
    assert list(d["populations"]) == ["init", "sgd"]
    rows = list(d["measures"])
    assert set(rows) >= {"adaptive", "geodesic_inv", "geodesic_mix", "average"}
    for name, pop in d["populations"].items():
        grid, models = pop["grid_factors"], pop["models"]
        assert 1.0 in grid and len(models) >= 5
        assert pop["kendall_tau"] == d["kendall_tau"][name]
        for row in rows:
            rho1 = pop["calibration"][d["ball"][row]]["rho"]
            assert pop["rho_grid"][row] == pytest.approx([f * rho1 for f in grid], rel=1e-12)
            assert list(pop["tau_by_rho"][row]) == [f"{r:.4g}" for r in pop["rho_grid"][row]]
            for rho, tau in pop["tau_by_rho"][row].items():
                if tau is not None:
                    lo, hi = pop["tau_interval_by_rho"][row][rho]
                    assert -1.0 <= lo <= tau <= hi <= 1.0, (name, row, rho)
            # the headline τ is the f = 1 column, recomputed from the members' values
            at_one = [m[row] for m in models]
            assert at_one == [m["grid"][row][grid.index(1.0)] for m in models]
            expected = kendalltau(at_one, [m["gap"] for m in models])[0]
            assert pop["kendall_tau"][row] == pytest.approx(expected, abs=1e-12)
        gaps = [m["gap"] for m in models]
        noise = statistics.fmean(m["test_se"] for m in models)
        assert pop["gap_spread_over_noise"] == pytest.approx(statistics.stdev(gaps) / noise)
        for m in models:
            assert m["gap"] == pytest.approx(m["test_loss"] - m["train_loss"])
        # every ball reaches the target on the reference member within the calibration tolerance
        target = pop["target_loss_increase"]
        for ball, cal in pop["calibration"].items():
            assert abs(cal["value"] - target) <= d["config"]["calibration_rtol"] * target, ball
    assert d["populations"]["init"]["granulated_tau"] is None
    sgd = d["populations"]["sgd"]
    assert len({m["alpha"] for m in sgd["models"]}) == 1  # one initialisation scale
    for row, g in sgd["granulated_tau"].items():
        assert set(g) == {"lr_factor", "batch_size", "psi"}
        assert g["psi"] == pytest.approx((g["lr_factor"] + g["batch_size"]) / 2), row
    # rows that share a ball share its radius
    for metric in ("inv", "mix"):
        for kind in ("first_order", "exact"):
            assert d["ball"][f"{kind}_{metric}"] == f"geodesic_{metric}"


def test_diagonal_one_population(tmp_path, capsys):
    """``--population sgd`` runs the grid population alone; its output is not a terminal, so
    each phase prints a line when it starts and one when it ends, in order: the sharpness
    rows', then the curvature rows' (on the networks the sharpness rows trained)."""
    args = ["reproduce", "diagonal", "--quick", "--population", "sgd"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "diagonal.json").read_text())
    assert list(d["populations"]) == ["sgd"] and list(d["kendall_tau"]) == ["sgd"]
    lines = [line for line in capsys.readouterr().err.splitlines() if " steps" in line]
    phases = [
        "training sgd (seed 0, converged)",
        "calibrating ρ₁ (sgd)",
        "τ(ρ) grid (sgd, models)",
        "analysing",
        "curvature (sgd, models)",
        "analysing",
    ]
    assert len(lines) == 2 * len(phases)
    for phase, start, end in zip(phases, lines[::2], lines[1::2], strict=True):
        assert re.fullmatch(rf"{re.escape(phase)}: started \((\d+) steps\)", start)
        n = start.rsplit("(", 1)[1].split()[0]
        assert re.fullmatch(rf"{re.escape(phase)}: {n}/{n} steps in [\d.]+ s", end), end


def test_invariance_quick_is_invariant(quick):
    _, payload = quick("invariance")
    assert payload["max_output_change"] < 1e-10
    # the model, the data and every norm run in float64 (the study casts the model and the
    # batch to it): invariance holds to rounding, measured 4e-14 to 7e-14
    assert payload["max_relative_deviation"]["geodesic_mix"] <= 1e-9
    assert payload["max_relative_deviation"]["geodesic_inv"] <= 1e-9


def test_transformers_quick_fields(quick):
    """The grid population (the default): gap spread, τ across ρ with bands, curvature shares,
    calibrated radii, the ablation rows with bands at the fixed radius and the granulated τ."""
    _, d = quick("transformers")
    measures = ("adaptive", "geodesic_inv", "geodesic_mix")
    grid, n = d["grid_factors"], d["n_models"]
    assert d["population"] == "grid" and d["axes"] == ["label_noise", "subset"]
    assert len(d["models"]) == n >= 5
    # the grid: every (noise, size) cell once per seed
    cells = {(m["label_noise"], m["subset"], m["seed"]) for m in d["models"]}
    recipe = d["grid_recipe"]
    assert len(cells) == n == len(recipe["noise"]) * len(recipe["sizes"]) * recipe["seeds"]
    # gap spread over noise, recomputed from the models' errors
    gaps = [m["gap"] for m in d["models"]]
    p = sum(m["test_error"] for m in d["models"]) / n
    std = math.sqrt(sum((g - sum(gaps) / n) ** 2 for g in gaps) / (n - 1))
    noise = math.sqrt(p * (1 - p) / d["n_test"])
    assert d["gap_spread_over_noise"] == pytest.approx(std / noise)
    assert d["n_test"] == 896 - recipe["pool"] == d["models"][0]["n_test"]
    for m in measures:
        # ρ grid = factors times the measure's calibrated radius; τ(ρ) keyed by that grid
        rho1 = d["calibration"][m]["rho"]
        assert d["rho_grid"][m] == pytest.approx([f * rho1 for f in grid], rel=1e-12)
        assert list(d["tau_by_rho"][m]) == [f"{r:.4g}" for r in d["rho_grid"][m]]
        for rho, tau in d["tau_by_rho"][m].items():
            lo, hi = d["tau_interval_by_rho"][m][rho]
            assert -1.0 <= lo <= tau <= hi <= 1.0, (m, rho)
        assert list(d["granulated_tau_by_rho"][m]) == list(d["tau_by_rho"][m])
        assert all(len(model["grid"][m]) == len(grid) for model in d["models"])
    # the curvature share is a fraction of the worst-case value, for both geodesic measures
    for m in ("geodesic_inv", "geodesic_mix"):
        shares = list(d["curvature_share_by_rho"][m].values())
        assert len(shares) == len(grid) and all(-1.0 < s < 1.0 for s in shares)
    # every ball reaches the target on the reference model within the calibration tolerance
    for row, cal in d["calibration"].items():
        assert abs(cal["value"] - d["target_nats"]) <= 0.3 * d["target_nats"], row
    assert "relative_flatness" not in d["calibration"] and "average" in d["calibration"]
    radii = d["radii"]
    assert list(radii) == ["fixed"] and radii["fixed"]["factor"] == 1.0
    assert "kendall_tau_best" not in d
    rho = radii["fixed"]["rho"]
    for metric in ("inv", "mix"):  # perturbation ablations keep the geodesic row's ball
        for row in ("first_order", "exact"):
            assert rho[f"{row}_{metric}"] == rho[f"geodesic_{metric}"]
    assert rho["no_symmetry"] == rho["adaptive"] and rho["relative_flatness"] is None
    for model in d["models"]:  # symmetry off is adaptive sharpness, by construction
        assert model["ablations"]["fixed"]["no_symmetry"] == model["ablations"]["fixed"]["adaptive"]
        assert model["ablations"]["fixed"]["relative_flatness"] > 0
    # every row: τ inside its band, a p-value, and the granulated τ per axis with Ψ their mean
    assert set(d["tau_interval"]) == set(d["p_value"]) == set(d["kendall_tau"])
    assert set(d["granulated_tau"]) == set(d["kendall_tau"])
    for row, tau in d["kendall_tau"].items():
        lo, hi = d["tau_interval"][row]
        assert lo <= tau <= hi and 0.0 <= d["p_value"][row] <= 1.0, row
        g = d["granulated_tau"][row]
        assert set(g) == {"label_noise", "subset", "psi"}, row
        assert g["psi"] == pytest.approx((g["label_noise"] + g["subset"]) / 2), row
    assert d["failures"] == []


def test_transformers_random_population_quick(tmp_path):
    """The first design, kept as ``--population random``: both ablation radii, no axes."""
    args = ["reproduce", "transformers", "--quick", "--no-progress", "--out", str(tmp_path)]
    assert main([*args, "--population", "random"]) == 0
    d = json.loads((tmp_path / "transformers.json").read_text())
    assert d["population"] == "random" and d["axes"] == [] and d["granulated_tau"] == {}
    assert (
        set(d["radii"]) == {"fixed", "best"} and d["radii"]["best"]["factor"] in d["grid_factors"]
    )
    assert set(d["kendall_tau_best"]) == set(d["kendall_tau"]) >= {"spectrum_s0.25", "average"}
    assert d["n_test"] == 448 and math.isfinite(d["gap_spread_over_noise"])
    taus = zip(
        *(d["tau_by_rho"][m].values() for m in ("geodesic_inv", "geodesic_mix")), strict=True
    )
    score = [-1.0 if None in t else (abs(t[0]) + abs(t[1])) / 2 for t in taus]  # None: undefined
    assert score[d["grid_factors"].index(d["radii"]["best"]["factor"])] == max(score)


def test_transformers_figures_redraw_from_json(quick, tmp_path):
    """The documented re-draw: both figures from a finished run's JSON, as written."""
    from quotientgeo_studies import transformers

    out, payload = quick("transformers")
    drawn = transformers.figures(payload, tmp_path)
    assert [p.name for p in drawn] == ["transformers.png", "tau_by_rho.png"]
    for p in drawn:
        assert p.stat().st_size > 10_000
        assert p.read_bytes()[:8] == (out / p.name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_transformers_reuses_cache(quick, capsys):
    """The re-run takes every model from the cache and measures them again, with the first
    run's settings: the same values. (With fewer Auto-PGD iterations than the calibration of the
    first run, ``--n-iter 1``, ρ₁ of the mix ball came out 65 times larger and the exact
    geodesics at ``f = 10`` too long to integrate at their stated accuracy.)"""
    out, payload = quick("transformers")
    args = ["reproduce", "transformers", "--quick", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    n = payload["n_models"]
    assert f"{n}/{n} models from the cache" in capsys.readouterr().out
    again = json.loads((out / "transformers.json").read_text())
    assert again["kendall_tau"] == payload["kendall_tau"]


def test_modular_quick_fields(quick):
    """Gap spread over noise from the members' own errors, Ψ per row, τ(ρ) with bands, shares."""
    import numpy as np

    _, d = quick("modular")
    models, p = d["models"], d["task"]["p"]
    assert len(models) == d["n_models"] >= 4
    assert all(m["n_train"] + m["n_test"] == p * p for m in models)
    gaps = np.array([m["test_error"] - m["train_error"] for m in models])
    assert gaps == pytest.approx([m["gap"] for m in models], abs=1e-12)
    e, n = np.mean([m["test_error"] for m in models]), min(m["n_test"] for m in models)
    se = np.sqrt(e * (1 - e) / n)
    assert d["binomial_se"] == pytest.approx(se, rel=1e-9)
    assert d["gap_spread_over_noise"] == pytest.approx(np.std(gaps, ddof=1) / se, rel=1e-9)
    rows = list(d["kendall_tau"])
    for row in rows:
        psi = d["granulated_tau"][row]
        assert set(psi) == {"fraction", "weight_decay", "psi"}
        if None not in psi.values():
            assert psi["psi"] == pytest.approx((psi["fraction"] + psi["weight_decay"]) / 2)
        tau, (lo, hi) = d["kendall_tau"][row], d["kendall_interval"][row]
        if tau is not None:
            assert -1.0 <= lo <= hi <= 1.0 and 0.0 <= d["p_value"][row] <= 1.0
    # perturbation rows keep the second-order row's ball; relative flatness has none
    for metric in ("inv", "mix"):
        for kind in ("first_order", "exact"):
            assert d["rho"][f"{kind}_{metric}"] == d["rho"][f"geodesic_{metric}"]
    assert d["rho"]["relative_flatness"] is None
    for row in ("adaptive", "geodesic_inv", "geodesic_mix", "average"):
        assert d["rho"][row] == pytest.approx(d["calibration"][row]["rho"], rel=1e-12)
    keys = [f"{f:.3g}" for f in d["grid_factors"]]
    for row in ("adaptive", "geodesic_inv", "geodesic_mix"):
        assert list(d["tau_by_rho"][row]) == keys
        for k in keys:
            lo, hi = d["tau_interval_by_rho"][row][k]
            assert -1.0 <= lo <= hi <= 1.0
    for row in ("geodesic_inv", "geodesic_mix"):
        assert all(-1.0 < s < 1.0 for s in d["curvature_share_by_rho"][row].values())
    assert d["failures"] == []


def test_modular_task_and_model():
    """Labels are (a + b) mod p, training sets are nested and hold the measurement batches, and
    the symmetry search maps the attention's query-key and value-output GL blocks."""
    import argparse

    import torch

    import quotientgeo
    from quotientgeo_studies.modular import config as modular_config
    from quotientgeo_studies.modular import task

    for p, seed in [(7, 0), (13, 3), (31, 1)]:
        t = task.Task(p, seed)
        x, y = task.pairs(t)
        assert len(set(map(tuple, x[:, :2].tolist()))) == p * p and (x[:, 2] == p).all()
        assert torch.equal(y, (x[:, 0] + x[:, 1]) % p)
    for quick in (True, False):
        args = argparse.Namespace(
            quick=quick, seed=2, target=1.0, n_iter=None, gaps_only=False, threads=1,
            no_progress=True,
        )  # fmt: skip
        cfg = modular_config.config(args)
        x, y = task.pairs(cfg.task)
        smallest = task.n_train(cfg.task, min(cfg.size.fractions))
        for bx, by in modular_config.batches(cfg):  # inside every member's training set
            rows = [int(((x == token).all(1)).nonzero()) for token in bx]
            assert max(rows) < smallest and torch.equal(by, y[rows])
    geometry = quotientgeo.find_symmetries(task.ModularTransformer(11, width=16, heads=2))
    assert {b.label for b in geometry.plan.blocks} == {"block.self_attn.QK", "block.self_attn.VO"}
    assert all(kind.shape[-1] == 16 // 2 for kind in geometry.kinds)  # GL(h), h = width / heads


def test_modular_figures_redraw_from_json(quick, tmp_path):
    from quotientgeo_studies import modular

    out, payload = quick("modular")
    drawn = modular.figures(payload, tmp_path)
    assert [p.name for p in drawn] == ["modular_tau_by_rho.png", "modular.png"]
    for p in drawn:
        assert p.stat().st_size > 10_000 and (out / p.name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_modular_reuses_cache(quick, capsys):
    out, payload = quick("modular")
    args = ["reproduce", "modular", "--quick", "--no-progress", "--gaps-only", "--out", str(out)]
    assert main(args) == 0
    n = payload["n_models"]
    assert f"{n}/{n} models from the cache" in capsys.readouterr().out
    assert json.loads((out / "modular.json").read_text())["meta"] == payload["meta"]


def test_toy_riemannian_quantities_are_invariant(quick):
    _, payload = quick("toy")
    for metric in ("inv", "mix"):
        var = payload["orbit_relative_variation"][metric]
        assert var["riemannian_grad_norm"] < 1e-10
        assert var["riemannian_hessian_trace"] < 1e-4
        assert var["euclidean_grad_norm"] > 0.1
        assert var["euclidean_hessian_trace"] > 0.1


def test_sam_quick_fields(quick):
    _, payload = quick("sam")
    methods = {"adamw", "sam", "asam", "geodesic_mix", "geodesic_inv"}
    noise = [f"{eta:g}" for eta in payload["noise"]]
    assert set(payload["test_accuracy_by_noise"]) == set(noise) and len(noise) >= 2
    for accs in payload["test_accuracy_by_noise"].values():
        assert set(accs) == methods
        for values in accs.values():
            assert len(values) == payload["seeds"] and all(0.0 <= v <= 1.0 for v in values)
    ratios = payload["step_time_over_sam"]
    assert set(ratios) == methods and ratios["sam"] == 1.0
    # ρ is chosen per η from each method's grid, on the noisy validation accuracies
    assert set(payload["rho_by_noise"]) == set(noise)
    for eta, chosen in payload["rho_by_noise"].items():
        assert set(chosen) == methods - {"adamw"}
        for method, rho in chosen.items():
            assert rho in payload["rho_grid"][method]
            scores = payload["validation_accuracy_by_noise"][eta][method]
            assert scores[f"{rho:g}"] == max(scores.values())
    # the η = 0 entries keep their earlier names
    clean = noise[0]
    assert payload["test_accuracy"] == payload["test_accuracy_by_noise"][clean]
    assert payload["rho_chosen"] == payload["rho_by_noise"][clean]
    for eta in noise:
        pairs = {(c["a"], c["b"]) for c in payload["comparisons"][eta]}
        assert {("sam", "adamw"), ("asam", "adamw")} <= pairs


def test_sam_study_does_not_depend_on_the_number_of_workers(quick, tmp_path):
    """Two local processes train the same runs as one: the ranks train different models, so
    no gradient may cross between them (GeodesicSAM averages gradients only when asked)."""
    _, one = quick("sam")
    argv = ["reproduce", "sam", "--quick", "--no-progress", "--workers", "2", "--out"]
    assert main([*argv, str(tmp_path)]) == 0
    two = json.loads((tmp_path / "sam.json").read_text())
    assert two["validation_accuracy_by_noise"] == one["validation_accuracy_by_noise"]
    assert two["test_accuracy_by_noise"] == one["test_accuracy_by_noise"]


def test_label_noise_flips_exactly_the_fraction_to_other_classes():
    import torch

    from quotientgeo_studies.sam import with_label_noise

    y = torch.arange(1000) % 10
    for fraction in (0.0, 0.2, 0.4):
        noisy = with_label_noise(y, fraction, torch.Generator().manual_seed(0))
        assert int((noisy != y).sum()) == round(fraction * len(y))
        assert noisy.min() >= 0 and noisy.max() <= 9


def test_granulated_tau_averages_tau_within_groups_that_differ_in_one_axis():
    """Ψ against a hand count on a 2×3 grid, and an axis whose groups are all constant."""
    from scipy.stats import kendalltau

    from quotientgeo_studies._common import granulated_tau

    members = [{"lr": lr, "wd": wd} for lr in (1, 2) for wd in (0, 1, 2)]
    gaps = [0.1, 0.2, 0.3, 0.5, 0.4, 0.6]
    values = [1.0, 3.0, 2.0, 4.0, 5.0, 6.0]
    got = granulated_tau(values, gaps, members, ["lr", "wd"])
    # "wd" varies within the two groups lr = 1 and lr = 2
    tau_wd = (
        kendalltau([1, 3, 2], [0.1, 0.2, 0.3])[0] + kendalltau([4, 5, 6], [0.5, 0.4, 0.6])[0]
    ) / 2
    # "lr" varies within the three pairs wd = 0, 1, 2: each pair is concordant
    assert got["lr"] == pytest.approx(1.0)
    assert got["wd"] == pytest.approx(tau_wd)
    assert got["psi"] == pytest.approx((1.0 + tau_wd) / 2)
    # a measure constant within every group has no τ on that axis
    flat = granulated_tau([1.0, 1.0, 1.0, 2.0, 2.0, 2.0], gaps, members, ["wd"])
    assert math.isnan(flat["wd"]) and math.isnan(flat["psi"])
    # a seed key separates groups: with a different seed per member every group is a singleton
    seeded = [{**m, "seed": i} for i, m in enumerate(members)]
    assert math.isnan(granulated_tau(values, gaps, seeded, ["lr"])["lr"])
