"""GeodesicSAM: the perturbation of each variant, invariance along orbits, the base step, state.

- ``first_step`` moves by a horizontal vector of metric norm ρ (geodesic), or by the papers'
  formulas (SAM: ``ρ g / ||g||``; ASAM: ``ρ |w|² g / || |w| g ||``);
- two models on one orbit hold one function after ``first_step`` with the geodesic variant,
  not with SAM or ASAM;
- ``second_step`` gives the original weights plus exactly the base optimizer's update from the
  perturbed-point gradient; state dicts round-trip; bad input raises.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from quotientgeo import find_symmetries
from quotientgeo.optim import GeodesicSAM
from quotientgeo.testing import TinyTransformerClassifier, cross_entropy, moved_along_orbits

DT = torch.float64


def problem(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyTransformerClassifier(d=16, heads=4, layers=2, classes=3).to(DT).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(8, 5, 16, generator=gen, dtype=DT)
    return model, (x, torch.randint(0, 3, (8,), generator=gen))


def sgd(model, **kw):
    return GeodesicSAM(model, torch.optim.SGD, lr=0.1, **kw)


def params_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def displacement(opt, model, batch):
    """``(gathered points and rest before, after first_step)``."""
    cross_entropy(model, batch).backward()
    before = opt.geometry.gather()
    opt.first_step(zero_grad=True)
    return before, opt.geometry.gather()


@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_geodesic_first_order_step_is_horizontal_with_norm_rho(metric):
    model, batch = problem()
    rho = 0.07
    opt = sgd(model, rho=rho, metric=metric, perturbation="first_order")
    (x0, w0), (x1, w1) = displacement(opt, model, batch)
    sq = 0.0
    for m, a, b in zip(opt.manifolds, x0, x1, strict=True):
        xi = b - a
        torch.testing.assert_close(m.proju(a, xi), xi, rtol=1e-10, atol=1e-12)
        sq += float(m.inner(a, xi).sum())
    sq += float(opt.rest.inner(w0, w1 - w0))
    assert sq == pytest.approx(rho**2, rel=1e-10)


def test_geodesic_second_order_step_is_expmap2_of_the_first_order_one():
    model, batch = problem()
    first = sgd(copy.deepcopy(model), rho=0.1, perturbation="first_order")
    (x0, _), (x1, w1) = displacement(first, first.model, batch)
    second = sgd(copy.deepcopy(model), rho=0.1)
    _, (x2, w2) = displacement(second, second.model, batch)
    for m, a, b, c in zip(second.manifolds, x0, x1, x2, strict=True):
        torch.testing.assert_close(c, m.expmap2(a, b - a), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w2, w1, rtol=1e-14, atol=0.0)  # the rest moves straight
    assert not torch.equal(x1[0], x2[0])  # the curvature term is there


def test_sam_and_asam_match_the_papers_formulas():
    model, batch = problem()
    rho = 0.05
    cross_entropy(model, batch).backward()
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    expected = {
        "sam": w + rho * g / g.norm(),
        "asam": w + rho * w.square() * g / (w.abs() * g).norm(),
    }
    for variant, target in expected.items():
        m = copy.deepcopy(model)  # a deep copy has no .grad
        opt = sgd(m, rho=rho, variant=variant)
        cross_entropy(m, batch).backward()
        opt.first_step()
        got = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        torch.testing.assert_close(got, target, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize(
    ("kw", "invariant"),
    [
        ({"variant": "geodesic", "metric": "mix"}, True),
        ({"variant": "geodesic", "metric": "inv"}, True),
        ({"variant": "geodesic", "perturbation": "exact"}, True),
        ({"variant": "sam"}, False),
        ({"variant": "asam"}, False),
    ],
)
def test_first_step_keeps_one_orbit_one_function(kw, invariant):
    model, batch = problem()
    moved = moved_along_orbits(model, scale=3.0, seed=1)
    x = batch[0]
    torch.testing.assert_close(moved(x), model(x), rtol=1e-10, atol=1e-12)
    for m in (model, moved):
        opt = sgd(m, rho=0.2, **kw)
        cross_entropy(m, batch).backward()
        opt.first_step()
    with torch.no_grad():
        change = float((moved(x) - model(x)).abs().max() / model(x).abs().max())
    if invariant:
        assert change < 1e-9, change
    else:
        assert change > 1e-4, change


def test_second_step_is_the_base_update_from_the_perturbed_gradient():
    model, batch = problem()
    reference = copy.deepcopy(model)
    kw = dict(lr=1e-2, weight_decay=0.05, betas=(0.8, 0.9))
    opt = GeodesicSAM(model, torch.optim.AdamW, rho=0.1, **kw)
    base = torch.optim.AdamW(reference.parameters(), **kw)
    for _ in range(3):  # the base optimizer's state carries over steps
        cross_entropy(model, batch).backward()
        opt.first_step(zero_grad=True)
        cross_entropy(model, batch).backward()
        perturbed_grads = [p.grad.clone() for p in model.parameters()]
        opt.second_step(zero_grad=True)
        for p, g in zip(reference.parameters(), perturbed_grads, strict=True):
            p.grad = g
        base.step()
        base.zero_grad()
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(a, b)
        assert all(p.grad is None for p in model.parameters())


def test_step_with_closure_equals_the_two_steps_and_state_round_trips():
    model, batch = problem()
    twin = copy.deepcopy(model)
    opt = GeodesicSAM(model, torch.optim.AdamW, rho=0.1, lr=1e-2)
    opt_twin = GeodesicSAM(twin, torch.optim.AdamW, rho=0.1, lr=1e-2)

    def closure():
        loss = cross_entropy(model, batch)
        loss.backward()
        return loss

    for _ in range(2):
        loss = opt.step(closure)
        cross_entropy(twin, batch).backward()
        opt_twin.first_step(zero_grad=True)
        cross_entropy(twin, batch).backward()
        opt_twin.second_step(zero_grad=True)
        opt.zero_grad()
    assert loss.ndim == 0
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    # the state dict is the base optimizer's; loading it continues identically
    third = copy.deepcopy(model)
    opt_third = GeodesicSAM(third, torch.optim.AdamW, rho=0.1, lr=1e-2)
    opt_third.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt_third.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    for o, m in ((opt, model), (opt_third, third)):
        cross_entropy(m, batch).backward()
        o.first_step(zero_grad=True)
        cross_entropy(m, batch).backward()
        o.second_step(zero_grad=True)
    for a, b in zip(model.parameters(), third.parameters(), strict=True):
        assert torch.equal(a, b)


def test_learning_rate_schedulers_act_on_the_base_optimizer():
    model, batch = problem()
    opt = GeodesicSAM(model, torch.optim.SGD, rho=0.1, lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def closure():
        loss = cross_entropy(model, batch)
        loss.backward()
        return loss

    for expected in (0.5, 0.25):
        opt.step(closure)
        opt.zero_grad()
        scheduler.step()
        assert opt.base_optimizer.param_groups[0]["lr"] == expected


def test_user_blocks_and_frozen_parameters():
    model, batch = problem()
    model.head.weight.requires_grad_(False)
    geometry = find_symmetries(model)
    opt = sgd(model, rho=0.1, symmetries=geometry)
    assert opt.geometry is geometry
    frozen = model.head.weight.detach().clone()
    cross_entropy(model, batch).backward()
    opt.first_step(zero_grad=True)
    cross_entropy(model, batch).backward()
    opt.second_step()
    assert torch.equal(model.head.weight, frozen)


def test_bad_input():
    model, batch = problem()
    for rho in (0.0, -1.0):
        with pytest.raises(ValueError, match="rho"):
            sgd(model, rho=rho)
    with pytest.raises(ValueError, match="variant"):
        sgd(model, variant="adam")
    with pytest.raises(ValueError, match="metric"):
        sgd(model, metric="flat")
    with pytest.raises(ValueError, match="perturbation"):
        sgd(model, perturbation="third_order")
    with pytest.raises(TypeError, match="compile"):
        sgd(model, compile=1)
    with pytest.raises(ValueError, match="another model"):
        sgd(model, symmetries=find_symmetries(copy.deepcopy(model)))
    frozen = nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        sgd(frozen)
    opt = sgd(model)
    with pytest.raises(RuntimeError, match="first_step"):
        opt.second_step()
    cross_entropy(model, batch).backward()
    opt.first_step()
    with pytest.raises(RuntimeError, match="twice"):
        opt.first_step()
    with pytest.raises(ValueError, match="closure"):
        opt.step()


def _rank(rank: int, world: int, init: str, out: str, average: bool) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model, _ = problem()
        batch = problem(seed=10 + rank)[1]  # each rank its own batch
        opt = GeodesicSAM(model, torch.optim.SGD, rho=0.1, lr=0.5, average_gradients=average)
        opt.step(lambda: cross_entropy(model, batch).backward())
        if rank == 0:
            torch.save({n: p.detach() for n, p in model.named_parameters()}, out)
        torch.distributed.barrier()  # torch 2.6's gloo can hang in a teardown without it
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("average", [True, False])
def test_gradients_are_averaged_over_ranks_only_when_asked(tmp_path, average):
    """Two gloo processes with one batch each: with ``average_gradients=True`` they step like
    one process on the mean loss; by default each rank steps on its own gradient, like one
    process on its own batch (ranks may train different models)."""
    out = tmp_path / "rank0.pt"
    init = f"file://{tmp_path / 'store'}"
    torch.multiprocessing.spawn(_rank, args=(2, init, str(out), average), nprocs=2, join=True)
    model, _ = problem()
    batches = [problem(seed=10 + r)[1] for r in range(2 if average else 1)]
    opt = GeodesicSAM(model, torch.optim.SGD, rho=0.1, lr=0.5)

    def mean_loss():
        loss = sum(cross_entropy(model, b) for b in batches) / len(batches)
        loss.backward()
        return loss

    opt.step(mean_loss)
    distributed = torch.load(out, weights_only=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(distributed[name], p.detach(), rtol=1e-12, atol=1e-14)


def test_bfloat16_parameters_and_autocast():
    """bf16 weights: the geometry runs in float32, the step restores the bf16 weights exactly;
    float32 weights under bf16 autocast step as usual."""
    torch.manual_seed(0)
    model = TinyTransformerClassifier(d=16, heads=4, layers=1, classes=3).to(torch.bfloat16)
    x, y = torch.randn(8, 5, 16, dtype=torch.bfloat16), torch.randint(0, 3, (8,))
    opt = GeodesicSAM(model, torch.optim.SGD, rho=0.05, lr=0.0)
    before = params_of(model)
    cross_entropy(model, (x, y)).backward()
    opt.first_step(zero_grad=True)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    cross_entropy(model, (x, y)).backward()
    opt.second_step(zero_grad=True)  # lr = 0: the weights are exactly the originals
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n

    model = TinyTransformerClassifier(d=16, heads=4, layers=1, classes=3)
    opt = GeodesicSAM(model, torch.optim.AdamW, rho=0.05, lr=1e-3)

    def closure():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = cross_entropy(model, (x.float(), y))
        loss.backward()
        return loss

    before = params_of(model)
    opt.step(closure)
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_repr_shows_the_variant_radius_metric_map_and_base_optimizer():
    torch.manual_seed(0)
    model = TinyTransformerClassifier(d=16, heads=2, layers=1, classes=3)
    text = repr(GeodesicSAM(model, torch.optim.AdamW, rho=0.02, metric="inv", lr=1e-3))
    for part in ("variant='geodesic'", "rho=0.02", "metric='inv'", "perturbation='second_order'"):
        assert part in text
    assert "blocks=2" in text and "AdamW (" in text and "lr: 0.001" in text
    text = repr(GeodesicSAM(model, torch.optim.SGD, rho=0.5, variant="asam", lr=0.1))
    assert text.startswith("GeodesicSAM(variant='asam', rho=0.5, base_optimizer=SGD (")
    assert "metric" not in text.split("base_optimizer")[0]
