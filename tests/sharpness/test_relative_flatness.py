"""Relative flatness: the brute-force Hessian value, the re-scalings it is invariant to (and one it
is not), a transformer's classifier head, batches, model safety, errors."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import quotientgeo as qg
from quotientgeo.sharpness import FlatnessResult, relative_flatness
from quotientgeo.testing.assertions import assert_same, snapshot

DT = torch.float64


def mlp(sizes, activation=nn.ReLU, seed=0, dtype=DT) -> nn.Sequential:
    """``Linear, activation, Linear, ...``: layer ``i`` is module ``str(2 * i)``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), activation()]
    return nn.Sequential(*layers[:-1]).to(dtype)


def data(n, d_in, classes, n_batches=1, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(n, d_in, generator=gen, dtype=DT),
            torch.randint(0, classes, (n,), generator=gen),
        )
        for _ in range(n_batches)
    ]


def ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def brute(model, loss_fn, batch, name: str) -> tuple[float, float]:
    """``(κ, scale)`` from the full Hessian of the loss in the flattened layer weight:
    ``κ = Σ_{s,s'} <w_s, w_s'> Tr(H_{s,s'})`` and ``scale = Σ |<w_s, w_s'>| |Tr(H_{s,s'})|``,
    the size of the terms (for a tolerance that survives cancellation)."""
    model.eval()
    w = dict(model.named_modules())[name].weight.detach()
    m, d = w.shape

    def loss_of(flat):
        params = {f"{name}.weight": flat.reshape(m, d)}
        forward = lambda *a, **k: torch.func.functional_call(model, params, a, k)  # noqa: E731
        return loss_fn(_Call(forward), batch)

    h = torch.autograd.functional.hessian(loss_of, w.reshape(-1)).reshape(m, d, m, d)
    traces = torch.einsum("skrk->sr", h)  # Tr(H_{s,r})
    gram = w @ w.T
    return float((gram * traces).sum()), float((gram.abs() * traces.abs()).sum())


class _Call:
    """A callable standing for the model in ``loss_fn(model, batch)``."""

    def __init__(self, forward):
        self.forward = forward

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


def kappa(model, batches, layer, loss_fn=ce, **kwargs) -> FlatnessResult:
    return relative_flatness(model, loss_fn, batches, layer=layer, progress=False, **kwargs)


def assert_close(value, reference, scale, k=1e-10):
    assert abs(value - reference) <= k * max(scale, 1e-300), (value, reference, scale)


# ------------------------------------------------------------------ 1. the brute-force value
@given(
    sizes=st.lists(st.integers(1, 6), min_size=3, max_size=4),
    layer=st.integers(0, 2),
    activation=st.sampled_from([nn.ReLU, nn.Tanh, nn.GELU]),
    n=st.integers(1, 7),
    seed=st.integers(0, 2**16),
    chunk_size=st.integers(1, 40),
)
def test_equals_the_full_hessian_value(sizes, layer, activation, n, seed, chunk_size):
    layer = min(layer, len(sizes) - 2)
    model = mlp(sizes, activation, seed)
    (batch,) = data(n, sizes[0], sizes[-1], seed=seed + 1)
    name = str(2 * layer)
    expected, scale = brute(model, ce, batch, name)
    result = kappa(model, [batch], name, chunk_size=chunk_size)
    assert_close(result.value, expected, scale)
    m, d = sizes[layer + 1], sizes[layer]
    assert result.settings["hvps_per_batch"] == min(m, d) * d
    assert result.settings["shape"] == [m, d]


@pytest.mark.parametrize("sizes", [(3, 8, 4, 2), (8, 3, 6, 2), (5, 5, 5, 3)])  # m<d, m>d, m=d
def test_both_factorisations_of_the_gram_matrix(sizes):
    """``(I, WWᵀ)`` probes when ``m ≤ d``, ``(W, W)`` when ``d < m``: both are the Hessian
    value."""
    model = mlp(sizes, nn.Tanh, seed=3)
    (batch,) = data(9, sizes[0], sizes[-1], seed=4)
    expected, scale = brute(model, ce, batch, "2")
    assert_close(kappa(model, [batch], "2").value, expected, scale)


