"""One rank of ``torchrun --nproc_per_node 2 tests/curvature/hessian_fsdp_worker.py OUT``: the
Riemannian Hessian (finite-difference product) of models sharded with FSDP2 (``fully_shard``)
against the same weights in one process.

Each rank measures the unsharded model alone, then a copy sharded per layer and at the root,
passed as it is, with the same batches on every rank; it writes ``OUT.<rank>`` (JSON): the top
eigenvalue, a Hutchinson trace and one product of both, whether the sharded model came back
bit-exactly, and the message that refuses the double-backward product.
tests/curvature/test_hessian_fsdp.py launches it and checks the records.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import quotientgeo as qg
from quotientgeo.curvature import RiemannianHessian

# the same tiny BERT and Llama as the sharded sharpness measures (tests/geometry/fsdp_worker.py)
sys.path.insert(0, str(Path(__file__).parents[1] / "geometry"))
from fsdp_worker import MODELS

DT = torch.float64
FD = dict(product="finite_difference", progress=False)


def figures(model, loss_fn, batches) -> dict:
    top = qg.hessian_eigenvalues(model, loss_fn, batches, k=1, tol=1e-12, **FD)
    trace = qg.hessian_trace(model, loss_fn, batches, n_probes=4, seed=0, **FD)
    H = RiemannianHessian(model, loss_fn, batches, product="finite_difference")
    z = torch.randn(H.dim, dtype=DT, generator=torch.Generator().manual_seed(2))
    return {
        "top": [float(v) for v in top.values],
        "trace": float(trace.value),
        "product": (H @ z).tolist(),
        "loss": float(H.loss),
    }


def sharded(model: torch.nn.Module, layers) -> torch.nn.Module:
    copy_ = copy.deepcopy(model)
    for layer in layers(copy_):
        fully_shard(layer)
    fully_shard(copy_)
    return copy_


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 40, (4, 7), generator=gen) for _ in range(2)]
    record: dict = {}
    for name, (build, loss_fn, layers) in MODELS.items():
        model = build()
        alone = figures(model, loss_fn, batches)
        split = sharded(model, layers)
        before = {n: p.to_local().clone() for n, p in split.named_parameters()}
        grads = {n: p.grad for n, p in split.named_parameters()}
        got = figures(split, loss_fn, batches)
        try:
            RiemannianHessian(split, loss_fn, batches)
            refused = ""
        except ValueError as err:
            refused = str(err)
        record[name] = {
            "alone": alone,
            "sharded": got,
            "restored": all(
                torch.equal(p.to_local(), before[n]) for n, p in split.named_parameters()
            )
            and all(p.grad is grads[n] for n, p in split.named_parameters()),
            "double_backward_refused": refused,
        }
    with open(f"{out}.{rank}", "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads may abort an ordinary interpreter exit


if __name__ == "__main__":
    main(sys.argv[1])
