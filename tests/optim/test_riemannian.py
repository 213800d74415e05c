"""quotient_optimizer: geoopt's optimizers on a model's symmetry blocks, the rest Euclidean.

- one ``RiemannianSGD`` step with the mix metric and ``eps = reg`` equals one step of PEFT's
  Riemannian preconditioned SGD on every parameter (LoRA ``B`` random or zero);
- the step on a partly covered parameter: blocks on the manifold, the rest Euclidean, against
  an independent scatter of the expected points;
- SGD (with momentum started at zero) and Adam steps follow their formulas: heavy ball and
  per-head metric second moments with moments transported by projection; the rest as torch's
  SGD and Adam;
- the steps commute with the group action: a model moved along its orbits keeps its function
  after them (not with plain SGD, nor on LoRA with PEFT's preconditioned AdamW);
- RiemannianAdam trains a LoRA model that stays a plain PEFT model (state dict keys,
  ``save_pretrained``, ``merge_and_unload``); weights loaded between steps are where the next
  step starts; state dicts round-trip; ``zero_grad``, missing gradients, half
  precision, hooks, schedulers and bad input.
"""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
from torch import nn

from quotientgeo import ParameterGeometry, Source, find_symmetries
from quotientgeo.geometry.transfer import scatter
from quotientgeo.optim import QuotientOptimizer, quotient_optimizer
from quotientgeo.testing import TinyTransformerClassifier, cross_entropy, moved_along_orbits

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=FutureWarning)
    import geoopt


DT = torch.float64
SGD = geoopt.optim.RiemannianSGD
ADAM = geoopt.optim.RiemannianAdam


# ---------------------------------------------------------------------- models
def lora_bert(seed: int, r: int, *, random_b: bool) -> nn.Module:
    """A 2-layer BERT classifier in float64 with LoRA on query and value (PEFT, rank ``r``) and
    its trainable classifier head; ``B = 0`` as PEFT initialises it unless ``random_b``."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=24,
        max_position_embeddings=12,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    model = transformers.BertForSequenceClassification(config).to(DT)
    lora = peft.LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=["query", "value"],
        task_type="SEQ_CLS",
        init_lora_weights=not random_b,  # False: B random too
    )
    return peft.get_peft_model(model, lora).eval()


def token_batch(seed: int, n: int = 6, seq: int = 10):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40, (n, seq), generator=gen), torch.randint(0, 3, (n,), generator=gen)


def bert_loss(model, batch) -> torch.Tensor:
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


def transformer(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyTransformerClassifier(d=16, heads=4, layers=2, classes=3).to(DT).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(8, 5, 16, generator=gen, dtype=DT)
    return model, (x, torch.randint(0, 3, (8,), generator=gen))


def create_riemannian_optimizer(model, optimizer_cls, **kwargs):
    """PEFT's Riemannian preconditioned LoRA optimizer (``peft.optimizers``)."""
    optimizers = pytest.importorskip("peft.optimizers")
    return optimizers.create_riemannian_optimizer(model, optimizer_cls, **kwargs)


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def every_parameter(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------- PEFT equality
@pytest.mark.parametrize(("seed", "r"), [(0, 4), (1, 2), (2, 3)])
@pytest.mark.parametrize("random_b", [True, False], ids=["B random", "B zero"])
def test_sgd_step_equals_peft_riemannian_preconditioned_sgd(seed, r, random_b):
    reg, lr = 1e-2, 0.3
    model = lora_bert(seed, r, random_b=random_b)
    theirs = copy.deepcopy(model)
    batch = token_batch(seed)
    before = every_parameter(model)
    ours = quotient_optimizer(model, SGD, lr=lr, metric="mix", eps=reg)
    peft_opt = create_riemannian_optimizer(theirs, torch.optim.SGD, lr=lr, reg=reg)
    for m, opt in ((model, ours), (theirs, peft_opt)):
        bert_loss(m, batch).backward()
        opt.step()
    got, expected = every_parameter(model), every_parameter(theirs)
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-12, msg=name)
    moved = [n for n in got if not torch.equal(got[n], before[n])]
    assert any("lora_B" in n for n in moved) and any("classifier" in n for n in moved)
    assert any("lora_A" in n for n in moved) == random_b  # g_A = Bᵀ(...) = 0 at B = 0
    assert all(p.requires_grad for n, p in model.named_parameters() if n in moved)


