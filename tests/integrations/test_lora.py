"""PEFT LoRA adapters: measured and trained with no ``eps`` given, at ``B = 0`` and after.

A tiny random BERT (float64) with PEFT adapters on ``query`` and ``value``, ``B = 0`` as PEFT
initialises it. Discovery damps the adapters' pairs with ``FrameDamping()``,
``BᵀB ↦ BᵀB + (ρ/κ)² (AAᵀ)⁻¹``:

- trained adapters (``B ≠ 0``, full rank) moved along their GL(r) orbits by elements of
  condition number 6 give the same default geodesic sharpness to 1e-9; the old
  ``BallDamping()`` and the adaptive measure do not;

- every measure returns a finite value and leaves the model as it was;
- as the ball (and with it the relaxation) shrinks, mix sharpness over ``ρ`` and inv sharpness
  over ``ρ²`` converge (Cauchy ratios of successive differences), the mix limit at least the
  undamped mix gradient norm ``‖∇_B (A Aᵀ)⁻¹ᐟ²‖`` computed here by hand;
- with a fixed ball and an absolute relaxation instead, the mix value keeps growing as
  ``ε → 0``: that limit does not exist;
- GeodesicSAM (mix and inv) fine-tunes the adapters from ``B = 0`` with a finite, falling loss,
  each first step moving a factor no farther than its ball allows.
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from quotientgeo import (  # noqa: E402
    BallDamping,
    FrameDamping,
    adaptive_sharpness,
    average_sharpness,
    find_symmetries,
    geodesic_sharpness,
)
from quotientgeo.optim import GeodesicSAM  # noqa: E402
from quotientgeo.testing.assertions import assert_same, snapshot  # noqa: E402
from quotientgeo.testing.models import tiny_bert  # noqa: E402

DT = torch.float64


def lora_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"])
    return peft.get_peft_model(tiny_bert(DT), config).to(DT)


def regression_batches(n: int = 1) -> list:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 40, (8, 10), generator=gen), torch.randn(8, 10, 16, generator=gen))
        for _ in range(n)
    ]


def regression_loss(model, batch):
    ids, target = batch
    return (model(input_ids=ids).last_hidden_state - target.to(DT)).pow(2).mean()


def adapters(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(lora_A.weight, lora_B.weight)`` of every adapter."""
    params = dict(model.named_parameters())
    return [
        (a, params[name.replace("lora_A", "lora_B")])
        for name, a in params.items()
        if "lora_A" in name
    ]


def test_discovery_damps_adapters_in_the_frame_of_a():
    model = lora_bert()
    geometry = find_symmetries(model)
    assert len(geometry.blocks) == 4
    assert all(b.manifold.eps == FrameDamping() for b in geometry.blocks)
    assert all(float(b.detach().abs().max()) == 0 for _, b in adapters(model))  # PEFT's B = 0


def trained_lora_bert(steps: int = 30) -> torch.nn.Module:
    """:func:`lora_bert` after ``steps`` AdamW steps on the regression batch: ``B ≠ 0``."""
    model, batch = lora_bert(), regression_batches()[0]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        regression_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return model


def moved_adapters(model, condition: float, seed: int) -> torch.nn.Module:
    """A copy with every adapter moved along its orbit, ``(B, A) ↦ (B M, M⁻¹ A)``, by
    ``M = U diag(σ) Vᵀ`` (``U``, ``V`` random orthogonal, ``σ`` from 1 to ``condition``)."""
    moved, gen = copy.deepcopy(model), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a, b in adapters(moved):
            r = a.shape[0]
            U, V = (torch.linalg.qr(torch.randn(r, r, generator=gen, dtype=DT))[0] for _ in "UV")
            sigma = torch.logspace(0, math.log10(condition), r, dtype=DT)
            M = U @ torch.diag(sigma) @ V.T
            b.copy_(b @ M)
            a.copy_(torch.linalg.solve(M, a))
    return moved


def test_trained_adapters_moved_along_their_orbits_give_the_same_default_sharpness():
    """Default geodesic sharpness (mix, FrameDamping) is exactly GL(r)-invariant on trained
    adapters; the ball-scaled ``BallDamping()`` of the last release and the adaptive measure
    are not, so the test can tell."""
    model, batches = trained_lora_bert(), regression_batches()
    for _, b in adapters(model):  # trained away from B = 0, to full rank
        assert float(torch.linalg.svdvals(b.detach())[-1]) > 1e-3
    moved = moved_adapters(model, condition=6.0, seed=3)
    with torch.no_grad():  # the same function
        ids = batches[0][0]
        torch.testing.assert_close(
            moved(input_ids=ids).last_hidden_state,
            model(input_ids=ids).last_hidden_state,
            rtol=1e-12,
            atol=1e-12,
        )

    def gap(measure, **kw) -> float:
        one, two = (
            measure(m, regression_loss, batches, rho=0.05, **kw).value for m in (model, moved)
        )
        assert math.isfinite(one) and one > 0
        return abs(one - two) / abs(one)

    for metric in ("mix", "inv"):
        assert gap(geodesic_sharpness, metric=metric, n_iter=5) < 1e-9
    assert gap(geodesic_sharpness, n_iter=5, perturbation="exact") < 1e-9

    def ball(m):
        return find_symmetries(m).with_metric(None, eps=BallDamping())

    old = [
        geodesic_sharpness(m, regression_loss, batches, rho=0.05, symmetries=ball(m), n_iter=5)
        for m in (model, moved)
    ]
    assert abs(old[0].value - old[1].value) / old[0].value > 1e-6
    assert gap(adaptive_sharpness, n_iter=5) > 1e-3