def test_cost_is_min_m_d_times_d_products(monkeypatch):
    """One gradient and ``min(m, d)·d`` Hessian-vector products per batch (``chunk_size=1``:
    one backward pass each)."""
    model = mlp((3, 7, 4, 2), seed=0)
    batches = data(6, 3, 2, n_batches=2)
    calls = []
    grad = torch.autograd.grad

    def counting(*args, **kwargs):
        calls.append(kwargs.get("is_grads_batched", False))
        return grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counting)
    kappa(model, batches, "2", chunk_size=1)
    assert len(calls) == 2 * (1 + min(4, 7) * 7) and not any(calls)
    calls.clear()
    kappa(model, batches, "2", chunk_size=10)  # 28 products in chunks of 10, 10, 8
    assert len(calls) == 2 * (1 + 3) and sum(calls) == 2 * 3


def test_chunk_sizes_agree():
    model = mlp((4, 6, 5, 3), nn.GELU, seed=5)
    batches = data(8, 4, 3)
    values = [kappa(model, batches, "2", chunk_size=c).value for c in (1, 4, 7, 1000)]
    assert max(values) - min(values) <= 1e-13 * abs(values[0])


def test_zero_when_the_loss_is_linear_in_the_layer():
    """The last layer of ``sum(model(x))`` enters the loss linearly: ``H = 0``."""
    model = mlp((3, 5, 2), seed=0)
    batches = data(4, 3, 2)
    result = kappa(model, batches, "2", loss_fn=lambda m, b: m(b[0]).sum())
    assert result.value == 0.0


def test_ordinary_least_squares_is_the_closed_form():
    """A linear model with ``L = ||W X - Y||² / n``: ``H = (2/n) I_m ⊗ X Xᵀ``, so
    ``κ = (2/n) ||W||²_F Tr(X Xᵀ)`` (Petzka et al.'s ridge connection)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3, bias=False).to(DT)
    x, y = torch.randn(10, 4, dtype=DT), torch.randn(10, 3, dtype=DT)
    loss = lambda m, b: (m(b[0]) - b[1]).square().sum() / len(b[0])  # noqa: E731
    result = relative_flatness(model, loss, [(x, y)], layer=model, progress=False)
    expected = 2 / 10 * model.weight.detach().square().sum() * x.square().sum()
    assert math.isclose(result.value, float(expected), rel_tol=1e-12)
    assert result.settings["layer"] == ""


# ------------------------------------------------------------------ 2. re-scalings
def relu_net(seed):
    """``Linear(5, 6) → ReLU → Linear(6, 4) [the feature layer "2"] → ReLU → Linear(4, 3)``."""
    return mlp((5, 6, 4, 3), nn.ReLU, seed)


def rescaled(model, before=None, feature=None, after=None):
    """A copy with ``(weight, bias)`` of the layers ``"0"``, ``"2"``, ``"4"`` transformed."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, fn in (("0", before), ("2", feature), ("4", after)):
            if fn is not None:
                layer = getattr(out, name)
                w, b = fn(layer.weight, layer.bias)
                layer.weight.copy_(w)
                layer.bias.copy_(b)
    return out


scale = st.floats(0.1, 10.0)


def assert_same_function(a, b, batches):
    for x, _ in batches:
        torch.testing.assert_close(a(x), b(x), rtol=1e-12, atol=1e-12)


@given(seed=st.integers(0, 2**16), lam=scale)
def test_invariant_to_layer_wise_rescaling_with_the_next_layer(seed, lam):
    """``W ↦ λW`` (and its bias), next layer ``↦ W/λ``: the Hessian scales by ``1/λ²``,
    ``<w_s, w_s'>`` by ``λ²``."""
    model, batches = relu_net(seed), data(12, 5, 3, n_batches=2, seed=seed)
    moved = rescaled(
        model, feature=lambda w, b: (lam * w, lam * b), after=lambda w, b: (w / lam, b)
    )
    assert_same_function(model, moved, batches)
    before, after = kappa(model, batches, "2"), kappa(moved, batches, "2")
    assert math.isclose(after.value, before.value, rel_tol=1e-9)


@given(seed=st.integers(0, 2**16), lam=scale)
def test_invariant_to_layer_wise_rescaling_with_the_previous_layer(seed, lam):
    """Previous layer ``↦ λ·`` (weight and bias), ``W ↦ W/λ``."""
    model, batches = relu_net(seed), data(12, 5, 3, n_batches=2, seed=seed)
    moved = rescaled(
        model, before=lambda w, b: (lam * w, lam * b), feature=lambda w, b: (w / lam, b)
    )
    assert_same_function(model, moved, batches)
    assert math.isclose(
        kappa(moved, batches, "2").value, kappa(model, batches, "2").value, rel_tol=1e-9
    )


