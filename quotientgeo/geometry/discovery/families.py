"""Readers of attention layouts that belong to one model family (Falcon, DeBERTa-v2)."""

from __future__ import annotations

from torch import nn

from ..layout import Source
from .context import DiscoveryContext, integer, linear, linear_sources
from .findings import AttentionFinding, Unmapped
from .readers import interleaved

__all__ = ["deberta_v2", "falcon"]


def falcon(prefix: str, m: nn.Module, ctx: DiscoveryContext) -> AttentionFinding | None:
    """Falcon ``query_key_value`` and ``dense``, in its three layouts of rows:

    - ``new_decoder_architecture``: per key/value group ``g`` the rows
      ``[q_{g,0}; …; q_{g,r-1}; k_g; v_g]`` (``r = heads / num_kv_heads``), query head
      ``g·r + j`` being ``q_{g,j}``;
    - ``multi_query``: ``[q; k; v]`` with one key/value head;
    - otherwise ``[q_i; k_i; v_i]`` per head ``i`` (as GPT-NeoX).

    Rotary embeddings (half pairing, all coordinates) unless the config sets ``alibi``: ALiBi
    adds a bias of the positions alone to the scores, which keeps the QK ``GL(h)`` pair.
    """
    lin = linear(m, "query_key_value")
    heads, d = integer(m, "num_heads"), integer(m, "head_dim")
    flags = ("new_decoder_architecture", "multi_query")
    if lin is None or heads is None or d is None or not all(hasattr(m, f) for f in flags):
        return None
    n, attr = lin.out_features, "query_key_value"
    if getattr(m, "new_decoder_architecture", False):
        kv = integer(m, "num_kv_heads") or 0
        if kv < 1 or heads % kv or n != (heads + 2 * kv) * d:
            raise Unmapped(f"{attr} has {n} rows, not {kv} groups of {heads} // {kv} + 2 heads")
        r, width = heads // kv, kv * d

        def part(j: int) -> tuple[Source, ...]:
            span = (j * width, (j + 1) * width)
            return linear_sources(prefix, attr, lin, rows=span, interleave=(kv, r + 2))

        q = tuple(s for j in range(r) for s in part(j))
        k, v, stacked = part(r), part(r + 1), True
    elif getattr(m, "multi_query", False):
        kv, stacked = 1, False
        if n != (heads + 2) * d:
            raise Unmapped(f"{attr} has {n} rows, not {heads} query heads and 2 of width {d}")
        spans = ((0, heads * d), (heads * d, (heads + 1) * d), ((heads + 1) * d, n))
        q, k, v = (linear_sources(prefix, attr, lin, rows=s) for s in spans)
    else:
        kv, stacked = heads, False
        if n != 3 * heads * d:
            raise Unmapped(f"{attr} has {n} rows, not 3 × {heads} heads")
        q, k, v = interleaved(prefix, attr, lin, heads, 3, heads * d)
    config = getattr(m, "config", None) or ctx.config
    rotary = None if getattr(config, "alibi", False) else ctx.rotary_for(m, d)
    o = ctx.output(prefix, m, heads * d)
    label = prefix or type(m).__name__
    return AttentionFinding(label, heads, kv, q, k, v, o, rotary=rotary, q_stacked=stacked)


def deberta_v2(prefix: str, m: nn.Module, ctx: DiscoveryContext) -> AttentionFinding | None:
    """DeBERTa-v2/v3 disentangled attention: ``query_proj``/``key_proj``/``value_proj`` and
    the parent's ``output.dense``.

    Scores ``q_c k_cᵀ + q_c k_rᵀ (c2p) + k_c q_rᵀ (p2c)``, with ``q_r``, ``k_r`` the relative
    position embeddings mapped by ``query_proj``/``key_proj`` (``share_att_key``) or by
    ``pos_query_proj``/``pos_key_proj``. Each term pairs a q-like and a k-like map, so one
    ``A ∈ GL(h)`` per head keeps all three when every q-like map (``query_proj``, and
    ``pos_query_proj`` with p2c) moves by ``A`` and every k-like one (``key_proj``, and
    ``pos_key_proj`` with c2p) by ``A⁻ᵀ``: the QK pair stacks them. Other position terms
    block it.
    """
    query, key, value = (linear(m, n) for n in ("query_proj", "key_proj", "value_proj"))
    if query is None or key is None or value is None or not hasattr(m, "pos_att_type"):
        return None
    heads, kv = ctx.heads(m)
    q = linear_sources(prefix, "query_proj", query)
    k = linear_sources(prefix, "key_proj", key)
    v = linear_sources(prefix, "value_proj", value)
    blocked = None
    if getattr(m, "relative_attention", False):
        terms = set(getattr(m, "pos_att_type", None) or ())
        if terms - {"c2p", "p2c"}:
            blocked = f"position scores {sorted(terms - {'c2p', 'p2c'})}"
        elif not getattr(m, "share_att_key", False):
            for term, attr, side in (("p2c", "pos_query_proj", "q"), ("c2p", "pos_key_proj", "k")):
                lin = linear(m, attr)
                if term not in terms:
                    continue
                if lin is None:
                    raise Unmapped(f"{term} scores without the {attr} projection")
                if side == "q":
                    q = (*q, *linear_sources(prefix, attr, lin))
                else:
                    k = (*k, *linear_sources(prefix, attr, lin))
    label = prefix or type(m).__name__
    o = ctx.output(prefix, m, value.out_features)
    return AttentionFinding(label, heads, kv, q, k, v, o, qk_blocked=blocked)
