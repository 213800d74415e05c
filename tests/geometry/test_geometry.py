"""ParameterGeometry: discovery, exact gather/scatter, the symmetry it claims, locating heads."""

from __future__ import annotations

import copy
import warnings
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from quotientgeo.geometry import ParameterGeometry, Source, find_symmetries
from quotientgeo.geometry.plan import build_plan
from quotientgeo.manifolds import GLQuotient, RescaleQuotient
from quotientgeo.testing import move_along_orbits_, moved_along_orbits
from quotientgeo.testing.assertions import (
    assert_parts_read_and_write_like_the_geometry,
    assert_roundtrip_exact,
)

DT = torch.float64


def random_group_elements(geometry, scale=1.0, seed=0):
    """``manifold.random_group`` per kind: ``A = scale·U diag(σ) Vᵀ`` (GL, condition ≤ 4),
    positive scalings ``α = scale·σ`` (re-scaling, scale)."""
    g = torch.Generator().manual_seed(seed)
    points, _ = geometry.gather()
    return [
        m.random_group(x, generator=g, scale=scale)
        for m, x in zip(geometry.manifolds(), points, strict=True)
    ]


def act_through_geometry(model, geometry, group_elements, metric="mix"):
    """Gather the points, apply ``manifold.act`` per kind, scatter back into ``model``."""
    points, _ = geometry.gather()
    moved = [
        m.act(x, A)
        for m, x, A in zip(geometry.manifolds(metric), points, group_elements, strict=True)
    ]
    geometry.assign_(moved)


def is_gl(kind):
    return isinstance(kind.manifold, GLQuotient)


def encoder(d=32, heads=4, layers=2, seed=0, **kw):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(
        d, heads, dim_feedforward=2 * d, dropout=0.0, batch_first=True, **kw
    )
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).to(DT).eval()


# ---------------------------------------------------------------------- nn.MultiheadAttention
def test_transformer_encoder_mapping_and_summary():
    model = encoder()
    geometry = find_symmetries(model)
    assert all(is_gl(k) for k in geometry.kinds) and len(geometry.kinds) == 2
    # QK: G = [W_q_iᵀ; b_q_i] (33×8), H the same for keys; VO: H = out_proj columns (32×8)
    assert [k.shape for k in geometry.kinds] == [(66, 8), (65, 8)]
    assert [k.batch for k in geometry.kinds] == [8, 8]  # 2 layers × 4 heads, batched
    assert geometry.n_heads == 16
    assert "layers.0.self_attn.out_proj.bias" in geometry.adaptive_names
    assert "layers.1.linear1.weight" in geometry.adaptive_names
    assert geometry.n_symmetric + geometry.n_adaptive == sum(p.numel() for p in model.parameters())
    assert geometry.plan.stacks is not None  # scatter runs once per kind, not once per layer
    text = repr(geometry)
    for needle in (
        "GLQuotient(n=33, metric='mix', eps=0.0)",
        "point (8, 66, 8)",
        "layers.0.self_attn.QK",
        "adaptive:",
    ):
        assert needle in text
    assert_roundtrip_exact(geometry)


def test_hand_written_action_matches_geometry_and_keeps_outputs():
    """The reference action written on the raw weights, per head, against the geometry's."""
    model = encoder(d=16, heads=2, layers=1)
    ref = copy.deepcopy(model)
    geometry = find_symmetries(model)
    A_qk, A_vo = random_group_elements(geometry, seed=3)
    act_through_geometry(model, geometry, [A_qk, A_vo])

    attn = ref.layers[0].self_attn
    E, dh = 16, 8
    W, b, Wo = attn.in_proj_weight.data, attn.in_proj_bias.data, attn.out_proj.weight.data
    for i in range(2):
        q, k, v = (slice(s * E + i * dh, s * E + (i + 1) * dh) for s in range(3))
        cols = slice(i * dh, (i + 1) * dh)
        # G ↦ G A⁻¹ with G = [W_qᵀ; b_q] means W_q ↦ A⁻ᵀ W_q; H ↦ H Aᵀ means W_k ↦ A W_k
        inv_t = torch.linalg.inv(A_qk[i]).T
        W[q], b[q] = inv_t @ W[q], inv_t @ b[q]
        W[k], b[k] = A_qk[i] @ W[k], A_qk[i] @ b[k]
        inv_t = torch.linalg.inv(A_vo[i]).T
        W[v], b[v] = inv_t @ W[v], inv_t @ b[v]
        Wo[:, cols] = Wo[:, cols] @ A_vo[i].T
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-12, atol=1e-12, msg=n)
    x = torch.randn(3, 5, 16, dtype=DT)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scale", [1e-2, 1.0, 100.0])
