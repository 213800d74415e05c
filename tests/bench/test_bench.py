"""The library's benchmarks (`bench sharpness`, `bench memory`) run at toy sizes, and the harness
interleaves. The developer benchmarks are tested with the studies (studies/tests)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quotientgeo.bench.timing import interleaved, median_ratio, medians
from quotientgeo.cli import main


def test_harness_warms_up_rotates_and_times_every_round():
    calls = []
    contenders = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    samples = interleaved(contenders, rounds=3, warmup=1)
    # warm-up round, then rounds rotated by one position each
    assert calls == list("abcbcacababc")
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for v in samples.values() for t in v)
    assert medians({"a": [3.0, 1.0, 2.0]}) == {"a": 2.0}
    assert median_ratio([2.0, 9.0, 4.0], [1.0, 3.0, 1.0]) == 3.0  # per-round ratios 2, 3, 4
    with pytest.raises(ValueError, match="rounds"):
        interleaved(contenders, rounds=0)


def test_sharpness_bench_json(capsys):
    argv = ["bench", "sharpness", "--layers", "1", "--d", "16", "--heads", "2", "--seq", "3"]
    argv += ["--batch", "2", "--n-iter", "2", "--extra", "2", "--rounds", "2", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    # runs of 2 and 4 iterations: one checkpoint and three, said on stderr
    assert result["checkpoints"] == {"short": 1, "long": 3}
    assert "checkpoints" in captured.err
    assert set(result["ratios"]) == {
        "geodesic_mix/adaptive",
        "geodesic_inv/adaptive",
        "adaptive/floor",
        "exact_inv/second_order_inv",
    }
    assert result["floor_s"] > 0 and result["config"]["rounds"] == 2
    assert result["geodesic_inv_exact_s"] > 0


def test_memory_bench_json(capsys):
    """``bench memory`` runs every contender in its own process and reports its peak in bytes
    and in parameter copies above the floor's peak."""
    argv = ["bench", "memory", "--layers", "1", "--d", "16", "--heads", "2", "--vocab", "50"]
    argv += ["--seq", "8", "--batch", "2", "--n-iter", "2", "--n-samples", "2"]
    assert main([*argv, "--only", "adaptive", "geodesic_mix", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    peaks = result["peaks"]
    assert set(peaks) == {"floor", "adaptive", "geodesic_mix"}
    # GPT2 with vocab 50, 8 positions, d=16, one layer: its trainable parameters in float32
    d, vocab, positions = 16, 50, 8
    n_params = vocab * d + positions * d + 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d)
    n_params += 2 * 4 * d * d + 4 * d + d + 2 * d  # the MLP, the final layer norm
    assert result["parameter_bytes"] == 4 * n_params
    floor = peaks["floor"]["peak_bytes"]
    assert floor > 0
    for name in ("adaptive", "geodesic_mix"):
        row = peaks[name]
        assert row["above_floor_bytes"] == row["peak_bytes"] - floor
        assert row["copies_above_floor"] == pytest.approx(
            row["above_floor_bytes"] / result["parameter_bytes"]
        )
        assert row["allocated_copies_above_floor"] == pytest.approx(
            (row["allocated_bytes"] - peaks["floor"]["allocated_bytes"]) / result["parameter_bytes"]
        )
    # the floor holds at least its gradients (one copy) at its allocated peak
    assert peaks["floor"]["allocated_bytes"] >= result["parameter_bytes"]


@settings(max_examples=10, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=6), data=st.data())
def test_allocated_peak_is_the_most_bytes_held(sizes, data):
    """``allocated_peak`` is the largest running sum of the bytes allocated and freed, exactly,
    whatever the order of the frees."""
    import torch

    from quotientgeo.bench.memory import allocated_peak

    frees = data.draw(st.lists(st.sampled_from(range(len(sizes))), unique=True))
    expected, held, alive = 0, 0, {}
    for i, n in enumerate(sizes):
        held += 8 * n
        expected = max(expected, held)
        if i in frees:
            held -= 8 * n

    def fn():
        for i, n in enumerate(sizes):
            alive[i] = torch.empty(n, dtype=torch.float64)
            if i in frees:
                del alive[i]
        alive.clear()

    assert allocated_peak(fn) == expected


