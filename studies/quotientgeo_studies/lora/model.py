"""The study's model: the pretrained :class:`~.._vit.DigitsViT` with PEFT LoRA adapters on its
feed-forward layers and a new head, and the two scopes a measure sees.

A LoRA adapter adds ``(α/r) · B A`` to a frozen weight ``W`` (``A``: ``r × in``, ``B``:
``out × r``); ``(B, A) ↦ (B M⁻¹, M A)`` leaves the product unchanged for every ``M ∈ GL(r)``,
so :func:`quotientgeo.find_symmetries` declares each adapter as one ``GL(r)`` pair
(``G = B``, ``H = Aᵀ``). PEFT cannot wrap ``nn.MultiheadAttention``'s fused input projection
and ``F.multi_head_attention_forward`` bypasses its output projection, so the adapters sit on
the encoder layers' ``linear1`` and ``linear2``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from quotientgeo import GLQuotient, find_symmetries

from .. import _finetune, _vit

Tensor = torch.Tensor

SCOPES = ("adapters", "whole")
"""What a measure sees: the fine-tuned parameters only, or every parameter of the model."""

FROZEN_ATTENTION = r"\d+ attention blocks? found but"
"""The warning of :func:`quotientgeo.find_symmetries` about frozen attention blocks: with the
base frozen they are left out by design."""


@dataclasses.dataclass(frozen=True)
class Adapters:
    """The LoRA configuration: rank ``r``, scale ``alpha / r``, the wrapped ``nn.Linear``
    names (no dropout)."""

    r: int = 4
    alpha: float = 8.0
    targets: tuple[str, ...] = ("linear1", "linear2")


def _ordinary_path(module: nn.Module, args) -> None:
    """A forward pre-hook that changes nothing (see :func:`adapted`)."""
    return None


def adapted(
    base: dict[str, Tensor], pre: _finetune.Pretraining, adapters: Adapters, seed: int
) -> nn.Module:
    """The pretrained model ``base`` (a :class:`~.._vit.DigitsViT` state dict, its head
    dropped) with a new 5-way head and PEFT LoRA ``adapters``, initialised from ``seed``
    (head: PyTorch's default; adapters: PEFT's, ``A`` Kaiming-uniform and ``B = 0``). The
    adapters and the head are trainable, every other parameter frozen; the model is in
    evaluation mode.

    In evaluation mode ``nn.TransformerEncoderLayer`` takes a fused inference path that reads
    ``linear1.weight`` and ``linear2.weight`` directly, so it would compute the base model
    without the adapters. PyTorch leaves that path whenever a forward hook is attached to the
    layer, so each encoder layer gets one that changes nothing.
    """
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = _vit.DigitsViT(
        pre.width, pre.heads, pre.layers, classes=len(_finetune.FINETUNE_CLASSES)
    )
    model.load_state_dict(
        {k: v for k, v in base.items() if not k.startswith("head.")}, strict=False
    )
    config = LoraConfig(
        r=adapters.r,
        lora_alpha=adapters.alpha,
        lora_dropout=0.0,
        target_modules=list(adapters.targets),
    )
    peft_model = get_peft_model(model, config)
    model.head.requires_grad_(True)
    for layer in peft_model.modules():
        if isinstance(layer, nn.TransformerEncoderLayer):
            layer.register_forward_pre_hook(_ordinary_path)
    return peft_model.eval()


def trainable_state(model: nn.Module) -> dict[str, Tensor]:
    """Copies of the trainable parameters by name: what fine-tuning changed."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable(model: nn.Module, state: dict[str, Tensor]) -> nn.Module:
    """Write :func:`trainable_state` ``state`` into ``model`` (an :func:`adapted` one);
    ``ValueError`` unless ``state`` names exactly its trainable parameters."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    if set(state) != names:
        raise ValueError(
            f"the state holds {sorted(set(state) ^ names)[:3]} that the model's trainable "
            "parameters do not (or the other way round)"
        )
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in state:
                p.copy_(state[n])
    return model


@contextlib.contextmanager
def scope(model: nn.Module, name: str) -> Iterator[nn.Module]:
    """``model`` with the parameters of scope ``name`` trainable, the measured ones:
    ``"adapters"`` as it is (the LoRA pairs and the head), ``"whole"`` every parameter. Every
    ``requires_grad`` flag is restored on exit, also on errors."""
    if name not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {name!r}")
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        if name == "whole":
            for p, _ in flags:
                p.requires_grad_(True)
        yield model
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def lora_modules(model: nn.Module) -> list[str]:
    """Names of the modules that hold LoRA adapters (PEFT's ``LoraLayer``)."""
    from peft.tuners.lora import LoraLayer

    return [name for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def adapter_blocks(model: nn.Module, r: int) -> list[str]:
    """The labels of the ``GL(r)`` blocks that :func:`quotientgeo.find_symmetries` declares
    for ``model``'s adapters, one per LoRA module; ``ValueError`` naming an adapter it does not
    find as a ``GL(r)`` pair (or if the model has none)."""
    expected = [f"{name}.lora.default" for name in lora_modules(model)]
    if not expected:
        raise ValueError("the model has no LoRA adapter")
    geometry = find_symmetries(model, warn=False)
    found = {
        block.label
        for block in geometry.blocks
        if isinstance(block.manifold, GLQuotient) and block.heads == 1 and block.shape[1] == r
    }
    missing = [label for label in expected if label not in found]
    if missing:
        raise ValueError(
            f"find_symmetries does not find the adapter {missing[0]} as a GL({r}) pair "
            f"({len(missing)} of {len(expected)} missing)"
        )
    return expected


def describe(model: nn.Module) -> dict[str, object]:
    """What :func:`quotientgeo.find_symmetries` maps among ``model``'s trainable parameters:
    the block labels, their heads and the entries in symmetry blocks and in the adaptive
    rest."""
    geometry = find_symmetries(model, warn=False)
    return {
        "blocks": [block.label for block in geometry.blocks],
        "heads": geometry.n_heads,
        "symmetric_entries": geometry.n_symmetric,
        "adaptive_entries": geometry.n_adaptive,
    }