def test_random_action_leaves_encoder_outputs_unchanged(scale):
    model = encoder()
    x = torch.randn(4, 6, 32, dtype=DT)
    before = model(x)
    geometry = find_symmetries(model)
    for metric in ("mix", "inv"):  # the action does not depend on the metric
        act_through_geometry(model, geometry, random_group_elements(geometry, scale), metric)
    after = model(x)
    assert not torch.equal(
        geometry.params["layers.0.self_attn.in_proj_weight"],
        encoder().layers[0].self_attn.in_proj_weight,
    )
    torch.testing.assert_close(after, before, rtol=1e-9, atol=1e-9)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    heads=st.sampled_from([1, 2, 4]),
    dh=st.integers(1, 4),
    bias=st.booleans(),
    kv=st.booleans(),
    separate_kdim=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_mha_variants_roundtrip_and_symmetry(heads, dh, bias, kv, separate_kdim, seed):
    torch.manual_seed(seed)
    E = heads * dh
    kdim = E + 3 if separate_kdim else None
    mha = nn.MultiheadAttention(
        E, heads, bias=bias, add_bias_kv=kv, kdim=kdim, vdim=kdim, batch_first=True
    )
    mha = mha.to(DT)
    geometry = find_symmetries(mha)
    assert geometry.n_heads == 2 * heads
    assert_roundtrip_exact(geometry)
    q = torch.randn(2, 3, E, dtype=DT)
    kv_in = torch.randn(2, 4, kdim or E, dtype=DT)
    before = mha(q, kv_in, kv_in, need_weights=False)[0]
    act_through_geometry(mha, geometry, random_group_elements(geometry, seed=seed))
    torch.testing.assert_close(
        mha(q, kv_in, kv_in, need_weights=False)[0], before, rtol=1e-8, atol=1e-9
    )


def test_decoder_layer_maps_self_and_cross_attention():
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True).to(
        DT
    )
    geometry = find_symmetries(layer)
    labels = [b.label for b in geometry.blocks]
    assert labels == ["self_attn.QK", "self_attn.VO", "multihead_attn.QK", "multihead_attn.VO"]
    tgt, mem = torch.randn(2, 3, 16, dtype=DT), torch.randn(2, 5, 16, dtype=DT)
    before = layer(tgt, mem)
    act_through_geometry(layer, geometry, random_group_elements(geometry, 10.0))
    torch.testing.assert_close(layer(tgt, mem), before, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------- Hugging Face styles


def test_bert_mapping_and_symmetry(tiny_bert):
    model = tiny_bert(DT)
    geometry = find_symmetries(model)
    assert [b.label for b in geometry.blocks][:2] == [
        "encoder.layer.0.attention.self.QK",
        "encoder.layer.0.attention.self.VO",
    ]
    assert "encoder.layer.0.attention.output.dense.bias" in geometry.adaptive_names
    assert "encoder.layer.0.attention.output.dense.weight" not in geometry.adaptive_names
    assert_roundtrip_exact(geometry)
    ids = torch.randint(0, 40, (3, 7))
    before = model(input_ids=ids).last_hidden_state
    act_through_geometry(model, geometry, random_group_elements(geometry, 30.0))
    torch.testing.assert_close(model(input_ids=ids).last_hidden_state, before, rtol=1e-9, atol=1e-9)


class ProjAttention(nn.Module):
    """Minimal ``q_proj``/``k_proj``/``v_proj``/``o_proj`` attention (BART/OPT/Llama naming),
    optionally grouped-query (``kv_heads``) and with a per-head LayerNorm on q and k."""

    def __init__(self, d=12, num_heads=3, rotary=False, qk_norm=False, kv_heads=None, pos=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d // num_heads
        self.kv = kv_heads or num_heads
        if kv_heads is not None:
            self.num_key_value_heads = kv_heads
        if pos is not None:
            self.position_embedding_type = pos
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, self.kv * self.head_dim)
        self.v_proj = nn.Linear(d, self.kv * self.head_dim)
        self.o_proj = nn.Linear(d, d, bias=False)
        if rotary:
            self.rotary_emb = nn.Identity()
        if qk_norm:
            self.q_norm = nn.LayerNorm(self.head_dim, eps=0.0)
            self.k_norm = nn.LayerNorm(self.head_dim, eps=0.0)

    def forward(self, x):
        B, T, _ = x.shape
        split = lambda t, n: t.view(B, T, n, self.head_dim).transpose(1, 2)  # noqa: E731
        q = split(self.q_proj(x), self.num_heads)
        k, v = split(self.k_proj(x), self.kv), split(self.v_proj(x), self.kv)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        r = self.num_heads // self.kv
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        out = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim**0.5, -1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


@pytest.mark.parametrize(
    ("kwargs", "shapes"),
    [
        ({}, {(13 + 13, 4), (13 + 12, 4)}),
        # grouped: each of the 2 key/value heads serves 2 query heads (rows stacked in G / H)
        ({"d": 16, "num_heads": 4, "kv_heads": 2}, {(2 * 17 + 17, 4), (17 + 2 * 16, 4)}),
        # q/k normed: positive scales of each query and each key head, GL VO pair
        ({"qk_norm": True}, {(13, 4), (13 + 12, 4)}),
    ],
)
def test_proj_style_attention_symmetry(kwargs, shapes):
    torch.manual_seed(1)
    model = nn.Sequential(ProjAttention(**kwargs), nn.ReLU(), ProjAttention(**kwargs)).to(DT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        geometry = find_symmetries(model)
    assert {k.shape for k in geometry.kinds} == shapes
    d = kwargs.get("d", 12)
    x = torch.randn(2, 5, d, dtype=DT)
    before = model(x)
    act_through_geometry(model, geometry, random_group_elements(geometry, 5.0))
    torch.testing.assert_close(model(x), before, rtol=1e-9, atol=1e-9)
    moved = moved_along_orbits(model, scale=3.0, seed=2)
    torch.testing.assert_close(moved(x), before, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"rotary": True}, "rotary"), ({"pos": "relative_key"}, "position_embedding_type")],
)
def test_qk_pair_left_adaptive_with_warning(kwargs, needle):
    with pytest.warns(UserWarning, match=needle):
        geometry = find_symmetries(ProjAttention(**kwargs))
    assert [b.label for b in geometry.blocks] == ["ProjAttention.VO"]
    assert "q_proj.weight" in geometry.adaptive_names


