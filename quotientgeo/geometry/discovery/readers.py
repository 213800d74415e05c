"""Readers of the common attention layouts, one per layout.

A reader is ``reader(name, module, context) -> AttentionFinding | None``: ``None`` when it
does not recognise the module, an :class:`AttentionFinding` when it does, and it raises
:class:`Unmapped` when it recognises the module but cannot map it. Family-specific readers are
in :mod:`.families`; the order in which they are tried is in :mod:`.registry`.
"""

from __future__ import annotations

from torch import nn

from ..layout import Source
from .context import (
    DiscoveryContext,
    Reader,
    conv1d,
    integer,
    join,
    linear,
    linear_sources,
    norm,
)
from .findings import AttentionFinding, Unmapped

__all__ = ["fused_rows", "gpt2", "mha", "neox", "separate"]


def mha(prefix: str, m: nn.Module, ctx: DiscoveryContext) -> AttentionFinding | None:
    """``nn.MultiheadAttention``: ``in_proj_weight`` rows ``[q; k; v]`` (or ``q/k/v_proj_weight``),
    ``in_proj_bias``, ``bias_k``/``bias_v`` (an extra key/value token: one more row of the
    factor) and ``out_proj``. Nothing is applied between its projections and the scores."""
    if not isinstance(m, nn.MultiheadAttention):
        return None
    E, heads = m.embed_dim, m.num_heads
    j = lambda n: join(prefix, n)  # noqa: E731
    spans = ((0, E), (E, 2 * E), (2 * E, 3 * E))
    if m._qkv_same_embed_dim:
        q, k, v = ([Source(j("in_proj_weight"), rows=s)] for s in spans)
    else:
        q, k, v = ([Source(j(f"{x}_proj_weight"))] for x in "qkv")
    if m.in_proj_bias is not None:
        for factor, s in zip((q, k, v), spans, strict=True):
            factor.append(Source(j("in_proj_bias"), rows=s))
    if m.bias_k is not None:
        k.append(Source(j("bias_k"), view=(E, 1)))
    if m.bias_v is not None:
        v.append(Source(j("bias_v"), view=(E, 1)))
    o = (Source(j("out_proj.weight"), axis=1),)
    label = prefix or type(m).__name__
    return AttentionFinding(label, heads, heads, tuple(q), tuple(k), tuple(v), o)


def separate(names: tuple[str, str, str]) -> Reader:
    """Three ``nn.Linear`` q/k/v projections named ``names``, the output projection by
    :meth:`DiscoveryContext.output`, q/k norms ``q_norm``/``q_layernorm``/``query_norm`` (and
    likewise for k), rotary embeddings and relative position scores from the context."""

    def read(prefix: str, m: nn.Module, ctx: DiscoveryContext) -> AttentionFinding | None:
        lins = [lin for lin in (linear(m, n) for n in names) if lin is not None]
        if len(lins) < len(names):
            return None
        heads, kv = ctx.heads(m)
        q, k, v = (linear_sources(prefix, n, lin) for n, lin in zip(names, lins, strict=True))
        head_dim = lins[1].out_features // kv
        return AttentionFinding(
            prefix or type(m).__name__,
            heads,
            kv,
            q,
            k,
            v,
            ctx.output(prefix, m, heads * head_dim),
            rotary=ctx.rotary_for(m, head_dim),
            q_norm=norm(m, "q_norm", "q_layernorm", "query_norm"),
            k_norm=norm(m, "k_norm", "k_layernorm", "key_norm"),
            qk_blocked=ctx.position_scores(m),
        )

    read.__name__ = read.__qualname__ = "separate_" + "_".join(names)
    return read


