"""Models sharded with FSDP2 (``fully_shard``), measured and trained as they are, under
``torchrun`` with 2 gloo processes on the CPU (tests/geometry/fsdp_worker.py).

Every measure of a sharded tiny BERT (heads straddling the shards) and tiny Llama (grouped-query
attention, rotary embeddings) equals the value of the same weights in one process to 1e-10 in
float64 (with the current iterate parked in the local shards during the backward pass), the
sharded model comes back bit-exactly, each rank holds half of the maximiser's
buffers, ``distributed="batches"`` is refused with the reason, and GeodesicSAM's steps (all
three variants) equal the steps in one process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

WORLD = 2
WORKER = Path(__file__).with_name("fsdp_worker.py")


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp") / "record"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(WORLD), str(WORKER), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-6000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("model", ["bert", "llama"])
def test_sharded_sharpness_equals_one_process(records, model):
    for record in records:
        alone, sharded = record[model]["alone"], record[model]["sharded"]
        assert alone.keys() == sharded.keys()
        for name, value in alone.items():
            assert value != 0.0, name
            assert sharded[name] == pytest.approx(value, rel=1e-10, abs=0), name
    # the ranks agree with each other
    assert records[0][model]["sharded"] == records[1][model]["sharded"]


@pytest.mark.parametrize("model", ["bert", "llama"])
def test_the_current_iterate_of_a_sharded_model_is_parked(records, model):
    """FSDP2 calls the post-accumulate-grad hooks after its reduce-scatter: the equality above
    holds with the current iterate parked in the local shards."""
    for record in records:
        assert record[model]["parked_sharded"] > 0


@pytest.mark.parametrize("model", ["bert", "llama"])
def test_sharded_model_is_restored_and_batches_mode_refused(records, model):
    for record in records:
        assert record[model]["restored"]
        assert "cannot measure a model sharded over the ranks" in record[model]["batches_refused"]


def test_each_rank_holds_its_share_of_the_maximisers_buffers(records):
    for record in records:
        alone, sharded = record["state_bytes"]["alone"], record["state_bytes"]["sharded"]
        # Shard(0) splits every parameter's rows; odd row counts leave one rank a row more
        assert sharded == pytest.approx(alone / WORLD, rel=0.1)
    total = sum(r["state_bytes"]["sharded"] for r in records)
    assert total == records[0]["state_bytes"]["alone"]


@pytest.mark.parametrize("model", ["bert", "llama"])
def test_geodesic_sam_steps_a_sharded_model_like_one_process(records, model):
    for record in records:
        for variant, gap in record[model]["sam"].items():
            assert gap < 1e-12, variant