def test_no_warning_for_plain_models():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        geometry = find_symmetries(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))
    assert not geometry.kinds and geometry.n_adaptive == 26
    assert "adaptive:  26 entries" in geometry.summary()


# ---------------------------------------------------------------------- LoRA
class LoraLinear(nn.Module):
    """PEFT-style adapter: ``base(x) + lora_B[k](lora_A[k](x))``."""

    def __init__(self, d_in=10, d_out=7, r=3):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(d_in, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, d_out, bias=False)})

    def forward(self, x):
        return self.base(x) + self.lora_B["default"](self.lora_A["default"](x))


class LoraLib(nn.Module):
    """loralib-style adapter with parameters ``lora_A`` (r, in) and ``lora_B`` (out, r)."""

    def __init__(self, d_in=6, d_out=5, r=2):
        super().__init__()
        self.lora_A = nn.Parameter(torch.randn(r, d_in))
        self.lora_B = nn.Parameter(torch.randn(d_out, r))

    def forward(self, x):
        return x @ (self.lora_B @ self.lora_A).T


@pytest.mark.parametrize("cls", [LoraLinear, LoraLib])
def test_lora_pairs(cls):
    torch.manual_seed(2)
    model = nn.Sequential(cls(), nn.Tanh()).to(DT)
    for p in model.parameters():
        if p.requires_grad:
            nn.init.normal_(p)
    geometry = find_symmetries(model)
    assert len(geometry.blocks) == 1 and is_gl(geometry.kinds[0])
    assert geometry.n_adaptive == 0  # the frozen base layer is not measured
    assert_roundtrip_exact(geometry)
    x = torch.randn(4, model[0].lora_A["default"].in_features if cls is LoraLinear else 6, dtype=DT)
    before = model(x)
    act_through_geometry(model, geometry, random_group_elements(geometry, 3.0))
    torch.testing.assert_close(model(x), before, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------- explicit API
class Diagonal(nn.Module):
    def __init__(self, d=5):
        super().__init__()
        self.u = nn.Parameter(torch.randn(d, dtype=DT))
        self.v = nn.Parameter(torch.randn(d, dtype=DT))
        self.extra = nn.Parameter(torch.randn(2, dtype=DT))

    def forward(self, X):
        return X @ (self.u * self.v) + self.extra.sum()


def test_explicit_rescale_pair():
    model = Diagonal()
    geometry = ParameterGeometry(model).add_rescale_pair("u", "v", label="diag")
    kind = geometry.kinds[0]
    assert isinstance(kind.manifold, RescaleQuotient) and kind.shape == (2, 5) and kind.batch == 1
    assert geometry.adaptive_names == ["extra"]
    points, _ = geometry.gather()
    torch.testing.assert_close(points[0][0], torch.stack([model.u, model.v]).detach())
    assert_roundtrip_exact(geometry)
    X = torch.randn(3, 5, dtype=DT)
    before = model(X)
    move_along_orbits_(geometry, scale=-2.0)  # α = -2·exp(ω): the re-scaling group is GL(1)^d
    torch.testing.assert_close(model(X), before, rtol=1e-12, atol=1e-12)
    assert_roundtrip_exact(geometry)
    X = torch.randn(3, 5, dtype=DT)
    before = model(X)
    act_through_geometry(model, geometry, random_group_elements(geometry))
    torch.testing.assert_close(model(X), before, rtol=1e-12, atol=1e-12)


class TwoLayer(nn.Module):
    """``W2 relu(W1 x + b1)``: neuron-wise positive re-scaling, a GL(1) pair per hidden unit."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_explicit_gl_pairs_with_slices_and_partial_coverage():
    torch.manual_seed(0)
    model = TwoLayer().to(DT)
    geometry = ParameterGeometry(model)
    # hidden units 0..3 as 4 GL(1) "heads"; units 4, 5 stay in the adaptive geometry
    geometry.add_gl_pair(
        [Source("fc1.weight", rows=(0, 4)), Source("fc1.bias", rows=(0, 4))],
        Source("fc2.weight", axis=1, cols=(0, 4)),
        heads=4,
        label="neurons",
    )
    kind = geometry.kinds[0]
    assert kind.shape == (5 + 3, 1) and kind.batch == 4
    # partially covered tensors keep their uncovered entries in the adaptive vector
    assert geometry.n_adaptive == 2 * 4 + 2 + 2 * 3 + 3
    assert_roundtrip_exact(geometry)
    x = torch.randn(5, 4, dtype=DT)
    before = model(x)
    alpha = [torch.rand(4, 1, 1, dtype=DT) + 0.5]  # positive: ReLU is only GL⁺(1)-invariant
    act_through_geometry(model, geometry, alpha)
    torch.testing.assert_close(model(x), before, rtol=1e-12, atol=1e-12)


def test_explicit_api_errors():
    model = TwoLayer()
    geometry = ParameterGeometry(model)
    with pytest.raises(KeyError, match="no parameter named 'nope'"):
        geometry.add_gl_pair("nope", "fc2.weight")
    with pytest.raises(ValueError, match="do not split into 4 heads"):
        geometry.add_gl_pair("fc1.weight", Source("fc2.weight", axis=1), heads=4)
    with pytest.raises(ValueError, match="full column rank"):
        geometry.add_gl_pair(Source("fc1.weight"), Source("fc2.weight", axis=1), heads=1)
    geometry.add_gl_pair(
        Source("fc1.weight", rows=(0, 2)), Source("fc2.weight", axis=1, cols=(0, 2))
    )
    with pytest.raises(ValueError, match="already belong to another block"):
        geometry.add_gl_pair(
            Source("fc1.weight", rows=(1, 3)), Source("fc2.weight", axis=1, cols=(2, 4))
        )
    assert len(geometry.blocks) == 1  # a failed declaration leaves the geometry unchanged
    with pytest.raises(ValueError, match="u has 4 entries but v has 3"):
        geometry.add_rescale_pair(Source("fc1.bias", rows=(2, 6)), Source("fc2.bias"))
    model.fc2.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="frozen"):
        ParameterGeometry(model).add_gl_pair(
            Source("fc1.weight", rows=(0, 2)), Source("fc2.weight", axis=1, cols=(0, 2))
        )


def test_half_precision_gathers_in_float32():
    torch.manual_seed(0)
    model = encoder(d=8, heads=2, layers=1).to(torch.bfloat16)
    geometry = find_symmetries(model)
    points, w = geometry.gather()
    assert points[0].dtype == torch.float32 and w.dtype == torch.float32
    assert_roundtrip_exact(geometry)


def test_scatter_is_differentiable_and_does_not_touch_the_model():
    model = encoder(d=8, heads=2, layers=1)
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    geometry = find_symmetries(model)
    points, w = geometry.gather()
    points = [p.clone().requires_grad_() for p in points]
    w = w.clone().requires_grad_()
    params = geometry.scatter([p * 2 for p in points], w * 2)
    loss = sum(t.sum() for t in params.values())
    grads = torch.autograd.grad(loss, [*points, w])
    for g in grads:
        torch.testing.assert_close(g, torch.full_like(g, 2.0))
    for n, p in model.named_parameters():
        assert torch.equal(p, snapshot[n])


# ---------------------------------------------------------------------- cost of declaring blocks
def _count_planning(build_model):
    """``(plans built, sources resolved, geometry)`` of ``find_symmetries(build_model())``,
    its summary included."""
    from quotientgeo.geometry import layout, parameters

    model = build_model()
    with (
        mock.patch.object(parameters, "build_plan", side_effect=build_plan) as build,
        mock.patch.object(
            layout.Layout, "resolve", autospec=True, side_effect=layout.Layout.resolve
        ) as resolve,
    ):
        geometry = find_symmetries(model)
        geometry.summary()
        geometry.gather()
    return build.call_count, resolve.call_count, geometry


def test_discovery_plans_once_whatever_the_number_of_blocks():
    """find_symmetries used to re-plan every block on every declaration: quadratic in blocks."""
    one = _count_planning(lambda: encoder(d=8, heads=2, layers=1))
    six = _count_planning(lambda: encoder(d=8, heads=2, layers=6))
    assert len(one[2].blocks) == 2 and len(six[2].blocks) == 12
    # the empty geometry's plan and one for all blocks, however many there are (was 1 + blocks)
    assert one[0] == six[0] <= 2
    assert six[1] == 6 * one[1]  # every source resolved a fixed number of times: linear


def test_discovery_and_explicit_declarations_build_the_same_geometry():
    model = encoder(d=8, heads=2, layers=3)
    found = find_symmetries(model)
    with_add = ParameterGeometry(model)
    with_pairs = ParameterGeometry(model)
    for b in found.blocks:
        with_add.add(GLQuotient(b.manifold.n, "mix"), *b.factors, heads=b.heads, label=b.label)
        with_pairs.add_gl_pair(*b.factors, heads=b.heads, label=b.label)

    def blocks(geometry):
        return [(b.label, b.factors, b.regions, b.heads) for b in geometry.blocks]

    def kinds(geometry):
        return [(k.manifold.geometry_key(), k.shape, k.blocks, k.sizes) for k in geometry.kinds]

    for other in (with_add, with_pairs):
        assert blocks(other) == blocks(found) and kinds(other) == kinds(found)
        assert other.plan.assembly == found.plan.assembly
        assert other.plan.stacks == found.plan.stacks
        assert other.adaptive_names == found.adaptive_names and other.summary() == found.summary()
        for a, b in zip(
            other.gather()[0] + [other.gather()[1]],
            found.gather()[0] + [found.gather()[1]],
            strict=True,
        ):
            assert torch.equal(a, b)


def test_rejected_declaration_leaves_coverage_and_views_untouched():
    """A block failing on a later source must release what its earlier sources claimed."""
    torch.manual_seed(0)
    model = TwoLayer().to(DT)
    geometry = ParameterGeometry(model).add_gl_pair(
        [Source("fc1.weight", rows=(0, 2)), Source("fc1.bias", rows=(0, 2))],
        Source("fc2.weight", axis=1, cols=(0, 2)),
        heads=2,
        label="units 0-1",
    )
    before = geometry.summary()
    # claims fc1 rows 2..3 and fc2 columns 2..3, then its third source overlaps its first
    with pytest.raises(ValueError, match="already belong to another block"):
        geometry.add_gl_pair(
            Source("fc1.weight", rows=(2, 4)),
            [Source("fc2.weight", axis=1, cols=(2, 4)), Source("fc1.weight", rows=(3, 5))],
        )
    # sees fc2.bias as (1, 3) and claims fc1 rows 4..5, then views fc2.weight differently
    with pytest.raises(ValueError, match="viewed as"):
        geometry.add_gl_pair(
            [
                Source("fc2.bias", view=(1, 3), cols=(0, 2), axis=1),
                Source("fc1.weight", rows=(4, 6)),
            ],
            Source("fc2.weight", view=(9, 2), rows=(7, 9)),
        )
    assert [b.label for b in geometry.blocks] == ["units 0-1"]
    assert geometry.summary() == before
    # the regions and views the rejected blocks touched are free again
    geometry.add_gl_pair(
        [Source("fc1.weight", rows=(2, 6)), Source("fc1.bias", rows=(2, 6))],
        Source("fc2.weight", axis=1, cols=(2, 6)),
        heads=4,
    )
    assert geometry.adaptive_names == ["fc2.bias"] and not geometry.partial_names
    assert geometry.n_adaptive == 3 and geometry.kinds[0].batch == 6
    # fc2.bias in its own (3, 1) view: the rejected (1, 3) view is forgotten
    geometry.add_rescale_pair(Source("fc2.bias", rows=(0, 1)), Source("fc2.bias", rows=(1, 2)))
    assert geometry.partial_names == ["fc2.bias"] and geometry.n_adaptive == 1
    assert_roundtrip_exact(geometry)
    # add rejects the same way, naming the offending block
    with pytest.raises(ValueError, match=r"clash: rows \(1, 3\), .* already belong"):
        ParameterGeometry(model).add(
            GLQuotient(2),
            Source("fc1.weight", rows=(0, 2)),
            Source("fc1.weight", rows=(1, 3)),
            label="clash",
        )


def test_partly_covered_parameters_copy_no_mask_per_call(monkeypatch):
    """Uncovered-entry masks are placed on the parameters' device once, not per gather/scatter."""
    torch.manual_seed(0)
    model = TwoLayer().to(DT)
    geometry = ParameterGeometry(model).add_gl_pair(
        Source("fc1.weight", rows=(0, 4)), Source("fc2.weight", axis=1, cols=(0, 4)), heads=4
    )
    assert set(geometry.partial_names) == {"fc1.weight", "fc2.weight"}
    for name, mask in geometry.plan.partial.items():
        assert mask.device == geometry.params[name].device
    moved_masks = []
    original_to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        if self.dtype == torch.bool:
            moved_masks.append((tuple(self.shape), args, kwargs))
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    points, w = geometry.gather()
    for _ in range(3):
        out = geometry.scatter([x * 1.5 for x in points], w * 0.5)
        geometry.gather(out)
    assert moved_masks == []
    monkeypatch.undo()
    assert_roundtrip_exact(geometry)


def test_gathered_points_share_no_memory_with_parameters():
    """Writing into gathered points leaves the model alone (also for single-region blocks,
    whose points could otherwise be views of a parameter)."""
    from quotientgeo import ScaleQuotient

    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.LayerNorm(6)).to(DT)
    geometry = ParameterGeometry(model).add(ScaleQuotient(2), Source("0.weight"), heads=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    points, w = geometry.gather()
    for x in (*points, w):
        x.add_(1.0)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_source_group_and_interleave_errors_and_round_trip():
    torch.manual_seed(0)
    model = nn.Linear(4, 12).to(DT)
    geometry = ParameterGeometry(model)
    with pytest.raises(ValueError, match="interleave"):
        geometry.add_gl_pair(Source("weight", rows=(0, 4), interleave=(5, 3)), "bias", heads=2)
    with pytest.raises(ValueError, match="group"):
        geometry.add_gl_pair(Source("weight", group=0), Source("bias", group=0), heads=2)
    with pytest.raises(ValueError, match="grouped heads"):
        geometry.add_gl_pair(Source("weight", group=5), Source("bias"), heads=2)
    assert not geometry.blocks
    # rows [a_i; b_i; c_i] per unit i: interleave=(2, 3) reads the a rows of both units
    from quotientgeo import ScaleQuotient

    geometry.add(ScaleQuotient(2), Source("weight", rows=(0, 4), interleave=(2, 3)), heads=2)
    (x,), _ = geometry.gather()
    W = model.weight.detach().reshape(2, 3, 2, 4)[:, 0]  # unit i's a rows: (2 rows, 4 inputs)
    torch.testing.assert_close(x, W.transpose(1, 2), rtol=0, atol=0)
    assert_roundtrip_exact(geometry)


# ---------------------------------------------------------------------- locating heads
def test_locate_maps_kind_entries_to_blocks_heads_layers_and_parameters(tiny_bert):
    model = tiny_bert(DT)
    geometry = find_symmetries(model)
    kind = geometry.kinds[0]  # the QK pairs of both layers, 4 heads each
    assert [geometry.blocks[b].label for b in kind.blocks] == [
        "encoder.layer.0.attention.self.QK",
        "encoder.layer.1.attention.self.QK",
    ]
    loc = geometry.locate(0, 6)
    assert (loc.kind, loc.index, loc.block, loc.head, loc.layer) == (0, 6, kind.blocks[1], 2, 1)
    assert loc.label == "encoder.layer.1.attention.self.QK"
    self_ = "encoder.layer.1.attention.self"
    assert loc.params == tuple(
        f"{self_}.{p}.{t}" for p in ("query", "key") for t in ("weight", "bias")
    )
    assert str(loc) == "encoder.layer.1.attention.self.QK (layer 1), head 2"
    n = geometry.kinds[0].manifold.n
    assert geometry.locate(0, 6, (0, n)).params == (f"{self_}.query.weight", f"{self_}.query.bias")
    assert geometry.locate(0, 6, (n, n + 1)).params == (f"{self_}.key.weight",)
    points, _ = geometry.gather()
    head = points[0][6]  # the same entry, read from the model directly
    q = model.encoder.layer[1].attention.self.query
    torch.testing.assert_close(head[: n - 1], q.weight[8:12].T, rtol=0, atol=0)
    with pytest.raises(IndexError, match="kind 0 has 8 entries"):
        geometry.locate(0, 8)


def test_locate_without_a_layer_index():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    geometry = ParameterGeometry(model).add_gl_pair("0.weight", Source("2.weight", axis=1), heads=2)
    loc = geometry.locate(0, 1)
    assert (loc.label, loc.head, loc.layer) == ("GL pair 0", 1, None)
    assert str(loc) == "GL pair 0, head 1"
    assert geometry.plan.rest_names == ("0.bias", "2.bias")


def _layout_cases():
    def partial():
        torch.manual_seed(0)
        geometry = ParameterGeometry(TwoLayer().to(DT))
        geometry.add_gl_pair(
            [Source("fc1.weight", rows=(0, 4)), Source("fc1.bias", rows=(0, 4))],
            Source("fc2.weight", axis=1, cols=(0, 4)),
            heads=4,
        )
        return geometry

    return {
        "encoder": lambda: find_symmetries(encoder(d=16, heads=4, layers=2)),
        "bfloat16": lambda: find_symmetries(encoder(d=8, heads=2, layers=1).to(torch.bfloat16)),
        "partial coverage": partial,
        "grouped-query, q/k norm": lambda: find_symmetries(
            ProjAttention(d=12, num_heads=4, kv_heads=2, qk_norm=True).to(DT)
        ),
    }


@pytest.mark.parametrize("case", list(_layout_cases()))
def test_parts_read_and_write_like_the_geometry(case):
    """The parts the measures and GeodesicSAM work on read, write and draw as ``gather`` and
    ``scatter`` do (``quotientgeo.testing.assertions``'s
    :func:`assert_parts_read_and_write_like_the_geometry`)."""
    assert_parts_read_and_write_like_the_geometry(_layout_cases()[case]())


@pytest.mark.parametrize("case", list(_layout_cases()))
@pytest.mark.parametrize("seed", [0, 1])
def test_block_views_write_points_as_scatter_does(case, seed):
    """``block_views`` pairs every region of every block in the parameters with its place in
    the points: one ``_foreach_copy_`` through them writes random points into copies of the
    parameters as ``scatter`` forms them, and the reverse copy reads them as ``gather``."""
    from quotientgeo.geometry.transfer import block_views

    geometry = _layout_cases()[case]()
    plan = geometry.plan
    points, _ = geometry.gather()
    gen = torch.Generator().manual_seed(seed)
    points = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in points]
    tensors = {n: p.detach().clone() for n, p in geometry.params.items()}
    views = block_views(plan, points, tensors)
    if case == "encoder":  # fused in-projections: every region a view of its parameter
        assert views is not None
    if views is None:
        return
    in_tensors, in_points = views
    torch._foreach_copy_(in_tensors, in_points)
    expected = geometry.scatter(points, None)
    for name in plan.assembly:
        assert torch.equal(tensors[name], expected[name]), name
    read = [torch.zeros_like(p) for p in points]
    back_tensors, back_points = block_views(plan, read, tensors)
    torch._foreach_copy_(back_points, back_tensors)
    gathered, _ = geometry.gather(tensors)
    for r, g in zip(read, gathered, strict=True):
        assert torch.equal(r, g)


