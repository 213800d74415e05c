"""The curvature rows of the populations (``--curvature``): their geometries, the members left
out, the statistics, and ``--curvature only|off`` end to end."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

pytest.importorskip("scipy")

from quotientgeo.cli import main
from quotientgeo_studies import _common as C
from quotientgeo_studies import _curvature
from quotientgeo_studies.diagonal import DiagonalNet, mse, rescale_geometry
from quotientgeo_studies.pipeline import Study

TIGHT = _curvature.Settings(tol=1e-12, max_iter=1000)


def _data(seed: int, n: int = 5, d: int = 4):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return [(X, torch.randn(n, generator=gen, dtype=torch.float64))]


def _population(models, batches, *, skip=frozenset(), gaps=None):
    n = len(models)
    return _curvature.Population(
        name="synthetic",
        model_of=lambda k: models[k],
        batches_of=lambda k: batches,
        loss_fn=mse,
        gaps=list(gaps) if gaps is not None else [float(k) for k in range(n)],
        keys=[{"seed": k} for k in range(n)],
        axes=(),
        metrics=("inv", "mix"),
        symmetries=rescale_geometry,
        skip=skip,
    )


def test_rows_are_traces_then_top_eigenvalues_of_each_geometry_then_euclidean():
    assert _curvature.rows(("mix",)) == [
        "trace_mix",
        "trace_euclidean",
        "lambda_max_mix",
        "lambda_max_euclidean",
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_invariant_rows_stay_and_euclidean_rows_move_along_the_rescaling_orbit(seed):
    """A diagonal network moved to ``(a ⊙ u, v / a)`` computes the same function: its
    Riemannian rows (declared re-scaling pair, inv and mix) agree to 1e-9, its Euclidean rows
    differ by more than 1e-2, and the Euclidean rows equal the dense Hessian's trace and top
    eigenvalue."""
    gen = torch.Generator().manual_seed(10 + seed)
    d = 4
    u = torch.randn(d, generator=gen, dtype=torch.float64)
    v = torch.randn(d, generator=gen, dtype=torch.float64)
    a = torch.empty(d, dtype=torch.float64).uniform_(0.3, 3.0, generator=gen)
    batches = _data(seed, d=d)
    pop = _population([DiagonalNet(u, v), DiagonalNet(a * u, v / a)], batches)
    (first, methods, fails), (moved, _, fails2) = (
        _curvature.measure_member(pop, k, TIGHT, seed) for k in (0, 1)
    )
    assert not fails and not fails2
    assert set(methods.values()) == {"exact"}
    for row in _curvature.rows(pop.metrics):
        if row.endswith("euclidean"):
            assert abs(moved[row] - first[row]) > 1e-2 * abs(first[row]), row
        else:
            assert moved[row] == pytest.approx(first[row], rel=1e-9, abs=1e-12), row

    def loss(w):
        X, y = batches[0]
        return ((X @ (w[:d] * w[d:])) - y).square().mean()

    dense = torch.func.hessian(loss)(torch.cat([u, v]))
    assert first["trace_euclidean"] == pytest.approx(float(dense.trace()), rel=1e-10)
    top = float(torch.linalg.eigvalsh(dense)[-1])
    assert first["lambda_max_euclidean"] == pytest.approx(top, rel=1e-8)


def test_hutchinson_above_exact_max_and_its_mean_is_near_the_exact_trace():
    gen = torch.Generator().manual_seed(3)
    d = 6
    model = DiagonalNet(
        torch.randn(d, generator=gen, dtype=torch.float64),
        torch.randn(d, generator=gen, dtype=torch.float64),
    )
    pop = _population([model], _data(3, d=d))
    exact, m_exact, _ = _curvature.measure_member(pop, 0, TIGHT, 0)
    probes = _curvature.Settings(exact_max=2 * d - 1, n_probes=4000, chunk_size=500)
    estimate, m_hutch, _ = _curvature.measure_member(pop, 0, probes, 0)
    assert set(m_exact.values()) == {"exact"} and set(m_hutch.values()) == {"hutchinson"}
    for g in ("inv", "mix", "euclidean"):
        assert estimate[f"trace_{g}"] == pytest.approx(exact[f"trace_{g}"], rel=0.1), g


def test_a_skipped_member_is_nan_unranked_and_listed():
    gen = torch.Generator().manual_seed(4)
    models = [
        DiagonalNet(
            torch.randn(3, generator=gen, dtype=torch.float64),
            torch.randn(3, generator=gen, dtype=torch.float64),
        )
        for _ in range(5)
    ]
    pop = _population(models, _data(4, d=3), skip=frozenset({2}), gaps=[0.1, 0.5, 0.2, 0.9, 0.3])
    config = _curvature.Config(
        study="synthetic",
        base=None,
        populations=lambda base, population, out: [pop],
        settings=TIGHT,
        seed=0,
        resamples=200,
        progress=False,
    )
    with C.Population() as population:
        records = _curvature.collect(config, population, None)
    (r,) = records.populations
    assert all(math.isnan(v) for v in r.values[2].values())
    assert any("member 2" in f for f in r.failures)
    analysis = _curvature.analyse(config, records)
    from scipy.stats import kendalltau

    keep = [0, 1, 3, 4]
    for row, s in analysis.statistics["synthetic"].items():
        assert s.n == 4
        expected = kendalltau([r.values[k][row] for k in keep], [r.gaps[k] for k in keep])
        assert s.tau == pytest.approx(float(expected[0]), abs=1e-12)
        assert s.band[0] <= s.tau <= s.band[1]
        assert s.granulated is None


def test_the_curvature_choice_picks_the_studies():
    sharp = Study(None, None, None, None)
    for choice, n in (("also", 2), ("only", 1), ("off", 1)):
        picked = _curvature.studies(sharp, None, argparse.Namespace(curvature=choice))
        assert len(picked) == n
        assert (picked[0] is sharp) == (choice != "only")


def test_diagonal_curvature_only_writes_the_rows_and_no_sharpness(tmp_path):
    out = tmp_path / "only"
    args = ["reproduce", "diagonal", "--quick", "--population", "sgd", "--no-progress"]
    assert main([*args, "--curvature", "only", "--out", str(out)]) == 0
    assert not (out / "diagonal.json").exists()
    payload = json.loads((out / "diagonal_curvature.json").read_text())
    (name,) = payload["populations"]
    pop = payload["populations"][name]
    assert name == "sgd" and pop["axes"] == ["lr_factor", "batch_size"]
    assert pop["rows"] == _curvature.rows(("inv", "mix"))
    from scipy.stats import kendalltau

    gaps = [m["gap"] for m in pop["members"]]
    for row in pop["rows"]:
        values = [m[row] for m in pop["members"]]
        assert all(math.isfinite(v) for v in values), row
        assert pop["kendall_tau"][row] == pytest.approx(float(kendalltau(values, gaps)[0]))
        assert set(pop["granulated_tau"][row]) == {"lr_factor", "batch_size", "psi"}
    off = tmp_path / "off"
    assert main([*args, "--curvature", "off", "--out", str(off)]) == 0
    assert (off / "diagonal.json").exists() and not (off / "diagonal_curvature.json").exists()