def test_cost_counter_counts_operators_host_reads_and_bytes_exactly():
    """A loop of k adds is k operators, ``item()`` and ``bool()`` are one host read each,
    views (and ``_unsafe_view``) are not counted, allocations touch no bytes, and bytes are
    the inputs plus the outputs of each operator."""
    import torch

    from quotientgeo.bench.cost import CostCounter

    x, y = torch.ones(10), torch.ones(10)
    for k in (1, 3, 7):
        with CostCounter() as c:
            for _ in range(k):
                x = x + y
        assert (c.ops, c.host_reads, c.bytes) == (k, 0, k * 3 * 40)
    with CostCounter() as c:
        x.view(2, 5).t()[1:]
        x.detach()
        x[2:5].unsqueeze(0)
    assert (c.ops, c.host_reads, c.bytes) == (0, 0, 0)
    with CostCounter() as c:  # an allocation is an operator that reads and writes nothing
        torch.empty(10)
        x.new_empty(10)
        torch.empty_like(x)
    assert (c.ops, c.bytes) == (3, 0)
    with CostCounter() as c:  # reshape of a non-contiguous tensor: a clone, then _unsafe_view
        torch.ones(2, 5).t().reshape(10)
    assert c.by_op == {"ones": 1, "clone": 1} and c.bytes == 40 + 2 * 40
    with CostCounter() as c:
        x.sum().item()
    assert (c.ops, c.host_reads) == (2, 1)  # the sum, then the read
    with CostCounter() as c:
        bool(x.sum() > 0)
    assert c.host_reads == 1
    with CostCounter() as c:
        x[x > 2]  # boolean indexing: the output size depends on the values
    assert c.host_reads == 1
    with CostCounter() as c:
        torch.linalg.cholesky(torch.eye(3, dtype=torch.float64))  # checks its info on the host
        torch.linalg.cholesky_ex(torch.eye(3, dtype=torch.float64))  # does not
    assert c.host_reads == 1
    with CostCounter() as c:
        torch._foreach_add_([x, y], [y, y])  # one operator for the list
    assert c.ops == 1 and c.bytes == 6 * 40


def test_cost_bench_json(capsys):
    """``bench cost`` counts every measure and optimizer at two depths of a toy decoder."""
    argv = ["bench", "cost", "--layers", "1", "2", "--d", "16", "--heads", "2", "--vocab", "50"]
    argv += ["--seq", "4", "--n-iter", "1", "--extra", "2", "--steps", "1", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert set(result["depths"]) == {"1", "2"}
    # runs of 1 and 3 iterations: no checkpoint and two, said on stderr
    assert result["checkpoints"] == {"short": 0, "long": 2} and "checkpoints" in captured.err
    for depth in result["depths"].values():
        rows = depth["per_iteration"]
        assert set(rows) >= {"floor", "adaptive", "geodesic_mix", "geodesic_inv"}
        assert set(rows) >= {"geodesic_inv_exact", "average", "sam", "asam", "geodesic_sam"}
        assert "quotient_optimizer" in rows
        assert rows["floor"]["ops"] > 0 and rows["floor"]["host_reads"] == 0
        assert rows["adaptive"]["copies"] > 0 and rows["geodesic_mix"]["ops"] > 0
        # at most one host read per iteration or step (the target of issue 40)
        for name in ("adaptive", "geodesic_mix", "geodesic_inv", "geodesic_inv_exact", "average"):
            assert rows[name]["host_reads"] <= 1, name
        for name in ("sam", "asam", "geodesic_sam", "quotient_optimizer"):
            assert rows[name]["host_reads"] <= 1, name
    floor = [result["depths"][d]["per_iteration"]["floor"]["ops"] for d in ("1", "2")]
    assert floor[1] > floor[0]  # a deeper model runs more operators


def test_cost_bench_hvp_counts_one_product_in_forward_backward_passes(capsys):
    """``bench cost --hvp``: the finite-difference product evaluates the loss twice with two
    backward passes, double backward once with one (its second backward runs through the
    gradient's graph); the ratios are the counts over the floor's."""
    argv = ["bench", "cost", "--hvp", "--layers", "1", "--d", "16", "--heads", "2"]
    argv += ["--vocab", "50", "--seq", "4", "--hvp-rounds", "1", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    depth = result["depths"]["1"]
    rows, floor = depth["per_product"], depth["per_product"]["floor"]
    assert (rows["finite_difference"]["evaluations"], rows["finite_difference"]["backward"]) == (
        2,
        2,
    )
    assert (rows["double_backward"]["evaluations"], rows["double_backward"]["backward"]) == (1, 1)
    for name in ("double_backward", "finite_difference"):
        row = rows[name]
        assert row["fb_ops"] == pytest.approx(row["ops"] / floor["ops"])
        assert row["fb_bytes"] == pytest.approx(row["copies"] / floor["copies"])
        # the product runs its passes and the geometry's work besides
        assert row["fb_ops"] > row["backward"] and row["beyond_ops"] > 0
    times = depth["times"]["seconds"]
    assert {"forward_backward", "double_backward", "finite_difference", "euclidean"} <= set(times)
    assert all(s > 0 for s in times.values())


def test_memory_bench_hessian_vector_product(capsys):
    """``bench memory --only hvp_finite_difference``: the product's peak against the floor."""
    argv = ["bench", "memory", "--layers", "1", "--d", "16", "--heads", "2", "--vocab", "50"]
    argv += ["--seq", "8", "--batch", "2", "--only", "hvp_finite_difference", "--json"]
    assert main(argv) == 0
    peaks = json.loads(capsys.readouterr().out)["peaks"]
    assert set(peaks) == {"floor", "hvp_finite_difference"}
    assert peaks["hvp_finite_difference"]["peak_bytes"] > 0