@given(seed=st.integers(0, 2**16), lams=st.lists(scale, min_size=4, max_size=4))
def test_invariant_to_neuron_wise_rescaling_of_the_layers_neurons(seed, lams):
    """Row ``w_s`` and bias ``b_s`` ``↦ λ_s·``, the next layer's column ``s`` ``↦ /λ_s``."""
    model, batches = relu_net(seed), data(12, 5, 3, n_batches=2, seed=seed)
    lam = torch.tensor(lams, dtype=DT)
    moved = rescaled(
        model,
        feature=lambda w, b: (lam[:, None] * w, lam * b),
        after=lambda w, b: (w / lam[None, :], b),
    )
    assert_same_function(model, moved, batches)
    assert math.isclose(
        kappa(moved, batches, "2").value, kappa(model, batches, "2").value, rel_tol=1e-9
    )


def test_not_invariant_to_neuron_wise_rescaling_of_the_neurons_feeding_the_layer():
    """Re-scaling the previous layer's neurons one by one (``W``'s columns by ``1/μ_j``) keeps
    the function but re-weights the input features, which ``κ`` sums over unweighted: ``κ``
    changes (the invariance tests above can fail), while the plain Hessian trace also changes
    under the re-scalings ``κ`` is invariant to."""
    model, batches = relu_net(0), data(12, 5, 3, n_batches=2)
    mu = torch.tensor([0.2, 1.0, 5.0, 1.0, 3.0, 0.5], dtype=DT)
    moved = rescaled(
        model, before=lambda w, b: (mu[:, None] * w, mu * b), feature=lambda w, b: (w / mu, b)
    )
    assert_same_function(model, moved, batches)
    before, after = kappa(model, batches, "2").value, kappa(moved, batches, "2").value
    assert abs(after - before) > 1e-2 * abs(before)

    layer_wise = rescaled(model, feature=lambda w, b: (3 * w, 3 * b), after=lambda w, b: (w / 3, b))
    trace = lambda m: sum(brute_trace(m, b) for b in batches)  # noqa: E731
    assert math.isclose(trace(layer_wise), trace(model) / 9, rel_tol=1e-9)


def brute_trace(model, batch) -> float:
    w = model[2].weight.detach()

    def loss_of(flat):
        out = torch.func.functional_call(model, {"2.weight": flat.reshape(w.shape)}, (batch[0],))
        return F.cross_entropy(out, batch[1])

    return float(torch.autograd.functional.hessian(loss_of, w.reshape(-1)).trace())


# ------------------------------------------------------------------ 3. a transformer head
@pytest.fixture(scope="module")
def bert_classifier():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=24,
        max_position_embeddings=12,
        num_labels=3,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).to(DT)
    gen = torch.Generator().manual_seed(2)
    batches = [
        (torch.randint(0, 40, (6, 8), generator=gen), torch.randint(0, 3, (6,), generator=gen))
        for _ in range(2)
    ]
    return model, batches


def bert_loss(model, batch):
    ids, labels = batch
    return F.cross_entropy(model(input_ids=ids).logits, labels)


@pytest.mark.parametrize("name", ["classifier", "bert.pooler.dense"])
def test_transformer_classifier_head(bert_classifier, name):
    model, batches = bert_classifier
    model.train()  # measured in eval mode (no dropout), and left in train mode
    result = kappa(model, batches, name, loss_fn=bert_loss)
    assert model.training
    model.eval()
    expected = [brute(model, bert_loss, b, name) for b in batches]
    for value, (reference, scale) in zip(result.per_batch, expected, strict=True):
        assert_close(value, reference, scale)
    model.train()
    assert result.settings["hvps_per_batch"] == min(model.get_submodule(name).weight.shape) * 16


def test_layer_given_as_the_module(bert_classifier):
    model, batches = bert_classifier
    by_name = kappa(model, batches, "classifier", loss_fn=bert_loss)
    by_module = kappa(model, batches, model.classifier, loss_fn=bert_loss)
    assert by_module.per_batch == by_name.per_batch
    assert by_module.settings["layer"] == "classifier"


# ------------------------------------------------------------------ 4. batches, result, safety
def test_mean_over_batches():
    model = mlp((4, 6, 5, 3), nn.Tanh, seed=2)
    batches = data(7, 4, 3, n_batches=3)
    result = kappa(model, batches, "2")
    singles = [kappa(model, [b], "2").value for b in batches]
    assert result.per_batch == singles
    assert result.value == pytest.approx(sum(singles) / 3, rel=1e-15)
    assert result.losses == [ce(model.eval(), b).item() for b in batches]
    assert kappa(model, iter(batches), "2").per_batch == singles  # no len: a generator
    assert isinstance(result.value, float) and result.settings["n_batches"] == 3
    json_ready = result.to_dict()
    assert json_ready["per_batch"] == singles and "FlatnessResult(value=" in repr(result)


