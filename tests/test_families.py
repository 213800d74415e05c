"""Discovery on today's transformer families, checked by moving tiny random models.

Families: GPT-2, DistilBERT, OPT, BART, Whisper, BLOOM, Llama, Mistral, Mixtral, Qwen2/3,
Gemma 2/3, Phi-3, StableLM (with and without q/k LayerNorm), GPT-NeoX, GPT-J, Falcon
(multi-query, new decoder architecture with grouped key/value heads, ALiBi), DeBERTa-v2 (with
shared and with separate position projections), ModernBERT, timm's ViT (with and without
``qk_norm``).

For every family: the blocks found carry the architecture's own group (GL(h), the rotary
subgroup, positive scales); moving every block by a random element of that group leaves the
output unchanged, leaves geodesic sharpness (both metrics) unchanged to 1e-3 and changes
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

import dataclasses
import functools
import warnings
from collections.abc import Callable

import pytest
import timm
import torch
import transformers as hf
from conftest import assert_roundtrip_exact, assert_sharpness_invariance
from torch import nn

from quotientgeo import GLQuotient, ParameterGeometry, find_symmetries
from quotientgeo.testing import moved_along_orbits

DT = torch.float64
VOCAB, SEQ, BATCH = 50, 6, 3
HIDDEN = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
DECODER = dict(
    HIDDEN, vocab_size=VOCAB, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2
)

SEQ2SEQ = dict(
    d_model=32,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=48,
    decoder_ffn_dim=48,
    vocab_size=VOCAB,
)


@dataclasses.dataclass
class Family:
    build: Callable[[], nn.Module]
    groups: set[str]  # group names of the kinds find_symmetries must produce
    inputs: str = "ids"  # "ids", "seq2seq", "audio" or "image"
    exact: bool = True  # False: float32 RMSNorm inside, output exact to ~1e-7 only


def tiny_vit(depth: int = 2, **kw) -> nn.Module:
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8, embed_dim=32,
        depth=depth, num_heads=4, num_classes=5, **kw,
    )  # fmt: skip


def falcon(**kw) -> hf.FalconConfig:
    """Falcon; multi-query attention with rotary embeddings unless ``kw`` says otherwise."""
    return hf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           vocab_size=VOCAB, **kw)  # fmt: skip


def deberta_v2(**kw) -> hf.DebertaV2Config:
    """DeBERTa-v2 with both disentangled position terms (content→position, position→content)."""
    return hf.DebertaV2Config(
        **HIDDEN, vocab_size=VOCAB, relative_attention=True, pos_att_type=["c2p", "p2c"],
        position_buckets=4, max_relative_positions=8, **kw,
    )  # fmt: skip


def modernbert() -> hf.ModernBertConfig:
    """ModernBERT: fused ``Wqkv`` rows and rotary embeddings."""
    special = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    return hf.ModernBertConfig(**HIDDEN, vocab_size=VOCAB, **special)


def decoder(config_cls, model_cls, qk_group: str, **kw) -> Family:
    """A Hugging Face decoder with grouped-query attention (VO: GL(8)) whose RMSNorm runs in
    float32, its QK blocks on ``qk_group``."""
    return Family(
        lambda: model_cls(config_cls(**{**DECODER, **kw})), {"GL(8)", qk_group}, exact=False
    )


FAMILIES = {
    "gpt2": Family(
        lambda: hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB)),
        {"GL(8)"},
    ),
    "distilbert": Family(
        lambda: hf.DistilBertModel(
            hf.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=48, vocab_size=VOCAB)
        ),
        {"GL(8)"},
    ),
    "opt": Family(
        lambda: hf.OPTForCausalLM(
            hf.OPTConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                ffn_dim=48,
                vocab_size=VOCAB,
                word_embed_proj_dim=32,
            )
        ),
        {"GL(8)"},
    ),
    "bart": Family(
        lambda: hf.BartModel(hf.BartConfig(**SEQ2SEQ)),
        {"GL(8)"},
        inputs="seq2seq",
    ),
    "whisper": Family(
        lambda: hf.WhisperModel(
            hf.WhisperConfig(
                **SEQ2SEQ,
                num_mel_bins=8,
                max_source_positions=8,
                max_target_positions=16,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=1,
            )
        ),
        {"GL(8)"},
        inputs="audio",
    ),
    "bloom": Family(
        lambda: hf.BloomForCausalLM(
            hf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB)
        ),
        {"GL(8)"},
    ),
    "llama": decoder(hf.LlamaConfig, hf.LlamaForCausalLM, "(C*)^4"),
    "mistral": decoder(hf.MistralConfig, hf.MistralForCausalLM, "(C*)^4"),
    "qwen2": decoder(hf.Qwen2Config, hf.Qwen2ForCausalLM, "(C*)^4"),
    "qwen3": decoder(
        hf.Qwen3Config, hf.Qwen3ForCausalLM, "positive scale R>0", head_dim=8, rms_norm_eps=1e-12
    ),
    "gemma2": decoder(hf.Gemma2Config, hf.Gemma2ForCausalLM, "(C*)^4", head_dim=8),
    "gemma3": decoder(
        hf.Gemma3TextConfig,
        hf.Gemma3ForCausalLM,
        "positive scale R>0",
        head_dim=8,
        rms_norm_eps=1e-12,
    ),
    "phi3": decoder(hf.Phi3Config, hf.Phi3ForCausalLM, "(C*)^2 × GL(4)", partial_rotary_factor=0.5),
    "gpt_neox": Family(
        lambda: hf.GPTNeoXForCausalLM(
            hf.GPTNeoXConfig(**{**HIDDEN, "vocab_size": VOCAB, "rotary_pct": 0.5})
        ),
        {"GL(8)", "(C*)^2 × GL(4)"},
    ),
    "gptj": Family(
        lambda: hf.GPTJForCausalLM(
            hf.GPTJConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, rotary_dim=4)
        ),
        {"GL(8)", "(C*)^2 × GL(4)"},
        exact=False,
    ),
    "mixtral": decoder(
        hf.MixtralConfig,
        hf.MixtralForCausalLM,
        "(C*)^4",
        # both experts always chosen: no routing decision flips at float32 rounding
        num_local_experts=2,
        num_experts_per_tok=2,
        experts_implementation="eager",
    ),
    "stablelm": Family(
        lambda: hf.StableLmForCausalLM(hf.StableLmConfig(**DECODER, partial_rotary_factor=0.5)),
        {"GL(8)", "(C*)^2 × GL(4)"},
    ),
    "stablelm_qk_norm": Family(
        lambda: hf.StableLmForCausalLM(
            hf.StableLmConfig(**DECODER, qk_layernorm=True, layer_norm_eps=1e-12)
        ),
        {"GL(8)", "positive scale R>0"},
    ),
    "falcon": Family(lambda: hf.FalconForCausalLM(falcon()), {"GL(8)", "(C*)^4"}),
    "falcon_new_decoder": Family(
        lambda: hf.FalconForCausalLM(falcon(new_decoder_architecture=True, num_kv_heads=2)),
        {"GL(8)", "(C*)^4"},
    ),
    "falcon_alibi": Family(
        lambda: hf.FalconForCausalLM(falcon(alibi=True, multi_query=False, parallel_attn=False)),
        {"GL(8)"},
    ),
    "deberta_v2": Family(
        lambda: hf.DebertaV2ForMaskedLM(deberta_v2(share_att_key=True)), {"GL(8)"}
    ),
    "deberta_v2_pos_proj": Family(
        lambda: hf.DebertaV2ForMaskedLM(deberta_v2(share_att_key=False)), {"GL(8)"}
    ),
    "modernbert": Family(lambda: hf.ModernBertForMaskedLM(modernbert()), {"GL(8)", "(C*)^4"}),
    "timm_vit": Family(tiny_vit, {"GL(8)"}, inputs="image"),
    "timm_vit_qk_norm": Family(
        lambda: tiny_vit(qk_norm=True, norm_layer=functools.partial(nn.LayerNorm, eps=1e-12)),
        {"GL(8)", "positive scale R>0"},
        inputs="image",
    ),
}


def make(name: str) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """The family's tiny random float64 model in eval mode and its output function."""
    torch.manual_seed(0)
    family = FAMILIES[name]
    model = family.build().to(DT).eval()
    with torch.no_grad():  # larger weights than the default init: moves then matter more
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(2.0)
    gen = torch.Generator().manual_seed(1)
    if family.inputs == "image":
        images = torch.randn(BATCH, 3, 16, 16, generator=gen, dtype=DT)
        return model, lambda m: m(images)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    if family.inputs == "audio":
        features = torch.randn(BATCH, 8, 16, generator=gen, dtype=DT)
        return model, lambda m: m(input_features=features, decoder_input_ids=ids).last_hidden_state
    if family.inputs == "seq2seq":
        return model, lambda m: m(input_ids=ids, decoder_input_ids=ids).last_hidden_state
    if isinstance(model, hf.DistilBertModel):
        return model, lambda m: m(input_ids=ids).last_hidden_state
    return model, lambda m: m(input_ids=ids).logits


def discovered(model: nn.Module):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        geometry = find_symmetries(model)
    ours = [str(w.message) for w in caught if "adaptive geometry" in str(w.message)]
    assert not ours, ours
    return geometry


def output_tolerance(name: str) -> dict:
    return {} if FAMILIES[name].exact else dict(rtol=1e-5, atol=1e-6)


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
        assert abs(a - b) / abs(a) < 1e-3, (metric, a, b)
