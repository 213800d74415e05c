"""The walk: every module through the registered readers, each finding through the rule."""

from __future__ import annotations

import re
import warnings

from torch import nn

from ...manifolds import DEFAULT_METRIC, GLQuotient
from ..parameters import ParameterGeometry
from .context import DiscoveryContext
from .findings import PAIRINGS, AttentionFinding, Unmapped
from .registry import registered_readers
from .rules import Rules

__all__ = ["find_symmetries"]

ATTENTION_LIKE = re.compile(r"attention|attn", re.IGNORECASE)


def find_symmetries(
    model: nn.Module,
    *,
    metric: str | float = DEFAULT_METRIC,
    rotary_pairing: str | None = None,
    warn: bool = True,
) -> ParameterGeometry:
    """Discover the symmetry blocks of ``model``.

    Every module is offered to the registered readers (:func:`register_reader`; the first that
    recognises it reads it into an :class:`AttentionFinding`) and every finding is declared by
    one rule: a ``GL(h)`` VO pair per key/value head; for QK per-head positive scales when q/k
    are normalized, the rotary subgroup with rotary embeddings, else a ``GL(h)`` pair; LoRA
    ``lora_A``/``lora_B`` adapters give a ``GL(r)`` pair. Built-in readers:
    ``nn.MultiheadAttention`` (hence ``nn.Transformer*Layer``); separate projections
    ``query``/``key``/``value`` (BERT, RoBERTa, ViT), ``q_proj``/``k_proj``/``v_proj`` (Llama,
    Mistral, Mixtral, Qwen2/3, Gemma 2/3, StableLM, OPT, BART, Whisper, CLIP, GPT-J),
    ``q_lin``/``k_lin``/``v_lin`` (DistilBERT), ``q``/``k``/``v`` (T5); fused rows
    ``[q; k; v]`` (timm ``qkv``, Phi-3 ``qkv_proj``, ModernBERT ``Wqkv``); GPT-NeoX's and
    BLOOM's per-head interleaved ``query_key_value``; Falcon's three ``query_key_value``
    layouts; DeBERTa-v2's disentangled attention; GPT-2's ``Conv1D``.

    Args:
        model: the module to read; only trainable parameters form blocks.
        metric: the metric of every declared GL and rotary block (``"mix"``, ``"inv"`` or
            ``s`` in ``[0, 1]``).
        rotary_pairing: the coordinate pairing of the model's rotary embeddings, ``"half"``
            or ``"interleaved"``; ``None`` reads it from ``ROTARY_PAIRING`` by the
            config's ``model_type``.
        warn: warn (``UserWarning``, one per module) about everything recognised but left to
            the adaptive geometry, with the reason, and once about attention blocks left out
            because their parameters are frozen.

    Returns:
        The :class:`~quotientgeo.ParameterGeometry`; its ``skipped`` lists what was left out
        and why.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    GLQuotient(2, metric)  # a metric that is not one raises here, before any work
    if rotary_pairing is not None and rotary_pairing not in PAIRINGS:
        raise ValueError(
            f"rotary_pairing must be 'half', 'interleaved' or None, got {rotary_pairing!r}"
        )
    rules = Rules(ParameterGeometry(model), DiscoveryContext(model, rotary_pairing), metric)
    named = dict(model.named_modules())
    recognised = [name for name, module in named.items() if read(name, module, rules)]
    for name, module in unrecognised(named, recognised):
        what = f"{name or type(module).__name__} ({type(module).__name__})"
        message = (
            f"{what}: attention-like module with no known layout; its parameters stay in the "
            "adaptive geometry"
        )
        rules.messages.append(message)
        rules.skipped.append(message)
    for message in (rules.frozen_message(), rules.fused_message()):
        if message is not None:
            rules.messages.append(message)
    geometry = rules.geometry
    geometry.skipped = tuple(rules.skipped)
    if warn:
        for message in rules.messages:
            warnings.warn(message, UserWarning, stacklevel=2)
    return geometry


def read(name: str, module: nn.Module, rules: Rules) -> bool:
    """Offer ``module`` to the registered readers and declare what the first one finds, else
    its LoRA adapters; ``True`` if it was recognised."""
    context = rules.context
    try:
        finding = next(
            (f for r in registered_readers() if (f := r(name, module, context)) is not None), None
        )
    except Unmapped as err:
        rules.leave_out(name or type(module).__name__, str(err))
        return True
    if finding is None:
        return rules.declare_lora(name, module)
    if not isinstance(finding, AttentionFinding):
        raise TypeError(
            f"a reader returned {type(finding).__name__} for {name or 'the model'}; "
            "readers return an AttentionFinding or None"
        )
    rules.declare_attention(finding)
    return True


def unrecognised(named: dict[str, nn.Module], recognised: list[str]):
    """Attention-like modules (by class name) with trainable parameters that no reader
    recognised and that neither contain nor sit inside a recognised one (outermost only)."""

    def related(name: str) -> bool:
        if name == "" or "" in recognised:
            return True
        return any(
            name == r or name.startswith(r + ".") or r.startswith(name + ".") for r in recognised
        )

    reported: list[str] = []
    for name, module in named.items():
        if not ATTENTION_LIKE.search(type(module).__name__) or related(name):
            continue
        if any(name.startswith(r + ".") for r in reported):
            continue
        if not any(p.requires_grad for p in module.parameters()):
            continue
        reported.append(name)
        yield name, module
