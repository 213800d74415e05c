"""Discovery on today's transformer families, checked by moving tiny random models.

Families: GPT-2, DistilBERT, OPT, BART, Whisper, BLOOM, Llama, Mistral, Mixtral, Qwen2/3,
Gemma 2/3, Phi-3, StableLM (with and without q/k LayerNorm), GPT-NeoX, GPT-J, Falcon
(multi-query, new decoder architecture with grouped key/value heads, ALiBi), DeBERTa-v2 (with
shared and with separate position projections), ModernBERT, timm's ViT (with and without
``qk_norm``).

For every family: the blocks found carry the architecture's own group (GL(h), the rotary
subgroup, positive scales); moving every block by a random element of that group leaves the
output unchanged, leaves geodesic sharpness (both metrics) unchanged to 1e-9 relative (1e-5
where the family rounds queries and keys to float32: ``sharpness_tolerance``) and changes
adaptive sharpness. Moves outside the group (a generic GL(h) element on a rotary QK pair, a
non-scalar one on a q/k-normed head) change the output.

Families that compute parts in float32 even for float64 models (the RMSNorm of Llama,
Mistral, Qwen, Gemma, Phi-3; GPT-J's attention scores) are exact only to float32 rounding:
their output tolerance is 1e-5 instead of float64's, far below what the moves outside the
group change (> 1e-3).

A q/k norm ``x / sqrt(mean(x²) + eps)`` is scale invariant only as ``eps → 0`` (relative
deviation ``≈ eps / (2 mean(x²))``): the normed families are built with ``eps = 1e-12``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import transformers as hf
from tiny_families import (
    DT,
    FAMILIES,
    VOCAB,
    make,
    output_tolerance,
    sharpness_tolerance,
    tiny_vit,
)
from torch import nn

from quotientgeo import GLQuotient, ParameterGeometry, find_symmetries
from quotientgeo.testing import moved_along_orbits
from quotientgeo.testing.assertions import (
    SHARPNESS_RTOL,
    assert_roundtrip_exact,
    assert_sharpness_invariance,
)
from quotientgeo.testing.numerics import relative_change


def discovered(model: nn.Module):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        geometry = find_symmetries(model)
    ours = [str(w.message) for w in caught if "adaptive geometry" in str(w.message)]
    assert not ours, ours
    return geometry


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_blocks_carry_the_architectures_group(name):
    model, _ = make(name)
    geometry = discovered(model)
    groups = {k.manifold.group_name(k.shape) for k in geometry.kinds}
    assert groups == FAMILIES[name].groups
    summary = geometry.summary()
    assert all(g in summary for g in groups)
    # every attention layer has a VO block; QK is a GL pair, a rotary pair or two scale blocks
    labels = [b.label for b in geometry.blocks]
    assert sum(lbl.endswith(".VO") for lbl in labels) >= 2
    assert_roundtrip_exact(geometry)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_moves_along_the_group_keep_outputs_and_geodesic_sharpness(name):
    model, outputs = make(name)
    # measure over the attention weights only (the rest frozen), where the moves act
    symmetric = set(discovered(model).symmetric_names)
    for pname, p in model.named_parameters():
        p.requires_grad_(pname in symmetric)
    discovered(model)
    before = outputs(model)
    target = torch.randn(before.shape, generator=torch.Generator().manual_seed(2), dtype=DT)

    def loss_fn(m, batch):
        return (outputs(m) - target).square().mean()

    assert_sharpness_invariance(
        model,
        loss_fn,
        [None],
        outputs,
        rho=0.05,
        n_iter=8,
        scales=(2.0,),
        output_tol=output_tolerance(name),
        adaptive_min=0.5,
        # 1e-9, or 1e-5 where the family rounds q and k to float32 (FAMILIES[name].float32_qk)
        rtol=sharpness_tolerance(name),
    )


ROTARY = sorted(n for n, f in FAMILIES.items() if any(g.startswith("(C*)") for g in f.groups))
NORMED = sorted(n for n, f in FAMILIES.items() if "positive scale R>0" in f.groups)


def move_kind_(geometry, group: str, move: Callable[[torch.Tensor], torch.Tensor]) -> None:
    points, w = geometry.gather()
    for i, kind in enumerate(geometry.kinds):
        if kind.manifold.group_name(kind.shape) == group:
            points[i] = move(points[i])
    geometry.assign_(points, w)


def max_relative_change(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", ROTARY)
def test_generic_gl_move_of_a_rotary_pair_changes_the_output(name):
    model, outputs = make(name)
    geometry = discovered(model)
    before = outputs(model)
    (group,) = FAMILIES[name].groups - {"GL(8)"}
    (kind,) = [k for k in geometry.kinds if k.manifold.group_name(k.shape) == group]
    gl = GLQuotient(kind.manifold.n)
    gen = torch.Generator().manual_seed(4)
    # one generic element, and a subgroup element for contrast: only the first changes outputs
    A = torch.randn(kind.batch, 8, 8, generator=gen, dtype=DT)
    inside = kind.manifold.random_group(
        torch.zeros(kind.batch, *kind.shape, dtype=DT), generator=gen
    )
    with torch.no_grad():
        move_kind_(geometry, group, lambda x: gl.act(x, inside))
        torch.testing.assert_close(outputs(model), before, **output_tolerance(name))
        move_kind_(geometry, group, lambda x: gl.act(x, A))
        assert max_relative_change(outputs(model), before) > 1e-3


@pytest.mark.parametrize("name", NORMED)
def test_non_scalar_move_of_a_normed_head_changes_the_output(name):
    model, outputs = make(name)
    geometry = discovered(model)
    before = outputs(model)
    gen = torch.Generator().manual_seed(5)
    group = "positive scale R>0"
    with torch.no_grad():
        scale = lambda x: x * (3 * torch.rand(x.shape[0], 1, 1, generator=gen, dtype=DT) + 0.5)  # noqa: E731
        move_kind_(geometry, group, scale)
        torch.testing.assert_close(outputs(model), before, **output_tolerance(name))
        # a positive but non-scalar diagonal on each head's features
        diagonal = lambda x: x * (3 * torch.rand(x.shape[0], 1, 8, generator=gen, dtype=DT) + 0.5)  # noqa: E731
        move_kind_(geometry, group, diagonal)
        assert max_relative_change(outputs(model), before) > 1e-3


def test_deberta_v2_position_projections_move_with_their_side():
    """DeBERTa-v2 without shared keys: c2p scores pair ``query_proj`` with ``pos_key_proj`` and
    p2c scores ``key_proj`` with ``pos_query_proj``, so the QK pair stacks them (q-like rows in
    G, k-like rows in H). The same move of ``query_proj``/``key_proj`` alone changes the output."""
    model, outputs = make("deberta_v2_pos_proj")
    geometry = discovered(model)
    qk = [b for b in geometry.blocks if b.label.endswith(".QK")]
    assert len(qk) == 2
    for block in qk:
        g, h = ([s.param.rsplit(".", 2)[-2] for s in f] for f in block.factors)
        assert g == ["query_proj", "query_proj", "pos_query_proj", "pos_query_proj"]
        assert h == ["key_proj", "key_proj", "pos_key_proj", "pos_key_proj"]

    def content_only(m: nn.Module) -> ParameterGeometry:
        out = ParameterGeometry(m)
        for block in qk:
            g, h = ([s for s in f if ".pos_" not in s.param] for f in block.factors)
            out.add_gl_pair(g, h, heads=block.heads, label=block.label)
        return out

    with torch.no_grad():  # position terms as large as content terms: a wrong move shows
        model.deberta.encoder.rel_embeddings.weight.mul_(20.0)
        before = outputs(model)
        torch.testing.assert_close(outputs(moved_along_orbits(model, scale=2.0, seed=1)), before)
        moved = moved_along_orbits(model, scale=2.0, seed=1, symmetries=content_only)
        assert max_relative_change(outputs(moved), before) > 1e-3


def test_gpt2_cross_attention_is_mapped():
    config = hf.GPT2Config(
        n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB, add_cross_attention=True
    )
    model = hf.GPT2LMHeadModel(config).to(DT).eval()
    geometry = discovered(model)
    labels = sorted(b.label for b in geometry.blocks)
    assert labels == [
        "transformer.h.0.attn.QK",
        "transformer.h.0.attn.VO",
        "transformer.h.0.crossattention.QK",
        "transformer.h.0.crossattention.VO",
    ]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 5), generator=gen)
    memory = torch.randn(2, 4, 32, generator=gen, dtype=DT)
    outputs = lambda m: m(input_ids=ids, encoder_hidden_states=memory).logits  # noqa: E731
    before = outputs(model)
    torch.testing.assert_close(outputs(moved_along_orbits(model, scale=2.0, seed=1)), before)


def test_timm_norm_between_heads_and_projection_blocks_vo():
    model = tiny_vit(depth=1, scale_attn_norm=True)
    with pytest.warns(UserWarning, match="VO pair is no symmetry because of a norm"):
        geometry = find_symmetries(model)
    assert [b.label for b in geometry.blocks] == ["blocks.0.attn.QK"]


def test_unknown_rotary_layout_and_unknown_attention_warn():
    class Rotated(nn.Module):
        """q_proj/k_proj/v_proj/o_proj next to a rotary module of an unknown family."""

        def __init__(self):
            super().__init__()
            self.num_heads = 2
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(8, 8) for _ in "qkvo")
            self.rotary_emb = nn.Identity()

    class StrangeAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = nn.Linear(8, 24)

    model = nn.ModuleDict({"a": Rotated(), "b": StrangeAttention()})
    with pytest.warns(UserWarning) as caught:
        geometry = find_symmetries(model)
    messages = [str(w.message) for w in caught]
    assert any("a: rotary position embeddings" in m and "pairing not known" in m for m in messages)
    assert any(m.startswith("b (StrangeAttention): attention-like") for m in messages)
    assert [b.label for b in geometry.blocks] == ["a.VO"]


@pytest.mark.parametrize("perturbation", ["exact", "first_order"])
def test_rotary_blocks_keep_every_perturbation_invariant(perturbation):
    """The rotary subgroup's geodesics are the GL total space's (delegated): exact and
    first-order geodesic sharpness are orbit-invariant too (GPT-NeoX, partial rotary)."""
    from quotientgeo import geodesic_sharpness

    model, outputs = make("gpt_neox")
    symmetric = set(discovered(model).symmetric_names)
    for pname, p in model.named_parameters():
        p.requires_grad_(pname in symmetric)
    before = outputs(model)
    target = torch.randn(before.shape, generator=torch.Generator().manual_seed(2), dtype=DT)

    def loss_fn(m, batch):
        return (outputs(m) - target).square().mean()

    kw = dict(rho=0.05, n_iter=4, progress=False, perturbation=perturbation)
    moved = moved_along_orbits(model, scale=2.0, seed=3)
    for metric in ("mix", "inv"):
        a = geodesic_sharpness(model, loss_fn, [None], metric=metric, **kw).value
        b = geodesic_sharpness(moved, loss_fn, [None], metric=metric, **kw).value
        assert relative_change(b, a) <= SHARPNESS_RTOL, (metric, a, b)
