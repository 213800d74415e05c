"""The developer benchmarks (``quotientgeo bench projection|generic|sam``, from the studies
distribution) run at toy sizes through the ``quotientgeo`` command, and their contenders agree."""

from __future__ import annotations

import json

import pytest

from quotientgeo.cli import main


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_projection_bench_json(capsys, dtype):
    argv = ["bench", "projection", "--heads", "3", "--n", "7", "--h", "2", "--rounds", "1"]
    assert main([*argv, "--dtype", dtype, "--json", "--pieces"]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = {"scipy_loop_s", "inv_s", "mix_s", "inv_cached_s", "mix_cached_s", "speedup"}
    expected |= {"rotary_mix_s", "rotary_mix_cached_s", "rotary_mix_cached_over_mix_cached"}
    assert expected <= result.keys()
    assert all(result[key] > 0 for key in expected)
    assert len(result["pieces_s"]) == 10
    assert 0 < result["cached_floor_s"] < sum(result["pieces_s"].values())
    # the batched inv projection agrees with the per-head scipy Sylvester loop
    assert result["max_rel_diff_vs_scipy"] < (1e-5 if dtype == "float32" else 1e-12)


def test_generic_bench_json(capsys):
    argv = ["bench", "generic", "--heads", "2", "--n", "6", "--m", "5", "--h", "2"]
    assert main([*argv, "--rounds", "1", "--dtype", "float64", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["rows"]) == 8  # 2 metrics × (2 proju + 2 christoffel variants)
    for row in result["rows"]:
        assert row["closed_s"] > 0 and row["generic_s"] > 0 and row["ratio"] > 0
        assert row["rel_err"] < 1e-8  # the closed forms match the generic path


def test_sam_bench_json(capsys):
    argv = ["bench", "sam", "--d", "8", "--heads", "2", "--layers", "1", "--seq", "3"]
    assert main([*argv, "--batch", "4", "--rounds", "1", "--steps", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    methods = {"adamw", "sam", "asam", "geodesic_mix", "geodesic_inv"}
    assert set(result["seconds_per_step"]) == set(result["over_sam"]) == methods
    assert result["over_sam"]["sam"] == 1.0
    assert all(v > 0 for v in result["seconds_per_step"].values())
