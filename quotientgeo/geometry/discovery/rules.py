"""The declaration rule: from a reader's :class:`AttentionFinding`, the blocks it declares.

- **VO**: one ``GL(h)`` pair per key/value head, ``H`` stacking the output columns of the
  query heads it serves; none (warned) when ``vo_blocked`` or the output is not found;
- **QK**: q/k normalized per head -> a positive scale per query head and per key head
  (:class:`~quotientgeo.ScaleQuotient`); ``qk_blocked`` -> nothing (warned); rotary
  embeddings of known pairing -> the rotary subgroup pair
  (:class:`~quotientgeo.RotaryGLQuotient`), of unknown pairing -> nothing (warned);
  otherwise one ``GL(h)`` pair per key/value head, ``G`` stacking its query heads.

LoRA ``lora_A``/``lora_B`` adapters give a ``GL(r)`` pair ``G = W_B``, ``H = W_Aᵀ``, damped
by :class:`~quotientgeo.FrameDamping` (PEFT initialises ``B = 0``). GL and
rotary blocks carry the metric given to :func:`~quotientgeo.find_symmetries`. A pair whose
factors are all frozen is left out (and counted), one with some frozen factors is warned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from ...manifolds import (
    FrameDamping,
    GLQuotient,
    QuotientManifold,
    RotaryGLQuotient,
    ScaleQuotient,
)
from ..layout import Source
from ..parameters import ParameterGeometry
from .context import DiscoveryContext, join
from .findings import AttentionFinding

__all__ = ["Rules"]

NORMS = ("RMSNorm", "LayerNorm")
#: torch layers whose fused inference path (``torch._transformer_encoder_layer_fwd``) reads
#: ``linear1``/``linear2``/``self_attn`` weights directly, bypassing adapters wrapped around them.
FUSED_LAYERS = (nn.TransformerEncoderLayer,)
ADAPTIVE = "left to the adaptive geometry"


def fused(layer: nn.Module) -> bool:
    """Whether ``layer`` may take a fused inference path that reads its sub-modules' weights
    directly: an ``nn.TransformerEncoderLayer`` with no forward hook (torch leaves the fused
    path whenever one is attached)."""
    hooked = layer._forward_pre_hooks or layer._forward_hooks
    return isinstance(layer, FUSED_LAYERS) and not hooked


def grouped(finding: AttentionFinding, sources) -> tuple[Source, ...]:
    """``sources`` with the query heads of each key/value head stacked into one point."""
    r = finding.heads // finding.kv_heads
    return tuple(dataclasses.replace(s, group=r) for s in sources)


class Rules:
    """Declares the blocks of findings on ``geometry``; collects the warnings (``messages``),
    what was left out and why (``skipped``) and the modules left out because frozen."""

    def __init__(self, geometry: ParameterGeometry, context: DiscoveryContext, metric: str | float):
        self.geometry = geometry
        self.context = context
        self.metric = metric
        self.messages: list[str] = []
        self.skipped: list[str] = []
        self.frozen: list[str] = []  # labels of the attention modules with frozen pairs
        self.fused: list[str] = []  # labels of adapters a fused torch fast path can bypass

    def leave_out(self, label: str, reason: str, what: str = "") -> None:
        """Warn that ``what`` (``""``: the block ``label``) is left out because of ``reason``."""
        message = f"{label}: {reason}; {what}{ADAPTIVE}"
        self.messages.append(message)
        self.skipped.append(message)

    # ------------------------------------------------------------------ one block
    def declare(
        self,
        label: str,
        manifold_of: Callable[[int], QuotientManifold],
        *factors: tuple[Source, ...],
        heads: int,
    ) -> str | None:
        """``add(manifold_of(rows of the first factor), *factors)``; ``"frozen"`` when every
        factor is frozen, else ``None`` (a refused block is warned)."""
        names = [s.param for f in factors for s in f]
        params = self.geometry.layout.all
        missing = [n for n in names if n not in params]
        if missing:
            self.leave_out(label, f"not mapped (the model has no parameter named {missing[0]!r})")
            return None
        trainable = [params[n].requires_grad for n in names]
        if not any(trainable):
            self.skipped.append(f"{label}: its parameters are frozen (requires_grad=False)")
            return "frozen"
        if not all(trainable):
            self.leave_out(label, "some factors are frozen")
            return None
        try:
            n = self.geometry.rows(factors[0], heads=heads, label=label)
            self.geometry.add(manifold_of(n), *factors, heads=heads, label=label)
        except ValueError as err:
            self.leave_out(label, f"not mapped ({err})")
        return None

    def gl(self, n: int) -> GLQuotient:
        return GLQuotient(n, self.metric)

    def lora_gl(self, n: int) -> GLQuotient:
        """A LoRA pair's quotient: damped by :class:`~quotientgeo.FrameDamping` (``BᵀB`` becomes
        ``BᵀB + (ρ/κ)² (AAᵀ)⁻¹``), because PEFT starts every adapter at ``B = 0``, where both
        metrics degenerate; exactly GL(r)-invariant wherever ``A`` has full rank."""
        return GLQuotient(n, self.metric, FrameDamping())

    # ------------------------------------------------------------------ attention
    def declare_attention(self, finding: AttentionFinding) -> None:
        """The QK blocks, then the VO pair, of one finding (module docstring)."""
        label = finding.label
        states = [self.declare_qk(finding)]
        if finding.vo_blocked is not None:
            self.leave_out(label, f"the VO pair is no symmetry because of {finding.vo_blocked}")
        elif finding.o is None:
            self.leave_out(label, "output projection not found", "VO ")
        else:
            o, heads = grouped(finding, finding.o), finding.kv_heads
            states.append(self.declare(f"{label}.VO", self.gl, finding.v, o, heads=heads))
        if "frozen" in states:
            self.frozen.append(label)

    def declare_qk(self, finding: AttentionFinding) -> str | None:
        label, rotary = finding.label, finding.rotary
        q = finding.q if finding.q_stacked else grouped(finding, finding.q)
        heads = finding.kv_heads
        if finding.q_norm is not None or finding.k_norm is not None:
            return self.declare_normed(finding)
        if finding.qk_blocked is not None:
            self.leave_out(label, f"the QK pair is no symmetry because of {finding.qk_blocked}")
            return None
        if rotary is None:
            return self.declare(f"{label}.QK", self.gl, q, finding.k, heads=heads)
        pairing = rotary.pairing or self.context.rotary_pairing
        if pairing is None:
            model_type = getattr(self.context.config, "model_type", None)
            self.leave_out(
                label,
                f"rotary position embeddings ({rotary.found}) with a coordinate pairing not "
                f"known for model_type={model_type!r} (state it with find_symmetries(model, "
                "rotary_pairing=...))",
                "the QK pair is ",
            )
            return None

        def subgroup(n: int) -> RotaryGLQuotient:
            return RotaryGLQuotient(n, self.metric, rotary_dims=rotary.dims, pairing=pairing)

        return self.declare(f"{label}.QK", subgroup, q, finding.k, heads=heads)

    def declare_normed(self, finding: AttentionFinding) -> str | None:
        """Per-head (or whole-projection) positive scales of the normalized q and k."""
        state = None
        for side, sources, heads, norm in (
            ("q", finding.q, finding.heads, finding.q_norm),
            ("k", finding.k, finding.kv_heads, finding.k_norm),
        ):
            if norm is None:
                continue
            label = f"{finding.label}.{side}_scale"
            try:
                h = self.geometry.layout.resolve(sources[0], heads, label).width
            except (KeyError, ValueError):  # frozen, missing or not split: declare() says which
                h = None
            blocks = heads if h is None else self.scale_blocks(label, side, norm, heads, h, finding)
            if blocks is not None:
                scale = lambda n: ScaleQuotient(2)  # noqa: E731
                state = self.declare(label, scale, sources, heads=blocks) or state
        return state

    def scale_blocks(
        self, label: str, side: str, norm: nn.Module, heads: int, h: int, f: AttentionFinding
    ) -> int | None:
        """Scale blocks of a normalized side: ``heads`` (a norm per head), ``1`` (a norm over
        all heads), or ``None`` with a warning."""
        if not any(n in type(norm).__name__ for n in NORMS):
            self.leave_out(
                label,
                f"{side} is normalized by {type(norm).__name__}, not a known RMSNorm/LayerNorm",
            )
            return None
        if side == "q" and f.q_stacked:
            self.leave_out(label, "q is normalized but its heads are read stacked")
            return None
        weight = getattr(norm, "weight", None)
        width = None if weight is None else weight.numel()
        if width in (None, h):
            return heads
        if width == heads * h:
            return 1
        self.leave_out(label, f"the {side} norm's width {width} matches no head layout")
        return None

    # ------------------------------------------------------------------ LoRA
    def declare_lora(self, prefix: str, m: nn.Module) -> bool:
        """LoRA adapters of ``m``: ``lora_A``/``lora_B`` modules (PEFT) or parameters
        (loralib); ``True`` if ``m`` has adapters."""
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
                label = join(prefix, f"{a_attr}{key}").replace(f".{a_attr}", ".lora")
                a_name, b_name = join(prefix, f"{a_attr}{key}"), join(prefix, f"{b_attr}{key}")
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
                self.declare(label, self.lora_gl, tuple(g), tuple(h), heads=1)
                parent = self.context.parent(m)
                if parent is not None and fused(parent[1]):
                    self.fused.append(label)
        return found

    # ------------------------------------------------------------------ summary
    def fused_message(self) -> str | None:
        """One line for the adapters that a fused inference path can bypass (:func:`fused`), or
        ``None``."""
        if not self.fused:
            return None
        return (
            f"{len(self.fused)} LoRA adapter(s) sit in nn.TransformerEncoderLayer modules (first: "
            f"{self.fused[0]}), whose fused fast path (eval mode, no gradients) reads the base "
            "weights directly and ignores the adapters: the losses a measure evaluates would "
            "not see them. Disable the fast path, e.g. with a forward pre-hook on each layer "
            "(layer.register_forward_pre_hook(lambda *a: None))"
        )

    def frozen_message(self) -> str | None:
        """One line for the attention modules left out because frozen, or ``None``."""
        if not self.frozen:
            return None
        n = len(self.frozen)
        return (
            f"{n} attention block{'s' if n > 1 else ''} found but {'their' if n > 1 else 'its'} "
            "parameters are frozen (requires_grad=False): left out of the geometry "
            "(geometry.skipped lists them)"
        )