def test_chunk_fraction_is_larger_on_an_accelerator():
    from quotientgeo.geometry import perturbation as p

    assert p.chunk_fraction(torch.device("cpu")) == p.CHUNK_FRACTION
    assert p.chunk_fraction(torch.device("cuda")) == p.ACCELERATOR_CHUNK_FRACTION
    assert p.ACCELERATOR_CHUNK_FRACTION > p.CHUNK_FRACTION


@given(
    widths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    piece=st.integers(4, 64),
    chunk_entries=st.integers(0, 400),
)
@settings(max_examples=40, deadline=None)
def test_pieces_take_a_chunks_worth_where_that_is_more(widths, piece, chunk_entries):
    """A piece holds ``max(PIECE, chunk_bytes / entry size)`` entries (a slice of a larger
    parameter), or parameters of fewer entries than that (``SMALL`` scaled alike) until they
    reach it; every entry is in exactly one piece."""
    from quotientgeo.geometry import perturbation as p

    layers = [nn.Linear(a, b) for a, b in zip([3, *widths], widths, strict=False)]
    model = nn.Sequential(*layers).double()
    with mock.patch.object(p, "PIECE", piece), mock.patch.object(p, "SMALL", piece):
        space = p.Perturbations(
            ParameterGeometry(model), "second_order", chunk_bytes=8 * chunk_entries
        )
        size = max(piece, chunk_entries)
        assert space.piece_size == size
        seen = []
        for part in space.pieces:
            if len(part.segments) > 1:  # shared only by parameters smaller than a piece, and
                # closed once it holds a piece's worth
                assert all(space.params[seg.name].numel() < size for seg in part.segments)
                assert sum(seg.size for seg in part.segments[:-1]) < size
            else:
                assert part.segments[0].size <= size
            seen += [(seg.name, i) for seg in part.segments for i in range(seg.start, seg.stop)]
        expected = [(n, i) for n, t in space.params.items() for i in range(t.numel())]
        assert sorted(seen) == sorted(expected)  # (sliced parameters come before shared ones)


