"""What a reader finds in one attention module: :class:`AttentionFinding` and :class:`Rotary`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..layout import Source
from ..parameters import Factor, as_sources

__all__ = ["PAIRINGS", "ROTARY_PAIRING", "AttentionFinding", "Rotary", "Unmapped"]

PAIRINGS = ("half", "interleaved")

ROTARY_PAIRING = {
    "llama": "half",
    "mistral": "half",
    "mixtral": "half",
    "qwen2": "half",
    "qwen3": "half",
    "gemma2": "half",
    "gemma3_text": "half",
    "phi3": "half",
    "stablelm": "half",
    "falcon": "half",
    "modernbert": "half",
    "gpt_neox": "half",
    "gptj": "interleaved",
}
"""Rotary coordinate pairing by Hugging Face ``model_type``, each checked by moving a tiny random
model of the family along its group. Rotary embeddings of other models keep their QK pair
adaptive unless ``find_symmetries(model, rotary_pairing=...)`` states the pairing."""


class Unmapped(Exception):
    """Raised by a reader that recognises a module but cannot map it; the message says why
    (it is warned, and the module's parameters stay in the adaptive geometry)."""


@dataclass(frozen=True)
class Rotary:
    """Rotary embeddings applied to q and k: ``found`` names the evidence, ``pairing`` the
    coordinate pairing (``"half"``: ``i`` with ``i + r/2``; ``"interleaved"``: ``2i`` with
    ``2i + 1``; ``None``: not known) and ``dims`` the rotated coordinates per head, the first
    ``dims`` of each head (``None``: all)."""

    found: str
    pairing: str | None = None
    dims: int | None = None

    def __post_init__(self):
        if self.pairing is not None and self.pairing not in PAIRINGS:
            raise ValueError(f"pairing must be 'half', 'interleaved' or None, got {self.pairing!r}")


@dataclass(frozen=True)
class AttentionFinding:
    """One attention module as read by a reader: ``heads`` query heads and ``kv_heads``
    key/value heads (``heads % kv_heads == 0``).

    ``q``, ``k``, ``v`` are the factor sources of one head each (``nn.Linear`` convention,
    ``axis=0``: the head features are output rows; a parameter name means ``Source(name)``);
    ``o`` the output projection's head columns (``axis=1``), ``None`` if not found. The query
    heads that share a key/value head are stacked by the declaration rule (``Source.group``),
    unless ``q_stacked``: then ``q`` already holds one point per key/value head. Rows of ``q``
    (``k``) are every map whose products with ``k`` (``q``) enter the scores.

    ``rotary``: rotary embeddings on q and k (``None``: none); ``q_norm`` / ``k_norm``: the
    modules normalizing q / k per head or over all heads; ``qk_blocked`` / ``vo_blocked``: why
    the QK / VO pair is no symmetry at all (warned; ``None``: it is). ``label`` names the blocks
    (``label.QK``, ``label.VO``, ``label.q_scale``, ``label.k_scale``) and the warnings.
    """

    label: str
    heads: int
    kv_heads: int
    q: tuple[Source, ...]
    k: tuple[Source, ...]
    v: tuple[Source, ...]
    o: tuple[Source, ...] | None
    rotary: Rotary | None = None
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    qk_blocked: str | None = None
    vo_blocked: str | None = None
    q_stacked: bool = False

    def __post_init__(self):
        for name in ("heads", "kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{self.label}: {name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"{self.label}: {self.heads} query heads do not split into "
                f"{self.kv_heads} key/value groups"
            )
        for name in ("q", "k", "v", "o"):
            spec: Factor | None = getattr(self, name)
            if spec is not None:
                object.__setattr__(self, name, as_sources(spec))
