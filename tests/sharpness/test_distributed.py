"""Sharpness in a torch.distributed process group (2 gloo processes on the CPU).

Every rank returns what one process returns: for ``distributed="batches"`` on the
concatenated list of all ranks' batches (also with unequal counts), for ``"split_batch"`` on
the concatenated batch. A failing ``loss_fn`` on one rank raises on every rank, in bounded time.
Relative flatness, the other kind of ``Measure``, in the same modes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from quotientgeo import Measure, adaptive_sharpness, average_sharpness, geodesic_sharpness
from quotientgeo.testing import TinyTransformerClassifier, cross_entropy

DT = torch.float64
WORLD = 2
HANG_BOUND_S = 300
KW = dict(rho=0.05, n_iter=6, progress=False)


def model():
    torch.manual_seed(0)
    return TinyTransformerClassifier(d=16, heads=4, layers=1, classes=3).to(DT).eval()


def batch(seed: int, size: int = 6):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(size, 5, 16, generator=gen, dtype=DT),
        torch.randint(0, 3, (size,), generator=gen),
    )


# rank -> its batches in mode "batches" (unequal counts) and its half batch in "split_batch"
RANK_BATCHES = {0: [batch(10), batch(11)], 1: [batch(12)]}
HALVES = {0: batch(20), 1: batch(21)}


def measures(m, batches, distributed="batches"):
    kw = dict(KW, distributed=distributed)
    return {
        "mix": geodesic_sharpness(m, cross_entropy, batches, metric="mix",
                                  return_perturbation=True, **kw),
        "inv": geodesic_sharpness(m, cross_entropy, batches, metric="inv", **kw),
        "adaptive": adaptive_sharpness(m, cross_entropy, batches, **kw),
        "average": average_sharpness(m, cross_entropy, batches, rho=0.05, n_samples=4,
                                     progress=False, distributed=distributed),
    }  # fmt: skip


def summary(results) -> dict:
    return {
        k: {"value": r.value, "per_batch": r.per_batch, "base": r.base_losses,
            "norms": r.perturbation_norms, "n": r.settings["n_batches"],
            "first_order": r.first_order_losses,  # None for the average measure
            # ||ξ*||² in parameter coordinates (None unless return_perturbation)
            "xi": None if r.perturbations is None else
                  [sum(float(t.square().sum()) for t in xi.values()) for xi in r.perturbations]}
        for k, r in results.items()
    }  # fmt: skip


FLATNESS = Measure.relative_flatness("head")


def flatness(m, batches, distributed="batches", loss_fn=cross_entropy) -> dict:
    r = FLATNESS.evaluate(m, loss_fn, batches, progress=False, distributed=distributed)
    s = r.settings
    return {"value": r.value, "per_batch": r.per_batch, "losses": r.losses,
            "n": s["n_batches"], "mode": s["distributed"], "world": s["world_size"]}  # fmt: skip


def _flatness_worker(rank: int, m) -> dict:
    def failing(mod, b):
        if rank == 1:
            raise RuntimeError("boom")
        return cross_entropy(mod, b)

    errors = {}
    for mode in ("batches", "split_batch"):
        try:
            flatness(m, [HALVES[rank]], mode, failing)
        except RuntimeError as err:
            errors[mode] = str(err)
    return {
        "batches": flatness(m, RANK_BATCHES[rank]),
        "split_batch": flatness(m, [HALVES[rank]], "split_batch"),
        "off": flatness(m, RANK_BATCHES[rank], "off"),
        "errors": errors,
    }


def _worker(rank: int, init: str, out: str, scenario: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        m = model()
        if scenario == "batches":
            payload = summary(measures(m, RANK_BATCHES[rank]))
        elif scenario == "split_batch":
            payload = summary(measures(m, [HALVES[rank]], "split_batch"))
        elif scenario == "flatness":
            payload = _flatness_worker(rank, m)
        else:  # a loss_fn that raises on rank 1 only, in either mode

            def loss_fn(mod, b):
                if rank == 1:
                    raise RuntimeError("boom")
                return cross_entropy(mod, b)

            before = {n: p.detach().clone() for n, p in m.named_parameters()}
            errors = {}
            for mode in ("batches", "split_batch"):
                try:
                    geodesic_sharpness(m, loss_fn, [HALVES[rank]], distributed=mode, **KW)
                except RuntimeError as err:
                    errors[mode] = str(err)
            restored = all(torch.equal(p, before[n]) for n, p in m.named_parameters())
            payload = {"errors": errors, "restored": restored}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(payload, f)
        # torch 2.6's gloo can hang in destroy_process_group when one rank tears its file store
        # down while the other is still inside (seen 1 run in 2); meeting first avoids that.
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def run_ranks(tmp_path, scenario: str) -> list[dict]:
    out = str(tmp_path / scenario)
    init = f"file://{tmp_path / (scenario + '.store')}"
    ctx = torch.multiprocessing.spawn(_worker, args=(init, out, scenario), nprocs=WORLD, join=False)
    # bounded: a hang (a rank left waiting in a collective) fails the test instead. A scenario
    # takes 20-60 s on the loaded 2-core CI machine, most of it two fresh interpreters
    # importing torch (PyPI's CUDA build in the version legs), hence the margin.
    for _ in range(2 * HANG_BOUND_S):
        if ctx.join(timeout=0.5):
            break
    else:
        for p in ctx.processes:
            p.kill()
        pytest.fail(f"distributed scenario {scenario!r} did not finish in {HANG_BOUND_S} s")
    return [json.loads(open(f"{out}.{r}").read()) for r in range(WORLD)]


def assert_same(distributed: dict, single: dict) -> None:
    for key, expected in single.items():
        got = distributed[key]
        assert got["n"] == expected["n"], key
        for field in ("per_batch", "base", "norms", "first_order", "xi"):
            if expected[field] is None:
                assert got[field] is None, (key, field)
                continue
            torch.testing.assert_close(
                torch.tensor(got[field]), torch.tensor(expected[field]), rtol=1e-9, atol=1e-12
            )
        assert got["value"] == pytest.approx(expected["value"], rel=1e-9), key


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_batches_across_ranks_equal_one_process_on_the_concatenated_list(tmp_path):
    ranks = run_ranks(tmp_path, "batches")
    assert ranks[0] == ranks[1]  # every rank returns the same result
    single = summary(measures(model(), RANK_BATCHES[0] + RANK_BATCHES[1]))
    assert_same(ranks[0], single)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_one_batch_split_over_ranks_equals_one_process_on_the_whole_batch(tmp_path):
    ranks = run_ranks(tmp_path, "split_batch")
    assert ranks[0] == ranks[1]
    whole = tuple(torch.cat([HALVES[0][i], HALVES[1][i]]) for i in range(2))
    assert_same(ranks[0], summary(measures(model(), [whole])))


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_a_failing_rank_raises_on_every_rank(tmp_path):
    ranks = run_ranks(tmp_path, "failure")
    for r, payload in enumerate(ranks):
        assert payload["restored"], r
        for mode in ("batches", "split_batch"):
            message = payload["errors"][mode]
            assert "rank 1" in message and "boom" in message, (r, mode, message)
    # rank 1's batch is the second of the concatenated list; split_batch: the one global batch
    batches = "rank 1: RuntimeError: boom (raised by loss_fn on batch 1, iteration 0 (restart 0)"
    assert batches in ranks[0]["errors"]["batches"]
    split = "rank 1: batch 0, iteration 0 (restart 0): RuntimeError: boom"
    assert split in ranks[0]["errors"]["split_batch"]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_relative_flatness_across_ranks_equals_one_process(tmp_path):
    """``"batches"``: one process on the concatenated list; ``"split_batch"``: on the
    concatenated batch; ``"off"``: each rank alone; a failing rank raises on every rank."""
    ranks = run_ranks(tmp_path, "flatness")
    for mode in ("batches", "split_batch"):
        assert ranks[0][mode] == ranks[1][mode], mode
    whole = tuple(torch.cat([HALVES[0][i], HALVES[1][i]]) for i in range(2))
    expected = {
        "batches": flatness(model(), RANK_BATCHES[0] + RANK_BATCHES[1]),
        "split_batch": flatness(model(), [whole]),
    }
    for mode, single in expected.items():
        got = ranks[0][mode]
        assert (got["n"], got["mode"], got["world"]) == (single["n"], mode, 2)
        for field in ("per_batch", "losses"):
            torch.testing.assert_close(
                torch.tensor(got[field]), torch.tensor(single[field]), rtol=1e-9, atol=1e-12
            )
        assert got["value"] == pytest.approx(single["value"], rel=1e-9), mode
    for r in range(WORLD):
        alone = flatness(model(), RANK_BATCHES[r], "off")
        assert ranks[r]["off"] == {**alone, "mode": "off"}, r
        for mode in ("batches", "split_batch"):
            message = ranks[r]["errors"][mode]
            assert "rank 1: RuntimeError: boom (raised by loss_fn on batch" in message, message


def test_without_a_process_group_the_argument_changes_nothing():
    m, b = model(), [batch(30)]
    values = {
        mode: geodesic_sharpness(m, cross_entropy, b, distributed=mode, **KW).value
        for mode in ("batches", "split_batch", "off")
    }
    assert len(set(values.values())) == 1
    with pytest.raises(ValueError, match="distributed"):
        geodesic_sharpness(m, cross_entropy, b, distributed="ranks", **KW)


@pytest.mark.parametrize(
    ("name", "json_name", "curvature"),
    [("diagonal", "diagonal.json", "also"), ("transformers", "transformers.json", "off")],
)
def test_population_commands_under_torchrun_write_what_one_process_writes(
    tmp_path, name, json_name, curvature
):
    """``torchrun --nproc_per_node 2 quotientgeo reproduce NAME --quick``: the ranks split the
    population, rank 0 writes the JSON and figure of a single-process run, and the curvature
    rows' JSON where they run (the diagonal study; the ViT's take a minute more)."""
    pytest.importorskip("sklearn")
    base = [sys.executable, "-W", "ignore"]
    command = ["-m", "quotientgeo.cli", "reproduce", name, "--quick", "--no-progress",
               "--curvature", curvature]  # fmt: skip
    single, multi = tmp_path / "single", tmp_path / "multi"
    subprocess.run([*base, *command, "--out", str(single)], check=True, timeout=300,
                   capture_output=True)  # fmt: skip
    torchrun = [*base, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run([*torchrun, *command, "--out", str(multi)], timeout=300,
                          capture_output=True, text=True)  # fmt: skip
    # the first rank's own error comes before torchrun's summary
    assert done.returncode == 0, done.stderr[:4000] + "\n…\n" + done.stderr[-2000:]
    a = json.loads((single / json_name).read_text())
    b = json.loads((multi / json_name).read_text())
    assert b["ranks"] == 2 and a["ranks"] == 1
    assert a["kendall_tau"] == b["kendall_tau"]
    # diagonal: one record list per population
    pops = a.get("populations", {name: a})
    assert list(pops) == list(b.get("populations", {name: b}))
    for p in pops:
        one, two = (d["populations"][p] if "populations" in d else d for d in (a, b))
        for key in ("geodesic_mix", "geodesic_inv", "adaptive", "gap"):
            assert [m[key] for m in one["models"]] == [m[key] for m in two["models"]], (p, key)
    assert (multi / json_name.replace(".json", ".png")).stat().st_size > 1000
    rows = json_name.replace(".json", "_curvature.json")
    assert (single / rows).exists() == (multi / rows).exists() == (curvature == "also")
    if curvature == "also":
        a, b = (json.loads((out / rows).read_text())["populations"] for out in (single, multi))
        assert list(a) == list(b)
        for p in a:
            assert a[p]["members"] == b[p]["members"], p
            assert a[p]["kendall_tau"] == b[p]["kendall_tau"], p