@given(
    seed=st.integers(0, 2**16),
    piece=st.sampled_from([7, 50, 10_000]),
    symmetric=st.booleans(),
    masked=st.booleans(),
)
@settings(max_examples=30, deadline=None)
def test_a_copy_in_the_spaces_order_holds_each_piece_of_the_rest_as_one_view(
    seed, piece, symmetric, masked
):
    """Parameters copied together in ``Perturbations.order`` (the rest's pieces first): every
    piece of the rest without a masked segment is one view of the copy (``Piece.view``), equal
    to its read; a masked piece, another dtype or segments apart are not (``None``)."""
    from quotientgeo.geometry import perturbation as p
    from quotientgeo.testing import TinyTransformerClassifier

    torch.manual_seed(seed)
    model = TinyTransformerClassifier(d=8, heads=2, layers=2, classes=3).double()
    geometry = find_symmetries(model) if symmetric else ParameterGeometry(model)
    if masked:  # hidden units 0..3 of the first feed-forward layer as GL(1) pairs
        first, second = "encoder.layers.0.linear1.weight", "encoder.layers.0.linear2.weight"
        geometry = ParameterGeometry(model).add_gl_pair(
            Source(first, rows=(0, 4)), Source(second, axis=1, cols=(0, 4)), heads=4
        )
    with pytest.MonkeyPatch.context() as mp:  # pieces of a few entries
        for name, value in (("PIECE", piece), ("SMALL", piece), ("MIN_CHUNK_BYTES", piece)):
            mp.setattr(p, name, value)
        mp.setattr(p, "CHUNK_FRACTION", 1e-9)
        space = p.Perturbations(geometry, "second_order")
    assert sorted(space.order) == sorted(space.params)
    local = space.local()
    together = dict(
        zip(space.order, p.clone_together([local[n] for n in space.order]), strict=True)
    )
    for part in space.rest:
        view = part.view(together, torch.float64)
        if any(seg.mask is not None for seg in part.segments):
            assert view is None
            continue
        assert view is not None
        assert (
            view.untyped_storage().data_ptr()
            == together[part.names[0]].untyped_storage().data_ptr()
        )
        assert torch.equal(view, part.read(local, torch.float64))
        assert part.view(together, torch.float32) is None
    if masked or any(len(part.segments) > 1 for part in space.rest):
        apart = {name: t.clone() for name, t in local.items()}  # one allocation each
        assert any(part.view(apart, torch.float64) is None for part in space.rest)


