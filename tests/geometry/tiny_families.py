"""Tiny random float64 models of today's transformer families, built offline, and their
outputs: the table that tests/geometry/test_families.py checks discovery on.

Families that compute parts in float32 even for float64 models (the RMSNorm of Llama,
Mistral, Mixtral, Qwen, Gemma, Phi-3; GPT-J's attention scores) have ``exact=False``; those
that round the queries and keys to float32 (the q/k RMSNorm of Qwen3 and Gemma3, ModernBERT's
rotary embedding) name where in ``float32_qk`` (see :func:`sharpness_tolerance`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import timm
import torch
import transformers as hf
from torch import nn

from quotientgeo.testing.assertions import SHARPNESS_RTOL

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
    # Where the queries and keys, which the QK moves change, are rounded to float32 inside the
    # float64 model: why. Geodesic sharpness is then orbit-invariant to float32 rounding only.
    float32_qk: str = ""


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
    "qwen3": dataclasses.replace(
        decoder(
            hf.Qwen3Config,
            hf.Qwen3ForCausalLM,
            "positive scale R>0",
            head_dim=8,
            rms_norm_eps=1e-12,
        ),
        float32_qk="Qwen3RMSNorm, the q/k norm, computes in float32",
    ),
    "gemma2": decoder(hf.Gemma2Config, hf.Gemma2ForCausalLM, "(C*)^4", head_dim=8),
    "gemma3": dataclasses.replace(
        decoder(
            hf.Gemma3TextConfig,
            hf.Gemma3ForCausalLM,
            "positive scale R>0",
            head_dim=8,
            rms_norm_eps=1e-12,
        ),
        float32_qk="Gemma3RMSNorm, the q/k norm, computes in float32",
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
    "modernbert": Family(
        lambda: hf.ModernBertForMaskedLM(modernbert()),
        {"GL(8)", "(C*)^4"},
        float32_qk="apply_rotary_pos_emb rotates q.float() and k.float()",
    ),
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


def regression(name: str, seed: int = 2):
    """``(model, loss_fn)``: the family's tiny model (:func:`make`) and the mean squared error of
    its output against a fixed random target (``loss_fn(model, batch)`` ignores ``batch``)."""
    model, outputs = make(name)
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(outputs(model).shape, generator=gen, dtype=DT)

    def loss_fn(m, batch):
        return (outputs(m) - target).square().mean()

    return model, loss_fn


def output_tolerance(name: str) -> dict:
    return {} if FAMILIES[name].exact else dict(rtol=1e-5, atol=1e-6)


def sharpness_tolerance(name: str) -> float:
    """Relative change of geodesic sharpness allowed along the family's orbits.

    ``SHARPNESS_RTOL`` (1e-9) unless the family rounds the queries and keys to float32
    (``float32_qk``): a QK move changes ``q``, ``k`` and so their float32 roundings, and the
    sharpness with them, by float32 rounding errors (measured: 1.0e-7 and 3.1e-7 for Qwen3,
    1.7e-7 and 1.3e-7 for Gemma3, 3.2e-10 and 6.2e-9 for ModernBERT, mix and inv; 5e-12 and
    below with those computations patched to float64). The bound there is 1e-5, about 80
    float32 epsilons. A float32 RMSNorm on the residual stream (Llama, Mistral, ...) is no
    such case: its input does not change along the orbits beyond float64 rounding, so its
    float32 rounding lands on the same values and those families meet 1e-9.
    """
    return 1e-5 if FAMILIES[name].float32_qk else SHARPNESS_RTOL
