"""The projection benchmark runs at toy sizes and its contenders compute the same projection."""

from __future__ import annotations

import json

import pytest

from quotientgeo.cli import main


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_projection_bench_json(capsys, dtype):
    argv = ["bench", "projection", "--heads", "3", "--n", "7", "--h", "2", "--repeats", "1"]
    assert main([*argv, "--dtype", dtype, "--json", "--pieces"]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = {"scipy_loop_s", "inv_s", "mix_s", "inv_cached_s", "mix_cached_s", "speedup"}
    assert expected <= result.keys()
    assert all(result[key] > 0 for key in expected)
    assert len(result["pieces_s"]) == 10
    assert 0 < result["cached_floor_s"] < sum(result["pieces_s"].values())
    # the batched inv projection agrees with the per-head scipy Sylvester loop
    assert result["max_rel_diff_vs_scipy"] < (1e-5 if dtype == "float32" else 1e-12)