@given(
    shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=1, max_size=8),
    kinds=st.lists(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), min_size=8),
    copy=st.booleans(),
)
@settings(max_examples=40, deadline=None)
def test_tensors_together_are_one_allocation_per_dtype(shapes, kinds, copy):
    """``empty_like_together`` and ``clone_together``: contiguous tensors of the inputs' shapes
    and dtypes (copies of their values), the tensors of one dtype views of one allocation,
    disjoint, so that writing one leaves the others as they are."""
    from quotientgeo.geometry.perturbation import clone_together, empty_like_together

    gen = torch.Generator().manual_seed(len(shapes))
    tensors = [
        torch.randn(shape, generator=gen).to(dtype).transpose(0, -1) if len(shape) > 1
        else torch.randn(shape, generator=gen).to(dtype)
        for shape, dtype in zip(shapes, kinds, strict=False)
    ]  # fmt: skip
    out = (clone_together if copy else empty_like_together)(tensors)
    assert [(t.shape, t.dtype, t.device) for t in out] == [
        (t.shape, t.dtype, t.device) for t in tensors
    ]
    assert all(t.is_contiguous() for t in out)
    if copy:
        assert all(torch.equal(a, b) for a, b in zip(out, tensors, strict=True))
    storages = {}
    for t in out:
        storages.setdefault(t.dtype, set()).add(t.untyped_storage().data_ptr())
    assert all(len(ptrs) == 1 for ptrs in storages.values())
    assert len(storages) == len({t.dtype for t in tensors})
    for t in out:
        t.zero_()
    for i, t in enumerate(out):
        t.fill_(i + 1)
        assert all(bool((u == j + 1).all()) for j, u in enumerate(out[: i + 1]))


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    masked=st.lists(st.booleans(), min_size=4, max_size=4),
    transposed=st.lists(st.booleans(), min_size=4, max_size=4),
    filtered=st.booleans(),
    same_dtype=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_pieces_write_values_given_whole_or_by_segment(
    sizes, masked, transposed, filtered, same_dtype, seed
):
    """``Piece.write_`` and ``Piece.write_sum_`` write the same entries whether the values come
    as one vector or as one tensor per segment, and agree with an entry-by-entry reference
    (``tensors ← base + values`` at the segments' entries of the named parameters, cast to the
    parameters' dtype), on plain views, masked segments, non-contiguous parameters and mixed
    dtypes."""
    from quotientgeo.geometry.perturbation import Piece, Segment

    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float64
    tensors, base, segments = {}, {}, []
    for i, n in enumerate(sizes):
        name = f"p{i}"
        kind = dtype if same_dtype or i % 2 == 0 else torch.float32
        t = torch.randn(n, 3, generator=gen, dtype=kind)
        tensors[name] = t.t() if transposed[i] else t  # (non-contiguous where transposed)
        base[name] = torch.randn(3 * n, generator=gen, dtype=kind).view(tensors[name].shape)
        start = int(torch.randint(0, n, (), generator=gen))
        stop = int(torch.randint(start + 1, 3 * n + 1, (), generator=gen))
        mask = None
        if masked[i]:
            mask = torch.rand(stop - start, generator=gen) < 0.6
            mask[0] = True
        segments.append(Segment(name, start, stop, mask))
    piece = Piece(tuple(segments))
    names = {s.name for s in segments[::2]} if filtered else None
    parts = [torch.randn(s.size, generator=gen, dtype=dtype) for s in segments]

    def expected(sum_: bool) -> dict[str, torch.Tensor]:
        out = {n: t.clone() for n, t in tensors.items()}
        for seg, v in zip(segments, parts, strict=True):
            if names is not None and seg.name not in names:
                continue
            flat = out[seg.name].reshape(-1).clone()
            index = torch.arange(seg.start, seg.stop)
            if seg.mask is not None:
                index = index[seg.mask]
            value = v + base[seg.name].reshape(-1)[index].to(dtype) if sum_ else v
            flat[index] = value.to(flat.dtype)
            out[seg.name].copy_(flat.view(out[seg.name].shape))
        return out

    for sum_ in (False, True):
        want = expected(sum_)
        for values in (torch.cat(parts), parts):
            got = {n: t.clone() for n, t in tensors.items()}
            if sum_:
                piece.write_sum_(got, base, values, names)
            else:
                piece.write_(got, values, names)
            for n in tensors:
                assert torch.equal(got[n], want[n]), (n, sum_, type(values))
    with pytest.raises(ValueError, match="segments"):
        piece.write_(tensors, parts[:-1] + parts[-1:] * 2)