def test_every_measure_is_finite_at_peft_initialisation():
    model, batches = lora_bert(), regression_batches()
    before = snapshot(model)
    values = [
        geodesic_sharpness(model, regression_loss, batches, rho=0.05, metric=metric, n_iter=4)
        for metric in ("mix", "inv")
    ]
    values.append(adaptive_sharpness(model, regression_loss, batches, rho=0.05, n_iter=4))
    values.append(average_sharpness(model, regression_loss, batches, rho=0.05, n_samples=4))
    assert all(math.isfinite(v.value) and v.value > 0 for v in values)
    assert_same(snapshot(model), before)


def undamped_mix_gradient_norm(model, batch) -> float:
    """``sqrt(Σ tr(∇_B (A Aᵀ)⁻¹ ∇_Bᵀ))``: the mix Riemannian gradient's norm at ``B = 0``, where
    the gradient of ``A`` vanishes."""
    model.zero_grad(set_to_none=True)
    regression_loss(model, batch).backward()
    total = 0.0
    for a, b in adapters(model):
        assert b.grad is not None and a.grad is not None and float(a.grad.abs().max()) == 0
        total += float(torch.trace(b.grad @ torch.linalg.solve(a @ a.T, b.grad.T)))
    model.zero_grad(set_to_none=True)
    return math.sqrt(total)


def cauchy(values: list[float]) -> None:
    """Successive differences shrink at least geometrically (ratio ½ per step of ρ / 4)."""
    diffs = [abs(x - y) for x, y in itertools.pairwise(values)]
    assert diffs[1] <= 0.5 * diffs[0], values


def test_sharpness_converges_as_the_ball_shrinks():
    model, batches = lora_bert(), regression_batches()
    radii = [1e-2, 2.5e-3, 6.25e-4]

    def value(rho, metric):
        return geodesic_sharpness(
            model, regression_loss, batches, rho=rho, metric=metric, n_iter=5
        ).value

    mix = [value(rho, "mix") / rho for rho in radii]
    inv = [value(rho, "inv") / rho**2 for rho in radii]
    cauchy(mix)
    cauchy(inv)
    # the ball holds the pure-B direction of the undamped gradient (its rotations of A add more)
    assert mix[-1] >= undamped_mix_gradient_norm(model, batches[0]) * (1 - 1e-3)


def test_an_absolute_relaxation_has_no_limit():
    """At a fixed ball the mix ball reaches ``‖ξ_A‖ = ρ/√ε``: the value grows as ``ε → 0``."""
    model, batches = lora_bert(), regression_batches()
    values = [
        geodesic_sharpness(
            model, regression_loss, batches, rho=0.05, metric="mix", eps=eps, n_iter=5
        ).value
        for eps in (1e-2, 1e-4, 1e-6)
    ]
    assert values[0] < values[1] < values[2] and values[2] > 10 * values[0], values


def ball_bounds(A: torch.Tensor, B: torch.Tensor, rho: float, metric: str):
    """How far a vector of metric norm ``ρ`` moves ``A`` and ``B`` (Frobenius norms) in the
    frame-damped metric, ``P_δ = BᵀB + δ (AAᵀ)⁻¹``, ``δ = (ρ/κ)²``:

    - mix, ``‖ξ_B A‖² + ‖B ξ_A‖² + δ ‖A⁺ξ_A‖² ≤ ρ²``: ``‖ξ_A‖ ≤ κ ‖A‖₂`` (``ξ_A = A A⁺ξ_A``)
      and ``‖ξ_B‖ ≤ ρ / σ_min(A)``;
    - inv, ``tr(P_δ⁻¹ ξ_Bᵀξ_B) + ‖A⁺ξ_A‖² ≤ ρ²``: ``‖ξ_A‖ ≤ ρ ‖A‖₂`` and
      ``‖ξ_B‖ ≤ ρ √λ_max(P_δ)``.
    """
    s, reach = torch.linalg.svdvals(A), FrameDamping().reach
    if metric == "mix":
        return reach * float(s[0]), rho / float(s[-1])
    P = B.T @ B + (rho / reach) ** 2 * torch.linalg.inv(A @ A.T)
    return rho * float(s[0]), rho * float(torch.linalg.eigvalsh(P)[-1].sqrt())