def test_sgd_step_differs_from_peft_with_another_relaxation():
    """The comparison above can fail: ``eps ≠ reg`` gives another step."""
    reg, lr = 1e-2, 0.3
    model = lora_bert(0, 4, random_b=True)
    theirs = copy.deepcopy(model)
    batch = token_batch(0)
    ours = quotient_optimizer(model, SGD, lr=lr, eps=3 * reg)
    peft_opt = create_riemannian_optimizer(theirs, torch.optim.SGD, lr=lr, reg=reg)
    for m, opt in ((model, ours), (theirs, peft_opt)):
        bert_loss(m, batch).backward()
        opt.step()
    got, expected = trainable(model), trainable(theirs)
    gap = max(float((got[n] - expected[n]).abs().max()) for n in got if "lora" in n)
    assert gap > 1e-6, gap


# ---------------------------------------------------------------------- the step itself
class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_partly_covered_parameters_step_on_the_manifold_and_euclidean(metric):
    """Hidden units 0..3 as 4 GL(1) heads (``fc1`` rows and bias, ``fc2`` columns): their entries
    step by ``x - lr·egrad2rgrad(x, ∇)``, the other entries of the same tensors by
    ``w - lr·g``."""
    torch.manual_seed(0)
    model = TwoLayer().to(DT)
    geometry = ParameterGeometry(model).add_gl_pair(
        [Source("fc1.weight", rows=(0, 4)), Source("fc1.bias", rows=(0, 4))],
        Source("fc2.weight", axis=1, cols=(0, 4)),
        heads=4,
        metric=metric,
    )
    assert set(geometry.partial_names) == {"fc1.weight", "fc1.bias", "fc2.weight"}
    x, y = torch.randn(7, 4, dtype=DT), torch.randint(0, 3, (7,))
    nn.functional.cross_entropy(model(x), y).backward()
    lr = 0.2
    (point,), _ = geometry.gather()
    (grad,), _ = geometry.gather({n: p.grad for n, p in geometry.params.items()})
    manifold = geometry.kinds[0].manifold
    stepped = point - lr * manifold.egrad2rgrad(point, grad)
    euclidean = {n: p.detach() - lr * p.grad for n, p in geometry.params.items()}
    expected = {**euclidean, **scatter(geometry.plan, euclidean, [stepped], None)}
    opt = quotient_optimizer(model, SGD, lr=lr, symmetries=geometry)
    assert [len(g["params"]) for g in opt.param_groups] == [1, 4]  # the point; all 4 tensors
    opt.step()
    for name, p in geometry.params.items():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-13, atol=1e-15)
    # the Riemannian step differs from the Euclidean one on the covered entries
    assert not torch.allclose(expected["fc1.weight"][:4], euclidean["fc1.weight"][:4])


