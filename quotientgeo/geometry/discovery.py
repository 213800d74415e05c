"""Discovery of the symmetry blocks of attention and LoRA layers in a model.

:func:`find_symmetries` walks the modules once. Each attention layout it knows is read into
the same plain description, :class:`Attention` (the query, key, value and output factor
sources, head counts, rotary embedding and q/k norms), and :meth:`_Finder.declare_attention`
turns every description into blocks by one rule:

- **VO**: one ``GL(h)`` pair per key/value head, ``H`` stacking the output columns of the
  query heads it serves;
- **QK**: q/k normalized per head -> a positive scale per query head and per key head
  (:class:`~quotientgeo.ScaleQuotient`); rotary embeddings -> the rotary subgroup pair
  (:class:`~quotientgeo.RotaryGLQuotient`); position scores that read q or k alone -> nothing;
  otherwise one ``GL(h)`` pair per key/value head, ``G`` stacking its query heads.

Whatever cannot be mapped exactly is left to the adaptive geometry with one warning that
names the module and the reason; attention-like modules that no reader recognises are
reported too.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..manifolds import GLQuotient, RotaryGLQuotient, ScaleQuotient
from .layout import Source
from .parameters import ParameterGeometry

__all__ = ["ROTARY_PAIRING", "find_symmetries"]

# Rotary pair layout by Hugging Face ``model_type``; each is checked by moving a tiny random
# model of that family along its group (tests/test_families.py). Others are refused.
ROTARY_PAIRING = {
    "llama": "half",
    "mistral": "half",
    "qwen2": "half",
    "qwen3": "half",
    "gemma2": "half",
    "gemma3_text": "half",
    "phi3": "half",
    "gpt_neox": "half",
    "gptj": "interleaved",
}

NORMS = ("RMSNorm", "LayerNorm")
ATTENTION_LIKE = re.compile(r"attention|attn", re.IGNORECASE)


class _Unmapped(Exception):
    """A recognised attention module that cannot be mapped (the message says why)."""


@dataclass(frozen=True)
class Rotary:
    """Rotary embeddings found in a model (``found`` names the evidence) and their coordinate
    ``pairing`` (``"half"`` or ``"interleaved"``; ``None`` where the family is not known)."""

    found: str
    pairing: str | None = None


@dataclass(frozen=True)
class Attention:
    """One attention module as factor sources of ``heads`` query and ``kv_heads`` key/value
    heads of width ``head_dim``. ``q``, ``k``, ``v`` are in ``nn.Linear`` convention per own
    head (``axis=0``: output features) and ``o`` the output projection's head columns; grouping
    of query heads is applied when blocks are declared. ``q_norm`` / ``k_norm`` are the
    modules normalizing q / k (``None``: none); ``blocked`` / ``vo_blocked`` a reason the QK /
    VO pair is no symmetry at all."""

    label: str
    heads: int
    kv_heads: int
    q: tuple[Source, ...]
    k: tuple[Source, ...]
    v: tuple[Source, ...]
    o: tuple[Source, ...] | None
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    blocked: str | None = None
    vo_blocked: str | None = None


def _gl(n: int) -> GLQuotient:
    return GLQuotient(n, "mix")


def _grouped(att: Attention, sources) -> list[Source]:
    """``sources`` with the query heads of each key/value head stacked into one point."""
    return [dataclasses.replace(s, group=att.heads // att.kv_heads) for s in sources]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _linear(module, name: str) -> nn.Linear | None:
    m = getattr(module, name, None)
    return m if isinstance(m, nn.Linear) else None


class _Conv1D(Protocol):
    """What discovery reads of a Hugging Face ``Conv1D`` (not imported: an optional package)."""

    weight: torch.Tensor
    bias: torch.Tensor | None


def _conv1d(module, name: str) -> _Conv1D | None:
    """A Hugging Face ``Conv1D`` (``y = x W + b``, ``W`` of shape ``(in, out)``)."""
    m = getattr(module, name, None)
    ok = type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None
    return m if ok and m is not None and m.weight.dim() == 2 else None


def _int(holder, *names) -> int | None:
    for n in names:
        value = getattr(holder, n, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _norm(module, *names) -> nn.Module | None:
    for name in names:
        m = getattr(module, name, None)
        if isinstance(m, nn.Module) and not isinstance(m, nn.Identity):
            return m
    return None


def _linear_sources(prefix: str, attr: str, lin: nn.Module, **where) -> list[Source]:
    out = [Source(_join(prefix, f"{attr}.weight"), **where)]
    if getattr(lin, "bias", None) is not None:
        out.append(Source(_join(prefix, f"{attr}.bias"), **where))
    return out


def _rotary(model: nn.Module, config) -> Rotary | None:
    """The model's rotary embeddings, if any, with their pairing where the family is known."""
    found = None
    for name, module in model.named_modules():
        cls = type(module).__name__.lower()
        if "rotary" in cls or "rope" in cls or "rotary" in name.lower():
            found = name or cls
            break
    if config is not None and found is None:
        if getattr(config, "position_embedding_type", None) in ("rotary", "rope"):
            found = "config.position_embedding_type"
        for attr in ("rope_parameters", "rope_theta", "rotary_dim", "rotary_pct", "rope_scaling"):
            if getattr(config, attr, None) not in (None, 0):
                found = f"config.{attr}"
                break
    if found is None:
        return None
    return Rotary(found, ROTARY_PAIRING.get(getattr(config, "model_type", None) or ""))