def fused_rows(qkv: str, out: str) -> Reader:
    """One ``nn.Linear`` ``qkv`` whose rows are ``[q; k; v]`` (with grouped-query row counts)
    and the output projection ``out``; a norm ``norm`` of the concatenated heads before it
    blocks VO."""

    def read(prefix: str, m: nn.Module, ctx: DiscoveryContext) -> AttentionFinding | None:
        lin = linear(m, qkv)
        if lin is None:
            return None
        heads, kv = ctx.heads(m)
        head_dim = integer(m, "head_dim") or lin.out_features // (heads + 2 * kv)
        if (heads + 2 * kv) * head_dim != lin.out_features:
            raise Unmapped(f"{qkv} has {lin.out_features} rows, not (q, k, v) heads")
        nq, nk = heads * head_dim, kv * head_dim
        spans = ((0, nq), (nq, nq + nk), (nq + nk, nq + 2 * nk))
        q, k, v = (linear_sources(prefix, qkv, lin, rows=s) for s in spans)
        proj = linear(m, out)
        if proj is not None and proj.in_features == nq:
            o = (Source(join(prefix, f"{out}.weight"), axis=1),)
        else:
            o = ctx.output(prefix, m, nq)
        return AttentionFinding(
            prefix or type(m).__name__,
            heads,
            kv,
            q,
            k,
            v,
            o,
            rotary=ctx.rotary_for(m, head_dim),
            q_norm=norm(m, "q_norm"),
            k_norm=norm(m, "k_norm"),
            qk_blocked=ctx.position_scores(m),
            vo_blocked="a norm of the concatenated heads before the output projection"
            if norm(m, "norm")
            else None,
        )

    read.__name__ = read.__qualname__ = f"fused_rows_{qkv}"
    return read


def interleaved(prefix: str, attr: str, lin: nn.Module, units: int, parts: int, d: int):
    """Sources of the first three row blocks of width ``d`` of a ``(units, parts, ·)``
    interleaved ``attr`` (``Source.interleave``)."""
    return tuple(
        linear_sources(prefix, attr, lin, rows=(i * d, (i + 1) * d), interleave=(units, parts))
        for i in range(3)
    )


def neox(prefix: str, m: nn.Module, ctx: DiscoveryContext) -> AttentionFinding | None:
    """GPT-NeoX and BLOOM ``query_key_value``: rows ``[q_i; k_i; v_i]`` per head ``i``."""
    lin = linear(m, "query_key_value")
    if lin is None:
        return None
    heads, kv = ctx.heads(m)
    if kv != heads or lin.out_features % (3 * heads):
        raise Unmapped(f"query_key_value has {lin.out_features} rows, not 3 × {heads} heads")
    d = lin.out_features // 3
    q, k, v = interleaved(prefix, "query_key_value", lin, heads, 3, d)
    label = prefix or type(m).__name__
    rotary = ctx.rotary_for(m, d // heads)
    return AttentionFinding(label, heads, heads, q, k, v, ctx.output(prefix, m, d), rotary=rotary)


def gpt2(prefix: str, m: nn.Module, ctx: DiscoveryContext) -> AttentionFinding | None:
    """GPT-2 ``Conv1D`` ``c_attn`` (columns ``[q | k | v]``, or ``[k | v]`` with a ``q_attn``
    in cross-attention) and ``c_proj``."""
    c_attn, c_proj = conv1d(m, "c_attn"), conv1d(m, "c_proj")
    if c_attn is None or c_proj is None:
        return None
    heads, _ = ctx.heads(m)
    d = c_proj.weight.shape[0]

    # Conv1D weights are (in, out): the head features are columns (axis=1); the bias is
    # a vector of head features (axis=0 rows)
    def conv(attr, lo, hi, layer):
        out = [Source(join(prefix, f"{attr}.weight"), axis=1, cols=(lo, hi))]
        if layer.bias is not None:
            out.append(Source(join(prefix, f"{attr}.bias"), rows=(lo, hi)))
        return tuple(out)

    q_attn = conv1d(m, "q_attn")
    if q_attn is not None:
        q = conv("q_attn", 0, d, q_attn)
        k, v = (conv("c_attn", i * d, (i + 1) * d, c_attn) for i in range(2))
    else:
        q, k, v = (conv("c_attn", i * d, (i + 1) * d, c_attn) for i in range(3))
    o = (Source(join(prefix, "c_proj.weight")),)
    label = prefix or type(m).__name__
    return AttentionFinding(label, heads, heads, q, k, v, o, rotary=ctx.rotary_for(m, d // heads))
