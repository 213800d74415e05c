"""The Riemannian Hessian of models sharded with FSDP2 (``fully_shard``), under ``torchrun``
with 2 gloo processes on the CPU (tests/curvature/hessian_fsdp_worker.py).

With the finite-difference product, the top eigenvalue, a Hutchinson trace and one product of
a sharded tiny BERT (heads straddling the shards) and tiny Llama (grouped-query attention,
rotary embeddings) equal those of the same weights in one process to 1e-10 in float64, the
sharded model comes back bit-exactly, and the double-backward product is refused with the
reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

WORLD = 2
WORKER = Path(__file__).with_name("hessian_fsdp_worker.py")
MODELS = ["bert", "llama"]


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp") / "record"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(WORLD), str(WORKER), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-6000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(WORLD)]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-10 * max(1.0, abs(a))


@pytest.mark.parametrize("model", MODELS)
def test_sharded_curvature_equals_one_process(records, model):
    for record in records:
        alone, sharded = record[model]["alone"], record[model]["sharded"]
        assert close(alone["loss"], sharded["loss"])
        assert all(close(a, b) for a, b in zip(alone["top"], sharded["top"], strict=True))
        assert close(alone["trace"], sharded["trace"])
        scale = max(abs(v) for v in alone["product"])
        assert scale > 0
        gap = max(abs(a - b) for a, b in zip(alone["product"], sharded["product"], strict=True))
        assert gap <= 1e-10 * scale


@pytest.mark.parametrize("model", MODELS)
def test_sharded_model_is_restored_and_double_backward_refused(records, model):
    for record in records:
        assert record[model]["restored"]
        assert "finite_difference" in record[model]["double_backward_refused"]