@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_geodesic_sam_fine_tunes_from_b_zero(metric):
    model, rho = lora_bert(), 0.05
    ids = torch.randint(0, 40, (16, 10), generator=torch.Generator().manual_seed(2))
    labels = torch.arange(16) % 3

    def loss():
        pooled = model(input_ids=ids).last_hidden_state.mean(1)
        return torch.nn.functional.cross_entropy(3 * pooled[:, :3], labels)

    opt = GeodesicSAM(model, torch.optim.AdamW, rho=rho, metric=metric, lr=1e-2)
    losses = []
    for _ in range(12):
        value = loss()
        value.backward()
        losses.append(value.item())
        start = [(a.detach().clone(), b.detach().clone()) for a, b in adapters(model)]
        opt.first_step(zero_grad=True)
        for (a0, b0), (a, b) in zip(start, adapters(model), strict=True):
            bounds = ball_bounds(a0, b0, rho, metric)
            for before, after, bound in ((a0, a, bounds[0]), (b0, b, bounds[1])):
                move = float((after - before).norm())
                # the second-order map adds its Christoffel term to the step: allow it 10 %
                assert move <= 1.1 * bound, (move, bound)
        loss().backward()
        opt.second_step(zero_grad=True)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.9 * losses[0], losses


def test_a_zero_adapter_with_eps_zero_names_the_default():
    model, batches = lora_bert(), regression_batches()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"lora_B\.default\.weight(.|\n)*FrameDamping\(\)"):
        geodesic_sharpness(model, regression_loss, batches, rho=0.05, eps=0.0, n_iter=2)
    assert_same(snapshot(model), before)


def test_geoopt_training_defaults_are_pefts():
    """With no ``eps``, the adapters train with PEFT's default ``reg``: one mix
    ``RiemannianSGD`` step from ``B = 0`` is PEFT's Riemannian SGD step with its defaults."""
    import geoopt
    from peft.optimizers import create_riemannian_optimizer

    from quotientgeo.optim import quotient_optimizer

    ours, theirs = lora_bert(), lora_bert()
    batch = regression_batches()[0]
    steps = [
        quotient_optimizer(ours, geoopt.optim.RiemannianSGD, lr=0.5),
        create_riemannian_optimizer(theirs, torch.optim.SGD, lr=0.5),
    ]
    for model, opt in zip((ours, theirs), steps, strict=True):
        regression_loss(model, batch).backward()
        opt.step()
    moved = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p, moved[name], rtol=0, atol=1e-12)
    assert any(float(b.detach().abs().max()) > 0 for _, b in adapters(ours))


def test_a_frame_damped_optimizer_step_moves_with_the_orbit():
    """With ``eps=FrameDamping(radius)`` a ``RiemannianSGD`` step is equivariant: an adapter and
    its orbit-moved copy step to one adapter product ``B A``."""
    import geoopt

    from quotientgeo.optim import quotient_optimizer

    start = trained_lora_bert(5)
    batch = regression_batches()[0]

    def products(eps) -> list[torch.Tensor]:
        """``B A`` of every adapter after one step, of ``start`` and of its moved copy."""
        out = []
        for m in (copy.deepcopy(start), moved_adapters(start, condition=6.0, seed=1)):
            opt = quotient_optimizer(m, geoopt.optim.RiemannianSGD, lr=0.1, eps=eps)
            regression_loss(m, batch).backward()
            opt.step()
            out.append(torch.stack([(b @ a).detach() for a, b in adapters(m)]))
        return out

    one, two = products(FrameDamping(0.1))
    torch.testing.assert_close(two, one, rtol=1e-12, atol=1e-14)
    one, two = products(None)  # PEFT's reg, ``eps·I``: not invariant
    assert float((two - one).abs().max()) > 1e-8


def test_adapters_in_a_fused_encoder_layer_are_warned():
    """``nn.TransformerEncoderLayer``'s fused inference path ignores adapters on its linears:
    discovery says so, and the warned hook makes the eval-mode output see them."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    model = peft.get_peft_model(
        torch.nn.Sequential(layer), peft.LoraConfig(r=2, target_modules=["linear1"])
    ).eval()
    for _, b in adapters(model):
        torch.nn.init.normal_(b)
    x = torch.randn(3, 5, 8)
    merged = copy.deepcopy(model).merge_and_unload()
    with torch.no_grad():
        fused, expected = model(x), merged(x)
    assert not torch.allclose(fused, expected, atol=1e-4)  # the adapter is ignored
    with pytest.warns(UserWarning, match="fused fast path"):
        find_symmetries(model)
    layer.register_forward_pre_hook(lambda *a: None)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        find_symmetries(model)  # hooked: no fast path to warn about
    assert not [w for w in caught if "fused fast path" in str(w.message)]
