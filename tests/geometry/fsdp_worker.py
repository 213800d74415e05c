"""One rank of ``torchrun --nproc_per_node 2 tests/geometry/fsdp_worker.py OUT``: sharpness and
GeodesicSAM on models sharded with FSDP2 (``fully_shard``), against the same weights in one
process.

Each rank measures the unsharded model alone (``distributed="off"``), then a copy sharded per
layer and at the root, passed as it is; it writes ``OUT.<rank>`` (JSON): both values of every
measure, whether the sharded model came back bit-exactly, the bytes of the maximiser's
parameter-sized buffers on this rank and in one process, and the largest difference between
GeodesicSAM's steps on the two. tests/geometry/test_fsdp.py launches it and checks the records.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
import transformers as hf
from torch.distributed.fsdp import fully_shard

import quotientgeo as qg
import quotientgeo.sharpness.objective as objective_module
from quotientgeo.optim import GeodesicSAM

DT = torch.float64
KW = dict(rho=0.05, n_iter=6, progress=False)


def bert() -> torch.nn.Module:
    """Width 12, 3 heads: with 2 ranks, head 1's query rows (4 to 7) straddle the shards
    (rows 0-5 and 6-11), and every head's output-projection columns are split by rows."""
    torch.manual_seed(0)
    config = hf.BertConfig(
        vocab_size=40, hidden_size=12, num_hidden_layers=2, num_attention_heads=3,
        intermediate_size=20, max_position_embeddings=12, attn_implementation="eager",
    )  # fmt: skip
    return hf.BertModel(config).to(DT).eval()


def llama() -> torch.nn.Module:
    """Grouped-query attention (6 query heads, 2 key/value heads) and rotary embeddings."""
    torch.manual_seed(0)
    config = hf.LlamaConfig(
        vocab_size=40, hidden_size=24, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, intermediate_size=32, max_position_embeddings=16,
    )  # fmt: skip
    return hf.LlamaForCausalLM(config).to(DT).eval()


def bert_loss(model, ids):
    return model(input_ids=ids).last_hidden_state.square().mean()


def llama_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


MODELS = {
    "bert": (bert, bert_loss, lambda m: m.encoder.layer),
    "llama": (llama, llama_loss, lambda m: m.model.layers),
}


def measures(model, loss_fn, batches, **kw) -> dict[str, float]:
    return {
        "mix": qg.geodesic_sharpness(model, loss_fn, batches, metric="mix", **KW, **kw).value,
        "inv": qg.geodesic_sharpness(model, loss_fn, batches, metric="inv", **KW, **kw).value,
        "inv_second_order": qg.geodesic_sharpness(
            model, loss_fn, batches, metric="inv", perturbation="second_order", **KW, **kw
        ).value,
        "adaptive": qg.adaptive_sharpness(model, loss_fn, batches, **KW, **kw).value,
        "average": qg.average_sharpness(
            model, loss_fn, batches, rho=0.05, n_samples=3, progress=False, **kw
        ).value,
    }


def sharded(model: torch.nn.Module, layers) -> torch.nn.Module:
    copy_ = copy.deepcopy(model)
    for layer in layers(copy_):
        fully_shard(layer)
    fully_shard(copy_)
    return copy_


def state_bytes() -> list[int]:
    """Records the bytes of every new Objective's parameter-sized buffers (a hook for the
    check that each rank holds its share)."""
    seen: list[int] = []
    init = objective_module.Objective.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        buffers = [self.x0, self.previous, self.current, self.best or {}]
        seen.append(sum(t.numel() * t.element_size() for b in buffers for t in b.values()))

    objective_module.Objective.__init__ = recording
    return seen


def parking() -> list[str]:
    """Records the names that the measures' hooks park (the current iterate moved into the
    weights once the reduce-scatter wrote the gradient shard)."""
    parked: list[str] = []
    park = objective_module.Objective._park

    def recording(self, name, param):
        before = name in self._parked
        park(self, name, param)
        if not before and name in self._parked:
            parked.append(name)

    objective_module.Objective._park = recording
    return parked


def sam_gap(model, loss_fn, ids, layers, variant: str) -> float:
    """Largest difference of the weights after two GeodesicSAM steps on the model alone and on
    its sharded copy."""
    alone, split = copy.deepcopy(model), sharded(model, layers)
    for m in (alone, split):
        opt = GeodesicSAM(m, torch.optim.SGD, rho=0.05, lr=0.1, variant=variant)
        for _ in range(2):
            opt.step(lambda m=m: loss_fn(m, ids).backward())
            opt.zero_grad()
    return max(
        float((p.full_tensor() - q).abs().max())
        for p, q in zip(split.parameters(), alone.parameters(), strict=True)
    )


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 40, (4, 7), generator=gen)
    record: dict = {}
    sizes = state_bytes()
    parked = parking()
    for name, (build, loss_fn, layers) in MODELS.items():
        model = build()
        alone = measures(model, loss_fn, [ids], distributed="off")
        split = sharded(model, layers)
        before = {n: p.to_local().clone() for n, p in split.named_parameters()}
        grads = {n: p.grad for n, p in split.named_parameters()}
        parked.clear()
        got = measures(split, loss_fn, [ids])
        parked_sharded = len(parked)
        try:
            qg.adaptive_sharpness(split, loss_fn, [ids], distributed="batches", **KW)
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
            "batches_refused": refused,
            "parked_sharded": parked_sharded,
            "sam": {
                v: sam_gap(model, loss_fn, ids, layers, v) for v in ("geodesic", "sam", "asam")
            },
        }
    # the maximiser's buffers: the first measure of each model ran alone, the sixth sharded
    record["state_bytes"] = {"alone": sizes[0], "sharded": sizes[5]}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads may abort an ordinary interpreter exit


if __name__ == "__main__":
    main(sys.argv[1])