# ---------------------------------------------------------------------- invariance
def function_gap(a: nn.Module, b: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float((a(x) - b(x)).abs().max() / a(x).abs().max())


@pytest.mark.parametrize(
    ("optimizer_cls", "kw", "steps"),
    [
        (SGD, {"metric": "mix"}, 1),
        (SGD, {"metric": "inv"}, 1),
        (SGD, {"metric": "mix", "momentum": 0.9}, 3),
        (SGD, {"metric": "inv", "momentum": 0.9, "nesterov": True}, 3),
        (ADAM, {"metric": "mix"}, 3),
        (ADAM, {"metric": "inv"}, 3),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_steps_commute_with_the_group_action(optimizer_cls, kw, steps, seed):
    """A model moved along its orbits (a random GL(4) element per head) steps to the moved
    result: the two models keep one function. Plain SGD does not (the control)."""
    model, batch = transformer(seed)
    moved = moved_along_orbits(model, scale=2.0, seed=seed + 7)
    x = batch[0]
    assert function_gap(model, moved, x) < 1e-12
    assert find_symmetries(model, warn=False).n_heads == 16  # QK and VO of 4 heads, 2 layers
    for m in (model, moved):
        opt = quotient_optimizer(m, optimizer_cls, lr=0.05, eps=0.0, **kw)
        for _ in range(steps):
            cross_entropy(m, batch).backward()
            opt.step()
            opt.zero_grad()
    assert function_gap(model, moved, x) < 1e-9
    before = function_gap(model, transformer(seed)[0], x)
    assert before > 1e-3  # the steps changed the function


def test_on_lora_riemannian_adam_commutes_with_the_group_action_and_peft_adamw_does_not():
    """A LoRA model (``B`` random, so ``eps = reg = 0`` is defined) moved by ``(B M⁻¹, M A)`` per
    adapter: two RiemannianAdam steps keep one function with the unmoved model; PEFT's
    preconditioned AdamW, with the same preconditioner and element-wise moments, does not."""
    model = lora_bert(0, 4, random_b=True)
    moved = moved_along_orbits(model, scale=2.0, seed=3)
    batch = token_batch(0)
    ids = batch[0]

    def gap(a, b):
        with torch.no_grad():
            ya, yb = a(input_ids=ids).logits, b(input_ids=ids).logits
        return float((ya - yb).abs().max() / ya.abs().max())

    assert gap(model, moved) < 1e-12
    ours = [copy.deepcopy(m) for m in (model, moved)]
    theirs = [copy.deepcopy(m) for m in (model, moved)]
    for m in ours:
        opt = quotient_optimizer(m, ADAM, lr=1e-2, eps=0.0)
        for _ in range(2):
            bert_loss(m, batch).backward()
            opt.step()
            opt.zero_grad()
    for m in theirs:
        opt = create_riemannian_optimizer(m, torch.optim.AdamW, lr=1e-2, reg=0.0)
        for _ in range(2):
            bert_loss(m, batch).backward()
            opt.step()
            opt.zero_grad()
    assert gap(*ours) < 1e-9
    assert gap(*theirs) > 1e-4
    assert gap(ours[0], model) > 1e-4  # the steps changed the function


def test_euclidean_sgd_does_not_commute_with_the_group_action():
    model, batch = transformer()
    moved = moved_along_orbits(model, scale=2.0, seed=7)
    for m in (model, moved):
        cross_entropy(m, batch).backward()
        torch.optim.SGD(m.parameters(), lr=0.05).step()
    assert function_gap(model, moved, batch[0]) > 1e-4


def test_geoopt_alone_starts_momentum_from_the_euclidean_gradient():
    """What quotient_optimizer corrects (docs/optim.md): geoopt's RiemannianSGD initialises its
    momentum buffer with the gradient and then adds it again, a first step ``-lr·(1+μ)·g``."""
    g = torch.randn(5, dtype=DT)
    p = nn.Parameter(torch.randn(5, dtype=DT))
    start = p.detach().clone()
    p.grad = g.clone()
    SGD([p], lr=0.1, momentum=0.9).step()
    torch.testing.assert_close(p.detach(), start - 0.1 * 1.9 * g, rtol=1e-15, atol=1e-15)


def test_sgd_momentum_is_heavy_ball_on_the_points_and_torch_sgd_on_the_rest():
    """Two steps with momentum ``μ``: on the points ``x₁ = x₀ - lr·grad₀``, then
    ``x₂ = x₁ - lr·(μ·proj_{x₁}(grad₀) + grad₁)`` (the buffer transported by projection); on
    the rest ``w₁ = w₀ - lr·g₀``, ``w₂ = w₁ - lr·(μ·g₀ + g₁)``, torch's SGD."""
    model, batch = transformer()
    lr, mu = 0.05, 0.9
    opt = quotient_optimizer(model, SGD, lr=lr, momentum=mu)
    geometry = opt.geometry
    manifolds = [k.manifold for k in geometry.kinds]

    def read():
        points, w = geometry.gather()
        grads, g = geometry.gather({n: p.grad for n, p in geometry.params.items()})
        rgrads = [m.egrad2rgrad(x, gx) for m, x, gx in zip(manifolds, points, grads, strict=True)]
        return points, w, rgrads, g

    cross_entropy(model, batch).backward()
    x0, w0, r0, g0 = read()
    opt.step()
    opt.zero_grad()
    cross_entropy(model, batch).backward()
    x1, w1, r1, g1 = read()
    for a, b, r in zip(x0, x1, r0, strict=True):
        torch.testing.assert_close(b, a - lr * r, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(w1, w0 - lr * g0, rtol=1e-13, atol=1e-15)
    opt.step()
    x2, w2 = geometry.gather()
    for m, a, b, ra, rb in zip(manifolds, x1, x2, r0, r1, strict=True):
        expected = a - lr * (mu * m.proju(a, ra) + rb)
        torch.testing.assert_close(b, expected, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(w2, w1 - lr * (mu * g0 + g1), rtol=1e-13, atol=1e-15)


def test_adam_moments_are_metric_norms_per_head_and_transported():
    """Two RiemannianAdam steps against the formulas of docs/optim.md: per head the second
    moment averages the metric square norm ``<grad, grad>_x`` (one number), the first moment
    averages Riemannian gradients and is carried to the new point by horizontal projection;
    the rest steps as ``torch.optim.Adam``."""
    model, batch = transformer()
    twin = copy.deepcopy(model)
    lr, (b1, b2), eps = 0.02, (0.8, 0.9), 1e-8
    opt = quotient_optimizer(model, ADAM, lr=lr, betas=(b1, b2), eps=eps)
    geometry = opt.geometry
    manifolds = [k.manifold for k in geometry.kinds]

    def read():
        points, w = geometry.gather()
        grads, _ = geometry.gather({n: p.grad for n, p in geometry.params.items()})
        rgrads = [m.egrad2rgrad(x, gx) for m, x, gx in zip(manifolds, points, grads, strict=True)]
        norms = [
            m.inner(x, r, keepdim=True) for m, x, r in zip(manifolds, points, rgrads, strict=True)
        ]
        return points, w, rgrads, norms

    cross_entropy(model, batch).backward()
    x0, _, r0, n0 = read()
    opt.step()
    opt.zero_grad()
    cross_entropy(model, batch).backward()
    x1, w1, r1, n1 = read()
    for a, b, r, n in zip(x0, x1, r0, n0, strict=True):
        assert n.shape == (a.shape[0], 1, 1)  # one number per head
        torch.testing.assert_close(b, a - lr * r / (n.sqrt() + eps), rtol=1e-12, atol=1e-14)
    opt.step()
    x2, _ = geometry.gather()
    for m, a, b, ra, rb, na, nb in zip(manifolds, x1, x2, r0, r1, n0, n1, strict=True):
        first = b1 * m.proju(a, (1 - b1) * ra) + (1 - b1) * rb
        second = b2 * (1 - b2) * na + (1 - b2) * nb
        step = (first / (1 - b1**2)) / ((second / (1 - b2**2)).sqrt() + eps)
        torch.testing.assert_close(b, a - lr * step, rtol=1e-12, atol=1e-14)
    # the rest: torch's Adam (one step: from here on the block weights differ)
    reference = torch.optim.Adam(twin.parameters(), lr=lr, betas=(b1, b2), eps=eps)
    cross_entropy(twin, batch).backward()
    reference.step()
    _, w_twin = find_symmetries(twin, warn=False).gather()
    torch.testing.assert_close(w1, w_twin, rtol=1e-13, atol=1e-15)


# ---------------------------------------------------------------------- training a PEFT model
def test_riemannian_adam_trains_a_lora_model_that_stays_a_peft_model(tmp_path):
    model = lora_bert(0, 4, random_b=False)
    keys = list(model.state_dict())
    batch = token_batch(3, n=12)
    opt = quotient_optimizer(model, ADAM, lr=5e-2, eps=1e-2)
    assert isinstance(opt, QuotientOptimizer) and isinstance(opt, ADAM)
    losses = []
    for _ in range(20):
        loss = bert_loss(model, batch)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < 0.8 * losses[0], losses
    assert list(model.state_dict()) == keys
    assert all(type(p) is nn.Parameter for p in model.parameters())
    with torch.no_grad():
        adapted = model(input_ids=batch[0]).logits
        model.save_pretrained(tmp_path)
        fresh = lora_bert(0, 4, random_b=False)  # the same base model
        fresh.load_adapter(tmp_path, adapter_name="trained")
        fresh.set_adapter("trained")
        torch.testing.assert_close(
            fresh(input_ids=batch[0]).logits, adapted, rtol=1e-12, atol=1e-14
        )
        merged = model.merge_and_unload()
        torch.testing.assert_close(
            merged(input_ids=batch[0]).logits, adapted, rtol=1e-10, atol=1e-12
        )


def test_state_dict_round_trips():
    """Two steps, save, load into the optimizer of a copy; both continue identically."""
    model, batch = transformer()
    opt = quotient_optimizer(model, ADAM, lr=1e-2, betas=(0.8, 0.9))
    for _ in range(2):
        cross_entropy(model, batch).backward()
        opt.step()
        opt.zero_grad()
    twin = copy.deepcopy(model)
    state = copy.deepcopy(opt.state_dict())
    twin_opt = quotient_optimizer(twin, ADAM, lr=1.0)
    twin_opt.load_state_dict(state)
    assert twin_opt.param_groups[0]["lr"] == 1e-2
    assert all(len(twin_opt.state[p]) for p in twin_opt.points)
    for m, o in ((model, opt), (twin, twin_opt)):
        for _ in range(2):
            cross_entropy(m, batch).backward()
            o.step()
            o.zero_grad()
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b), name
    # a fresh optimizer (no state) takes another step: the loaded state mattered
    fresh_model = copy.deepcopy(twin)
    fresh = quotient_optimizer(fresh_model, ADAM, lr=1e-2, betas=(0.8, 0.9))
    for m, o in ((twin, twin_opt), (fresh_model, fresh)):
        cross_entropy(m, batch).backward()
        o.step()
    assert not torch.equal(
        twin.encoder.layers[0].self_attn.in_proj_weight,
        fresh_model.encoder.layers[0].self_attn.in_proj_weight,
    )


def test_weights_loaded_between_steps_are_where_the_next_step_starts():
    model, batch = transformer(0)
    opt = quotient_optimizer(model, SGD, lr=0.1)
    cross_entropy(model, batch).backward()
    opt.step()
    opt.zero_grad()
    checkpoint, _ = transformer(1)
    model.load_state_dict(checkpoint.state_dict())
    reference = quotient_optimizer(checkpoint, SGD, lr=0.1)
    for m, o in ((model, opt), (checkpoint, reference)):
        cross_entropy(m, batch).backward()
        o.step()
    for (name, a), b in zip(model.named_parameters(), checkpoint.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_clears_the_model_s_block_parameters(set_to_none):
    model, batch = transformer()
    opt = quotient_optimizer(model, SGD, lr=0.1)
    cross_entropy(model, batch).backward()
    opt.step()
    assert all(p.grad is not None for p in model.parameters())
    assert all(x.grad is None for x in opt.points)  # the gradient copies are released
    opt.zero_grad(set_to_none=set_to_none)
    for name, p in model.named_parameters():
        if set_to_none:
            assert p.grad is None, name
        else:
            assert p.grad is not None and not p.grad.any(), name


def test_missing_gradients_count_as_zero_and_a_kind_without_any_is_skipped():
    model, batch = transformer()
    twin = copy.deepcopy(model)
    for m in (model, twin):
        cross_entropy(m, batch).backward()
    # one block parameter without .grad here, with a zero .grad in the twin
    model.encoder.layers[1].self_attn.out_proj.weight.grad = None
    twin.encoder.layers[1].self_attn.out_proj.weight.grad.zero_()
    for m in (model, twin):
        quotient_optimizer(m, SGD, lr=0.1, weight_decay=0.01).step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    # no .grad on any block parameter: the points do not move (not even by weight decay),
    # as torch skips a parameter without .grad; the rest steps
    model, _ = transformer()
    before = every_parameter(model)
    opt = quotient_optimizer(model, SGD, lr=0.1, weight_decay=0.5)
    cross_entropy(model, batch).backward()
    for name in opt.geometry.symmetric_names:
        opt.geometry.params[name].grad = None
    opt.step()
    after = every_parameter(model)
    for name in after:
        assert torch.equal(after[name], before[name]) == (name in opt.geometry.symmetric_names)


def test_step_hooks_run_once_and_schedulers_see_every_group():
    SGD([nn.Parameter(torch.zeros(2))], lr=0.1)  # torch wraps RiemannianSGD.step in its hooks
    model, batch = transformer()
    opt = quotient_optimizer(model, SGD, lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append(1))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        loss = opt.step(lambda: cross_entropy(model, batch).backward() or 0.0)
        assert loss == 0.0
        opt.zero_grad()
        scheduler.step()
    assert len(calls) == 2
    assert [g["lr"] for g in opt.param_groups] == [0.025, 0.025]


def test_half_precision_weights_stay_half_and_the_points_are_float32():
    torch.manual_seed(0)
    model = TinyTransformerClassifier(d=16, heads=4, layers=2, classes=3).to(torch.bfloat16)
    x, y = torch.randn(8, 5, 16, dtype=torch.bfloat16), torch.randint(0, 3, (8,))
    with pytest.warns(UserWarning, match="bfloat16"):
        opt = quotient_optimizer(model, ADAM, lr=1e-2)
    assert all(p.dtype == torch.float32 for p in opt.points)
    before = every_parameter(model)
    cross_entropy(model, (x, y)).backward()
    opt.step()
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.isfinite(p).all(), name
        assert not torch.equal(p, before[name]), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_steps_equal_cpu_steps():
    results = []
    for device in ("cpu", "cuda"):
        model, (x, y) = transformer()
        model, batch = model.to(device), (x.to(device), y.to(device))
        opt = quotient_optimizer(model, ADAM, lr=1e-2)
        assert all(p.device.type == device for p in opt.points)
        for _ in range(2):
            cross_entropy(model, batch).backward()
            opt.step()
            opt.zero_grad()
        results.append({n: p.detach().cpu() for n, p in model.named_parameters()})
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=1e-9, atol=1e-12, msg=name)


def test_errors():
    model, _ = transformer()
    with pytest.raises(TypeError, match="geoopt optimizer class"):
        quotient_optimizer(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="'auto' or a ParameterGeometry"):
        quotient_optimizer(model, SGD, lr=0.1, symmetries=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="another model"):
        quotient_optimizer(model, SGD, lr=0.1, symmetries=find_symmetries(copy.deepcopy(model)))
    with pytest.raises(ValueError, match="metric must be"):
        quotient_optimizer(model, SGD, lr=0.1, metric="euclid")
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        quotient_optimizer("model", SGD, lr=0.1)  # type: ignore[arg-type]
    # a factor that becomes rank deficient during training: located, weights unchanged
    model, batch = transformer()
    opt = quotient_optimizer(model, SGD, lr=0.1, eps=0.0)
    cross_entropy(model, batch).backward()
    with torch.no_grad():
        model.encoder.layers[1].self_attn.out_proj.weight[:, 4:8] = 0.0  # head 1's H of VO
    before = every_parameter(model)
    with pytest.raises(ValueError, match=r"(?s)rank-deficient.*layer 1.*head 1.*unchanged"):
        opt.step()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    lora = lora_bert(0, 4, random_b=False)  # B = 0: P = GᵀG = 0 without relaxation
    before = every_parameter(lora)
    with pytest.raises(ValueError, match=r"(?s)rank-deficient.*lora_B.*eps > 0") as info:
        quotient_optimizer(lora, SGD, lr=0.1, eps=0.0)
    assert "head" in str(info.value)
    for name, p in lora.named_parameters():
        assert torch.equal(p, before[name])
