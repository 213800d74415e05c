"""Discovery of the symmetry blocks of attention and LoRA layers in a model.

:func:`find_symmetries` walks the modules once and declares a GL(h) pair per head for every
``QK`` and ``VO`` product it recognises (and a GL(r) pair per LoRA adapter) on a
:class:`~quotientgeo.geometry.ParameterGeometry`; anything it cannot map exactly is left to
the adaptive geometry with a warning.
"""

from __future__ import annotations

import warnings

from torch import nn

from .layout import Source
from .parameters import ParameterGeometry

__all__ = ["find_symmetries"]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _linear(module, name: str) -> nn.Linear | None:
    m = getattr(module, name, None)
    return m if isinstance(m, nn.Linear) else None


def _config_value(module, *names):
    for holder in (module, getattr(module, "config", None)):
        if holder is None:
            continue
        for n in names:
            value = getattr(holder, n, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _rotary(model: nn.Module) -> str | None:
    """Name of a rotary position embedding in the model, if any."""
    for name, module in model.named_modules():
        cls = type(module).__name__.lower()
        if "rotary" in cls or "rope" in cls or "rotary" in name.lower():
            return name or cls
    config = getattr(model, "config", None)
    if config is not None:
        if getattr(config, "position_embedding_type", None) in ("rotary", "rope"):
            return "config.position_embedding_type"
        for attr in ("rope_theta", "rotary_dim", "rotary_pct", "rope_scaling"):
            if getattr(config, attr, None) not in (None, 0):
                return f"config.{attr}"
    return None


class _Finder:
    """Walks a model and declares the blocks it recognises on a :class:`ParameterGeometry`."""

    def __init__(self, model: nn.Module, warn: bool):
        self.model = model
        self.geometry = ParameterGeometry(model)
        self.warn = warn
        self.rotary = _rotary(model)
        self.parents = {}
        for name, module in model.named_modules():
            for child_name, child in module.named_children():
                self.parents[id(child)] = (name, module, child_name)

    def warning(self, message: str) -> None:
        if self.warn:
            warnings.warn(message, UserWarning, stacklevel=4)

    def declare(self, label: str, g, h, heads: int) -> None:
        names = [s.param for s in g + h]
        params = self.geometry.layout.all
        trainable = [params[n].requires_grad for n in names]
        if not any(trainable):
            return
        if not all(trainable):
            self.warning(f"{label}: some factors are frozen; left to the adaptive geometry")
            return
        try:
            self.geometry.add_gl_pair(list(g), list(h), heads=heads, label=label)
        except ValueError as err:
            self.warning(f"{label}: not mapped ({err}); left to the adaptive geometry")

    def qk_blocked(self, label: str, module) -> bool:
        """Warn and return True when something sits between the query and key factors."""
        reasons = []
        for attr in ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_norm", "key_norm"):
            if isinstance(getattr(module, attr, None), nn.Module):
                reasons.append(f"a per-head norm ({attr})")
        pos = getattr(module, "position_embedding_type", None)
        if pos is None:
            pos = getattr(getattr(module, "config", None), "position_embedding_type", None)
        if isinstance(pos, str) and pos != "absolute":
            reasons.append(f"position_embedding_type={pos!r}")
        if self.rotary is not None:
            reasons.append(f"rotary position embeddings ({self.rotary})")
        if reasons:
            self.warning(
                f"{label}: the QK pair is not an exact symmetry because of "
                + " and ".join(reasons)
                + "; left to the adaptive geometry (the VO pair is still mapped)"
            )
        return bool(reasons)

    # -------------------------------------------------------------- per pattern
    def mha(self, prefix: str, m: nn.MultiheadAttention) -> None:
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
        o = [Source(j("out_proj.weight"), axis=1)]
        name = prefix or type(m).__name__
        self.declare(f"{name}.QK", q, k, heads)
        self.declare(f"{name}.VO", v, o, heads)

    def linear_sources(self, prefix: str, attr: str, lin: nn.Linear) -> list[Source]:
        out = [Source(_join(prefix, f"{attr}.weight"))]
        if lin.bias is not None:
            out.append(Source(_join(prefix, f"{attr}.bias")))
        return out

    def qkv(self, prefix: str, m, names: tuple[str, str, str]) -> bool:
        """``query/key/value`` (BERT, ViT), ``q_proj/k_proj/v_proj`` (BART, OPT, CLIP, Llama)."""
        lins = [_linear(m, n) for n in names]
        if any(lin is None for lin in lins):
            return False
        heads = _config_value(m, "num_attention_heads", "num_heads", "n_heads", "n_head")
        label = prefix or type(m).__name__
        if heads is None:
            self.warning(f"{label}: attention head count not found; left to the adaptive geometry")
            return True
        kv_heads = _config_value(m, "num_key_value_heads", "num_kv_heads", "n_kv_heads")
        q_lin, k_lin, v_lin = lins
        if kv_heads not in (None, heads) or k_lin.out_features != q_lin.out_features:
            self.warning(
                f"{label}: grouped-query attention ({kv_heads} key/value heads for {heads} "
                "query heads) is not mapped; left to the adaptive geometry"
            )
            return True
        out = self.output_projection(prefix, m, v_lin.out_features)
        sources = [self.linear_sources(prefix, n, lin) for n, lin in zip(names, lins, strict=True)]
        if not self.qk_blocked(label, m):
            self.declare(f"{label}.QK", sources[0], sources[1], heads)
        if out is None:
            self.warning(
                f"{label}: output projection not found; VO pair left to the adaptive geometry"
            )
        else:
            self.declare(f"{label}.VO", sources[2], [Source(out, axis=1)], heads)
        return True

    def output_projection(self, prefix: str, m, width: int) -> str | None:
        """Name of the weight that maps the concatenated heads back (own or parent's)."""
        for attr in ("o_proj", "out_proj", "o", "dense", "out"):
            lin = _linear(m, attr)
            if lin is not None and lin.in_features == width:
                return _join(prefix, f"{attr}.weight")
        parent = self.parents.get(id(m))
        if parent is not None:
            pname, pmod, _ = parent
            out = getattr(pmod, "output", None)
            lin = _linear(out, "dense") if out is not None else None
            if lin is not None and lin.in_features == width:
                return _join(pname, "output.dense.weight")
        return None

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
                self.declare(label, g, h, 1)
        return found

    def run(self) -> ParameterGeometry:
        for prefix, module in self.model.named_modules():
            if isinstance(module, nn.MultiheadAttention):
                self.mha(prefix, module)
            elif self.qkv(prefix, module, ("query", "key", "value")):
                pass
            elif self.qkv(prefix, module, ("q_proj", "k_proj", "v_proj")):
                pass
            elif self.qkv(prefix, module, ("q", "k", "v")):
                pass
            else:
                self.lora(prefix, module)
        return self.geometry


def find_symmetries(model: nn.Module, *, warn: bool = True) -> ParameterGeometry:
    """Discover the symmetry blocks of ``model``.

    Recognised: ``nn.MultiheadAttention`` (hence ``nn.Transformer*Layer``): a QK and a VO GL
    pair per head, in-projection biases (and ``bias_k``/``bias_v``) appended as factor rows;
    attention modules with ``query``/``key``/``value`` and an output ``dense`` (BERT, RoBERTa,
    ViT; the output may sit in the parent's ``output.dense``), ``q_proj``/``k_proj``/``v_proj``
    with ``o_proj``/``out_proj``, and ``q``/``k``/``v``/``o`` (T5); LoRA ``lora_A``/``lora_B``
    adapter pairs (a GL(r) pair ``G = W_B``, ``H = W_Aᵀ``). A QK pair with rotary position
    embeddings, relative position scores or a per-head norm between the factors is not an
    exact symmetry: it is left to the adaptive geometry with a warning, as are grouped-query
    attention and pairs whose factors are partly frozen. Every other trainable parameter is in
    the adaptive geometry.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return _Finder(model, warn).run()
