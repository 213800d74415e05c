"""The finite difference's default step on a decoder whose parameters have different scales.

A random Llama (Hugging Face's, initialised as it is: weights of standard deviation 0.02, norm
weights 1) is strongly non-quadratic along its top eigenvector: the central difference's
truncation error there is about ``10³ s²`` at a relative displacement ``s`` of the attention
heads. The step is therefore relative to each part's own scale (each kind of symmetry blocks,
each parameter of the adaptive rest), not to the largest entry of the whole model (the norm
weights' 1), which displaced the heads by about 10 % of themselves and missed these products by
1.3e-2 to 0.52 in float32.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as hf
from curvature_models import TwoFactor, cubic_loss, data
from scipy.sparse.linalg import eigsh

from quotientgeo.curvature import RiemannianHessian
from quotientgeo.curvature.operator import default_step

#: The float32 finite difference's relative error against float64 double backward.
TOLERANCE = 3e-3


def _llama(seed: int, dtype: torch.dtype) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    config = hf.LlamaConfig(
        hidden_size=32,
        intermediate_size=88,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hf.LlamaForCausalLM._from_config(config, attn_implementation="eager")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed + 1))
    return model.to(dtype).eval(), [ids]


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("geometry", ["riemannian", "euclidean"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_default_step_agrees_with_double_backward_in_float32(seed, geometry):
    model, batches = _llama(seed, torch.float64)
    exact = RiemannianHessian(model, _loss, batches, metric="mix", geometry=geometry)
    _, vectors = eigsh(exact.to_scipy(), k=1, which="LA", tol=1e-8)
    top = torch.from_numpy(vectors[:, 0])
    gen = torch.Generator().manual_seed(seed + 2)
    probe = torch.randn(exact.dim, dtype=torch.float64, generator=gen)
    directions = {"top eigenvector": top, "random": probe / probe.norm()}
    fd = RiemannianHessian(
        model.float(), _loss, batches, metric="mix", geometry=geometry, product="finite_difference"
    )
    assert fd.dtype == torch.float32
    for name, z in directions.items():
        reference = exact @ z
        product = (fd @ z.float()).double()
        error = float((product - reference).norm() / reference.norm())
        assert error < TOLERANCE, (name, error)


def test_default_step_follows_the_widest_spaced_dtype():
    assert default_step(torch.float32) == pytest.approx(
        torch.finfo(torch.float32).eps ** (1 / 3) / 8
    )
    assert default_step(torch.float32, torch.bfloat16) == default_step(torch.bfloat16)
    assert default_step(torch.float64) < default_step(torch.float32) < default_step(torch.bfloat16)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e2])
def test_step_is_relative_to_each_part(scale):
    """The largest displacement of a part (the head ``(G, H)``, the bias), relative to its
    scale (its largest entry, at least the weights' root mean square), is ``step``, with the
    bias and its ``ξ`` scaled by ``scale``."""
    model = TwoFactor(bias=True)
    with torch.no_grad():
        model.b.mul_(scale)
    fd = RiemannianHessian(
        model,
        cubic_loss,
        data(),
        symmetries=model.geometry(),
        geometry="euclidean",
        product="finite_difference",
        step=1e-3,
    )
    z = torch.randn(fd.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    z[-model.b.numel() :] *= scale
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    writes = []
    write = fd._loss._write

    def spy(w, rest=None, xi=None):
        write(w, rest, xi)
        if rest is not None:
            writes.append({n: p.detach().clone() for n, p in model.named_parameters()})

    fd._loss._write = spy
    fd @ z
    assert len(writes) == 2  # x + tξ, x - tξ
    rms = torch.cat([t.reshape(-1) for t in base.values()]).square().mean().sqrt()
    relative = []
    for names in ("GH", "b"):
        moved = max((writes[0][n] - base[n]).abs().max() for n in names)
        size = max(base[n].abs().max() for n in names)
        relative.append(float(moved / torch.maximum(size, rms)))
    assert max(relative) == pytest.approx(1e-3, rel=1e-9)