def test_public_names():
    assert qg.relative_flatness is relative_flatness and qg.FlatnessResult is FlatnessResult
    assert {"relative_flatness", "FlatnessResult"} <= set(qg.__all__)


def test_float32_follows_the_model():
    model = mlp((4, 6, 3), seed=0, dtype=torch.float32)
    batches = data(5, 4, 3)
    result = kappa(model, [(x.float(), y) for x, y in batches], "0")
    reference = kappa(mlp((4, 6, 3), seed=0), batches, "0").value
    assert result.settings["dtype"] == "torch.float32"
    assert math.isclose(result.value, reference, rel_tol=1e-4)


def with_state(model):
    """Train mode, a ``.grad`` on every parameter, running statistics in the buffers."""
    model.train()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def norm_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.5), nn.Linear(6, 3)
    ).to(DT)


def test_model_restored():
    model = with_state(norm_net())
    batches = data(8, 4, 3, n_batches=2)
    model(batches[0][0])  # running statistics away from their defaults
    before = snapshot(model)
    a = kappa(model, batches, "4")
    assert_same(before, snapshot(model))
    b = kappa(model, batches, "4")
    assert a.per_batch == b.per_batch  # eval mode: no dropout, no statistics update


def test_model_restored_on_errors():
    model = with_state(norm_net())
    batches = data(8, 4, 3, n_batches=3)
    before = snapshot(model)
    seen = []

    def failing(m, batch):
        seen.append(1)
        if len(seen) == 2:
            raise RuntimeError("boom")
        return ce(m, batch)

    with pytest.raises(RuntimeError, match="boom") as info:
        kappa(model, batches, "4", loss_fn=failing)
    assert_same(before, snapshot(model))
    notes = getattr(info.value, "__notes__", None)
    if notes is not None:  # Python 3.11+
        assert "batch 1" in notes[0] and "restored" in notes[0]
    with pytest.raises(ValueError, match="non-finite"):
        kappa(model, batches, "4", loss_fn=lambda m, b: ce(m, b) * math.inf)
    assert_same(before, snapshot(model))


# ------------------------------------------------------------------ 5. errors
def test_errors():
    model = mlp((4, 6, 3), seed=0)
    batches = data(5, 4, 3)
    with pytest.raises(ValueError, match=r"no module named 'fc'.*'0', '2'"):
        kappa(model, batches, "fc")
    with pytest.raises(TypeError, match=r"layer '1' is a ReLU, not an nn\.Linear"):
        kappa(model, batches, "1")
    with pytest.raises(TypeError, match=r"not an nn\.Linear"):
        kappa(model, batches, model[1])
    with pytest.raises(ValueError, match="not a submodule"):
        kappa(model, batches, nn.Linear(4, 6))
    with pytest.raises(TypeError, match="layer must be"):
        kappa(model, batches, 0)
    with pytest.raises(ValueError, match="empty"):
        kappa(model, [], "0")
    with pytest.raises(ValueError, match="chunk_size"):
        kappa(model, batches, "0", chunk_size=0)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        relative_flatness(model, lambda m, x, y: 0, batches, layer="0", progress=False)
    with pytest.raises(TypeError, match="one batch"):
        kappa(model, batches[0], "0")
    with pytest.raises(ValueError, match="scalar tensor"):
        kappa(model, batches, "0", loss_fn=lambda m, b: m(b[0]))
    with pytest.raises(ValueError, match="does not depend on the weight of layer '0'"):
        kappa(model, batches, "0", loss_fn=lambda m, b: m[2].weight.sum())


def test_relative_flatness_as_a_measure_value_equals_the_function():
    """``Measure.relative_flatness(layer)`` evaluates to the function's value, has no radius
    (``with_rho`` returns it unchanged) and records its settings."""
    from quotientgeo import Measure

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    batches = [(torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,)))]

    def loss_fn(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])

    row = Measure.relative_flatness("2")
    assert row.with_rho(0.3) is row and row.name == "relative_flatness"
    got = row.evaluate(model, loss_fn, batches, progress=False)
    expected = relative_flatness(model, loss_fn, batches, layer="2", progress=False)
    assert got.value == expected.value
    assert row.settings() == {"measure": "relative_flatness", "layer": "2", "chunk_size": 64}
