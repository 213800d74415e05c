"""CUDA paths: run wherever a GPU is available (skipped otherwise).

Sharpness on CUDA equals sharpness on the CPU in float64, the best point read on the host at
the step is the one host decisions keep, bf16 models give finite values, and GeodesicSAM keeps
one orbit one function on the GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

from quotientgeo import adaptive_sharpness, geodesic_sharpness
from quotientgeo.optim import GeodesicSAM
from quotientgeo.testing import TinyTransformerClassifier, cross_entropy, moved_along_orbits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
KW = dict(rho=0.05, n_iter=6, progress=False)


def problem(device, dtype=torch.float64):
    torch.manual_seed(0)
    model = TinyTransformerClassifier(d=16, heads=4, layers=2, classes=3).to(device, dtype).eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 5, 16, generator=gen, dtype=dtype).to(device)
    return model, [(x, torch.randint(0, 3, (8,), generator=gen).to(device))]


@pytest.mark.parametrize("measure", ["mix", "inv", "adaptive"])
def test_cuda_equals_cpu(measure):
    values = []
    for device in ("cpu", "cuda"):
        model, batches = problem(device)
        if measure == "adaptive":
            values.append(adaptive_sharpness(model, cross_entropy, batches, **KW).value)
        else:
            r = geodesic_sharpness(model, cross_entropy, batches, metric=measure, **KW)
            values.append(r.value)
    assert values[1] == pytest.approx(values[0], rel=1e-9)


def test_bfloat16_model_on_cuda():
    model, batches = problem("cuda", torch.bfloat16)
    with pytest.warns(UserWarning, match="bfloat16"):
        r = geodesic_sharpness(model, cross_entropy, batches, **KW)
    assert torch.isfinite(torch.tensor(r.value))


def test_geodesic_sam_on_cuda_keeps_one_orbit_one_function():
    model, batches = problem("cuda")
    moved = moved_along_orbits(copy.deepcopy(model).cpu(), scale=3.0, seed=1).cuda()
    for m in (model, moved):
        opt = GeodesicSAM(m, torch.optim.SGD, rho=0.2, lr=0.1)
        cross_entropy(m, batches[0]).backward()
        opt.first_step()
    x = batches[0][0]
    with torch.no_grad():
        torch.testing.assert_close(moved(x), model(x), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("product", ["double_backward", "finite_difference"])
def test_hessian_product_on_cuda_equals_cpu(product):
    """The Riemannian Hessian's product of one whitened probe: CUDA equals the CPU in
    float64, for both ways of computing ``∇²f ξ``."""
    from quotientgeo.curvature import RiemannianHessian

    products = []
    for device in ("cpu", "cuda"):
        model, batches = problem(device)
        H = RiemannianHessian(model, cross_entropy, batches, product=product)
        z = torch.randn(H.shape[0], generator=torch.Generator().manual_seed(2), dtype=H.dtype)
        products.append((H @ z.to(H.device)).cpu())
    assert products[0].abs().max() > 0
    rtol = 1e-9 if product == "double_backward" else 1e-6  # the O(t²) difference, same t
    torch.testing.assert_close(
        products[1], products[0], rtol=rtol, atol=rtol * products[0].abs().max().item()
    )


def test_cost_counter_counts_the_wait_not_the_non_blocking_copy():
    """A blocking copy to the host is a host read; a non-blocking one into pinned memory is
    not, the read of its value afterwards is."""
    from quotientgeo.bench.cost import CostCounter

    flag = torch.ones((), device="cuda") > 0
    with CostCounter() as c:
        flag.cpu()
    assert c.host_reads == 1
    pinned = torch.empty((), dtype=torch.bool, pin_memory=True)
    with CostCounter() as c:
        pinned.copy_(flag, non_blocking=True)
    assert c.host_reads == 0
    torch.cuda.synchronize()
    with CostCounter() as c:
        assert bool(pinned)
    assert c.host_reads == 1


def test_chunks_on_an_accelerator_take_a_larger_share_of_the_parameters():
    """On CUDA a kind is cut into fewer chunks than on the CPU (fewer kernel launches), with the
    same value."""
    from quotientgeo import find_symmetries
    from quotientgeo.geometry.perturbation import Perturbations
    from quotientgeo.testing import TinyTransformerClassifier as Model

    torch.manual_seed(0)
    model = Model(d=512, heads=8, layers=8, classes=3, dim_feedforward=2048).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, 512, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (4,), generator=gen)
    counts, values = [], []
    for device in ("cpu", "cuda"):
        model = model.to(device)
        space = Perturbations(find_symmetries(model), "second_order", radius=0.1)
        counts.append([len(chunks) for chunks in space.chunks])
        batches = [(x.to(device), y.to(device))]
        values.append(geodesic_sharpness(model, cross_entropy, batches, metric="mix", **KW).value)
    assert all(c > g for c, g in zip(counts[0], counts[1], strict=True)), counts
    assert values[1] == pytest.approx(values[0], rel=1e-9)