class _Finder:
    """Walks a model and declares the blocks it recognises on a :class:`ParameterGeometry`."""

    def __init__(self, model: nn.Module, warn: bool):
        self.model = model
        self.geometry = ParameterGeometry(model)
        self.warn = warn
        # the model's (first) Hugging Face-style config: model_type, rotary layout, head counts
        self.config = next(
            (c for _, mod in model.named_modules() if (c := getattr(mod, "config", None))), None
        )
        self.rotary = _rotary(model, self.config)
        self.parents = {}
        for name, module in model.named_modules():
            for child_name, child in module.named_children():
                self.parents[id(child)] = (name, module, child_name)
        self.readers = (
            self.mha,
            self.separate(("query", "key", "value")),
            self.separate(("q_proj", "k_proj", "v_proj")),
            self.separate(("q_lin", "k_lin", "v_lin")),
            self.separate(("q", "k", "v")),
            self.fused_rows("qkv", "proj"),
            self.fused_rows("qkv_proj", "o_proj"),
            self.neox,
            self.gpt2,
        )

    def warning(self, message: str) -> None:
        if self.warn:
            warnings.warn(message, UserWarning, stacklevel=4)

    # ------------------------------------------------------------------ declaration
    def declare(self, label: str, manifold_of, *factors, heads: int) -> None:
        """``add(manifold_of(rows of the first factor), *factors)``, or a warning."""
        names = [s.param for f in factors for s in f]
        params = self.geometry.layout.all
        trainable = [params[n].requires_grad for n in names]
        if not any(trainable):
            return
        if not all(trainable):
            self.warning(f"{label}: some factors are frozen; left to the adaptive geometry")
            return
        try:
            n = self.geometry.rows(factors[0], heads=heads, label=label)
            self.geometry.add(manifold_of(n), *factors, heads=heads, label=label)
        except ValueError as err:
            self.warning(f"{label}: not mapped ({err}); left to the adaptive geometry")

    def declare_attention(self, att: Attention, module: nn.Module) -> None:
        """Blocks of one attention module (module docstring): QK, then VO."""
        label = att.label
        self.declare_qk(att, module)
        if att.vo_blocked is not None:
            self.warning(
                f"{label}: the VO pair is no symmetry because of {att.vo_blocked}; "
                "left to the adaptive geometry"
            )
        elif att.o is None:
            self.warning(f"{label}: output projection not found; VO left to the adaptive geometry")
        else:
            self.declare(f"{label}.VO", _gl, att.v, _grouped(att, att.o), heads=att.kv_heads)

    def declare_qk(self, att: Attention, module: nn.Module) -> None:
        label = att.label
        if att.q_norm is not None or att.k_norm is not None:
            self.declare_normed(att)
        elif att.blocked is not None:
            self.warning(
                f"{label}: the QK pair is no symmetry because of {att.blocked}; "
                "left to the adaptive geometry"
            )
        elif self.rotary is not None:
            rotary = self.rotary
            if rotary.pairing is None:
                model_type = getattr(self.config, "model_type", None)
                self.warning(
                    f"{label}: rotary position embeddings ({rotary.found}) with a coordinate "
                    f"pairing not known for model_type={model_type!r}; the QK pair is left to "
                    "the adaptive geometry"
                )
                return
            dims, pairing = self.rotary_dims(att, module), rotary.pairing

            def subgroup(n):
                return RotaryGLQuotient(n, "mix", rotary_dims=dims, pairing=pairing)

            self.declare(f"{label}.QK", subgroup, _grouped(att, att.q), att.k, heads=att.kv_heads)
        else:
            self.declare(f"{label}.QK", _gl, _grouped(att, att.q), att.k, heads=att.kv_heads)

    def rotary_dims(self, att: Attention, module: nn.Module) -> int | None:
        """Rotated coordinates per head from the module or its config (``None``: all):
        ``rotary_ndims``/``rotary_dim``, else ``head_dim ×`` the partial rotary factor
        (``partial_rotary_factor``, also inside ``rope_parameters``, or ``rotary_pct``)."""
        head_dim = self.head_dim(att)
        dims = _int(module, "rotary_ndims", "rotary_dim")
        config = getattr(module, "config", None) or self.config
        if dims is None and config is not None:
            dims = _int(config, "rotary_dim")
            params = getattr(config, "rope_parameters", None)
            factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
            for attr in ("partial_rotary_factor", "rotary_pct"):
                if factor is None:
                    factor = getattr(config, attr, None)
            if dims is None and factor is not None:
                dims = int(head_dim * factor)
        return None if dims is None or dims >= head_dim else dims

    def head_dim(self, att: Attention) -> int:
        return self.geometry.layout.resolve(att.k[0], att.kv_heads, att.label).width

    def declare_normed(self, att: Attention) -> None:
        """Per-head (or whole-projection) positive scales of the normalized q and k."""
        for side, sources, heads, norm in (
            ("q", att.q, att.heads, att.q_norm),
            ("k", att.k, att.kv_heads, att.k_norm),
        ):
            if norm is None:
                continue
            label = f"{att.label}.{side}_scale"
            if not any(n in type(norm).__name__ for n in NORMS):
                self.warning(
                    f"{label}: {side} is normalized by {type(norm).__name__}, not a known "
                    "RMSNorm/LayerNorm; left to the adaptive geometry"
                )
                continue
            width = getattr(norm, "weight", None)
            width = None if width is None else width.numel()
            head_dim = self.head_dim(att)
            if width in (None, head_dim):
                blocks = heads
            elif width == heads * head_dim:
                blocks = 1
            else:
                self.warning(f"{label}: the {side} norm's width {width} matches no head layout")
                continue
            self.declare(label, lambda n: ScaleQuotient(2), sources, heads=blocks)

    # ------------------------------------------------------------------ readers
    def heads_of(self, m, label: str) -> tuple[int, int]:
        holders = (m, getattr(m, "config", None), self.config)
        heads = kv = None
        for holder in holders:
            if holder is not None and heads is None:
                heads = _int(holder, "num_heads", "num_attention_heads", "n_heads", "n_head")
        if heads is None:
            raise _Unmapped("attention head count not found")
        for holder in holders:
            if holder is not None and kv is None:
                kv = _int(holder, "num_key_value_heads", "num_kv_heads", "n_kv_heads")
        kv = heads if kv is None else kv
        if kv < 1 or heads % kv:
            raise _Unmapped(f"{heads} query heads do not split into {kv} key/value groups")
        return heads, kv

    def output(self, prefix: str, m, width: int) -> tuple[Source, ...] | None:
        """The output projection's head columns (own attribute or the parent's output.dense)."""
        for attr in ("o_proj", "out_proj", "o", "dense", "out", "out_lin", "proj"):
            lin = _linear(m, attr)
            if lin is not None and lin.in_features == width:
                return (Source(_join(prefix, f"{attr}.weight"), axis=1),)
        parent = self.parents.get(id(m))
        if parent is not None:
            pname, pmod, _ = parent
            out = getattr(pmod, "output", None)
            lin = _linear(out, "dense") if out is not None else None
            if lin is not None and lin.in_features == width:
                return (Source(_join(pname, "output.dense.weight"), axis=1),)
        return None

    def blocked(self, m) -> str | None:
        pos = getattr(m, "position_embedding_type", None)
        if pos is None:
            pos = getattr(getattr(m, "config", None), "position_embedding_type", None)
        if isinstance(pos, str) and pos != "absolute" and pos not in ("rotary", "rope"):
            return f"position_embedding_type={pos!r}"
        return None

    def mha(self, prefix: str, m) -> Attention | None:
        if not isinstance(m, nn.MultiheadAttention):
            return None
        E, heads = m.embed_dim, m.num_heads
        j = lambda n: _join(prefix, n)  # noqa: E731
        if m._qkv_same_embed_dim:
            q = [Source(j("in_proj_weight"), rows=(0, E))]
            k = [Source(j("in_proj_weight"), rows=(E, 2 * E))]
            v = [Source(j("in_proj_weight"), rows=(2 * E, 3 * E))]
        else:
            q, k, v = ([Source(j(f"{x}_proj_weight"))] for x in "qkv")
        if m.in_proj_bias is not None:
            q.append(Source(j("in_proj_bias"), rows=(0, E)))
            k.append(Source(j("in_proj_bias"), rows=(E, 2 * E)))
            v.append(Source(j("in_proj_bias"), rows=(2 * E, 3 * E)))
        # bias_k / bias_v are an extra key / value token: one more row of H / G
        if m.bias_k is not None:
            k.append(Source(j("bias_k"), view=(E, 1)))
        if m.bias_v is not None:
            v.append(Source(j("bias_v"), view=(E, 1)))
        o = (Source(j("out_proj.weight"), axis=1),)
        return Attention(prefix or type(m).__name__, heads, heads, tuple(q), tuple(k), tuple(v), o)

    def separate(self, names: tuple[str, str, str]):
        """``query/key/value`` (BERT, ViT), ``q_proj/k_proj/v_proj`` (Llama, BART, OPT, CLIP,
        GPT-J), ``q_lin/k_lin/v_lin`` (DistilBERT), ``q/k/v`` (T5)."""

        def read(prefix: str, m) -> Attention | None:
            lins = [lin for lin in (_linear(m, n) for n in names) if lin is not None]
            if len(lins) < len(names):
                return None
            label = prefix or type(m).__name__
            heads, kv = self.heads_of(m, label)
            q, k, v = (
                tuple(_linear_sources(prefix, n, lin)) for n, lin in zip(names, lins, strict=True)
            )
            return Attention(
                label,
                heads,
                kv,
                q,
                k,
                v,
                self.output(prefix, m, lins[2].out_features * heads // kv),
                q_norm=_norm(m, "q_norm", "q_layernorm", "query_norm"),
                k_norm=_norm(m, "k_norm", "k_layernorm", "key_norm"),
                blocked=self.blocked(m),
            )

        return read

    def fused_rows(self, qkv: str, out: str):
        """One ``nn.Linear`` whose rows are ``[q; k; v]`` (timm ``qkv``, Phi-3 ``qkv_proj``)."""

        def read(prefix: str, m) -> Attention | None:
            lin = _linear(m, qkv)
            if lin is None:
                return None
            label = prefix or type(m).__name__
            heads, kv = self.heads_of(m, label)
            head_dim = _int(m, "head_dim") or lin.out_features // (heads + 2 * kv)
            if (heads + 2 * kv) * head_dim != lin.out_features:
                raise _Unmapped(f"{qkv} has {lin.out_features} rows, not (q, k, v) heads")
            q, k = heads * head_dim, kv * head_dim
            spans = ((0, q), (q, q + k), (q + k, q + 2 * k))
            q, k, v = (tuple(_linear_sources(prefix, qkv, lin, rows=s)) for s in spans)
            return Attention(
                label,
                heads,
                kv,
                q,
                k,
                v,
                self.output(prefix, m, heads * head_dim),
                q_norm=_norm(m, "q_norm"),
                k_norm=_norm(m, "k_norm"),
                vo_blocked="a norm of the concatenated heads before the output projection"
                if _norm(m, "norm")
                else None,
            )

        return read

    def neox(self, prefix: str, m) -> Attention | None:
        """GPT-NeoX ``query_key_value``: rows ``[q_i; k_i; v_i]`` per head ``i``."""
        lin = _linear(m, "query_key_value")
        if lin is None:
            return None
        label = prefix or type(m).__name__
        heads, kv = self.heads_of(m, label)
        if kv != heads or lin.out_features % (3 * heads):
            raise _Unmapped(f"query_key_value has {lin.out_features} rows, not 3 × {heads} heads")
        d = lin.out_features // 3
        spans = ((0, d), (d, 2 * d), (2 * d, 3 * d))
        q, k, v = (
            tuple(_linear_sources(prefix, "query_key_value", lin, rows=s, interleave=(heads, 3)))
            for s in spans
        )
        return Attention(label, heads, heads, q, k, v, self.output(prefix, m, d))

    def gpt2(self, prefix: str, m) -> Attention | None:
        """GPT-2 ``Conv1D`` ``c_attn`` (columns ``[q | k | v]``, or ``[k | v]`` with a
        ``q_attn`` in cross-attention) and ``c_proj``."""
        c_attn, c_proj = _conv1d(m, "c_attn"), _conv1d(m, "c_proj")
        if c_attn is None or c_proj is None:
            return None
        label = prefix or type(m).__name__
        heads, _ = self.heads_of(m, label)
        d = c_proj.weight.shape[0]

        # Conv1D weights are (in, out): the head features are columns (axis=1); the bias is
        # a vector of head features (axis=0 rows)
        def conv(attr, lo, hi, layer):
            out = [Source(_join(prefix, f"{attr}.weight"), axis=1, cols=(lo, hi))]
            if layer.bias is not None:
                out.append(Source(_join(prefix, f"{attr}.bias"), rows=(lo, hi)))
            return tuple(out)

        q_attn = _conv1d(m, "q_attn")
        if q_attn is not None:
            q = conv("q_attn", 0, d, q_attn)
            k, v = (conv("c_attn", i * d, (i + 1) * d, c_attn) for i in range(2))
        else:
            q, k, v = (conv("c_attn", i * d, (i + 1) * d, c_attn) for i in range(3))
        o = (Source(_join(prefix, "c_proj.weight")),)
        return Attention(label, heads, heads, q, k, v, o)

    def lora(self, prefix: str, m) -> bool:
        """LoRA adapters: ``lora_A``/``lora_B`` modules (PEFT) or parameters (loralib)."""
        found = False
        for a_attr, b_attr in (("lora_A", "lora_B"), ("lora_embedding_A", "lora_embedding_B")):
            A, B = getattr(m, a_attr, None), getattr(m, b_attr, None)
            if A is None or B is None:
                continue
            found = True
            if isinstance(A, nn.Parameter) and isinstance(B, nn.Parameter):
                pairs = [("", A, B)]
            elif isinstance(A, (nn.ModuleDict, nn.ParameterDict)) and type(A) is type(B):
                pairs = [(f".{key}", A[key], B[key]) for key in A if key in B]
            else:
                continue
            for key, a, b in pairs:
                label = _join(prefix, f"{a_attr}{key}").replace(f".{a_attr}", ".lora")
                a_name, b_name = _join(prefix, f"{a_attr}{key}"), _join(prefix, f"{b_attr}{key}")
                if isinstance(a, nn.Linear) and isinstance(b, nn.Linear):
                    h = [Source(f"{a_name}.weight")]
                    if a.bias is not None:
                        h.append(Source(f"{a_name}.bias"))
                    g = [Source(f"{b_name}.weight", axis=1)]
                elif isinstance(a, nn.Parameter) and a.dim() == 2 and b.dim() == 2:
                    # B A with A (r, in), B (out, r): G = B, H = Aᵀ
                    h, g = [Source(a_name)], [Source(b_name, axis=1)]
                else:
                    continue
                self.declare(label, _gl, g, h, heads=1)
        return found

    # ------------------------------------------------------------------ walk
    def run(self) -> ParameterGeometry:
        self.named = dict(self.model.named_modules())
        recognised = []
        for prefix, module in self.named.items():
            try:
                att = next((a for read in self.readers if (a := read(prefix, module))), None)
            except _Unmapped as err:
                label = prefix or type(module).__name__
                self.warning(f"{label}: {err}; left to the adaptive geometry")
                recognised.append(prefix)
                continue
            if att is not None:
                self.declare_attention(att, module)
                recognised.append(prefix)
            elif self.lora(prefix, module):
                recognised.append(prefix)
        self.report_unrecognised(recognised)
        return self.geometry

    def report_unrecognised(self, recognised: list[str]) -> None:
        """One warning per attention-like module with trainable parameters that no reader
        recognised and that neither contains nor sits inside a recognised one."""

        def related(name: str) -> bool:
            return any(
                name == r
                or r == ""
                or name == ""
                or name.startswith(r + ".")
                or r.startswith(name + ".")
                for r in recognised
            )

        reported: list[str] = []
        for name, module in self.named.items():
            if not ATTENTION_LIKE.search(type(module).__name__) or related(name):
                continue
            if any(name.startswith(r + ".") for r in reported):
                continue
            if not any(p.requires_grad for p in module.parameters()):
                continue
            reported.append(name)
            self.warning(
                f"{name or type(module).__name__} ({type(module).__name__}): attention-like "
                "module with no known layout; its parameters stay in the adaptive geometry"
            )


def find_symmetries(model: nn.Module, *, warn: bool = True) -> ParameterGeometry:
    """Discover the symmetry blocks of ``model``.

    Recognised attention layouts: ``nn.MultiheadAttention`` (hence ``nn.Transformer*Layer``,
    in-projection biases and ``bias_k``/``bias_v`` as factor rows); separate projections
    ``query``/``key``/``value`` (BERT, RoBERTa, ViT; output ``dense`` or the parent's
    ``output.dense``), ``q_proj``/``k_proj``/``v_proj`` with ``o_proj``/``out_proj`` (Llama,
    Mistral, Qwen2/3, Gemma 2/3, OPT, BART and Whisper self- and cross-attention, CLIP,
    GPT-J), ``q_lin``/``k_lin``/``v_lin``/``out_lin`` (DistilBERT), ``q``/``k``/``v``/``o``
    (T5); fused rows ``[q; k; v]`` (timm ``qkv``/``proj``, Phi-3 ``qkv_proj``/``o_proj``);
    GPT-NeoX's per-head interleaved ``query_key_value``; GPT-2's ``Conv1D`` ``c_attn``/
    ``c_proj``. Grouped-query and multi-query attention give one pair per key/value head;
    rotary embeddings give the rotary subgroup (pairing and rotary fraction from the config,
    for the families in ``ROTARY_PAIRING``); per-head q/k norms give positive scales. LoRA
    ``lora_A``/``lora_B`` adapters give a GL(r) pair ``G = W_B``, ``H = W_Aᵀ``. See the module
    docstring for the rule; every other trainable parameter is in the adaptive geometry.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return _Finder(model, warn).run()
