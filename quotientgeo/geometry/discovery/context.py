"""What readers may read besides their module: :class:`DiscoveryContext` and small helpers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from ..layout import Source
from .findings import ROTARY_PAIRING, AttentionFinding, Rotary, Unmapped

__all__ = ["DiscoveryContext", "Reader"]

Reader = Callable[[str, nn.Module, "DiscoveryContext"], "AttentionFinding | None"]
"""``reader(name, module, context)``: an :class:`AttentionFinding` for a module it recognises,
``None`` otherwise; raises :class:`Unmapped` for one it recognises but cannot map."""


def join(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` for the root module (``prefix == ""``)."""
    return f"{prefix}.{name}" if prefix else name


def linear(module, name: str) -> nn.Linear | None:
    m = getattr(module, name, None)
    return m if isinstance(m, nn.Linear) else None


class Conv1D(Protocol):
    """What discovery reads of a Hugging Face ``Conv1D`` (not imported: an optional package)."""

    weight: torch.Tensor
    bias: torch.Tensor | None


def conv1d(module, name: str) -> Conv1D | None:
    """A Hugging Face ``Conv1D`` (``y = x W + b``, ``W`` of shape ``(in, out)``)."""
    m = getattr(module, name, None)
    ok = type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None
    return m if ok and m is not None and m.weight.dim() == 2 else None


def integer(holder, *names) -> int | None:
    for n in names:
        value = getattr(holder, n, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def norm(module, *names) -> nn.Module | None:
    for name in names:
        m = getattr(module, name, None)
        if isinstance(m, nn.Module) and not isinstance(m, nn.Identity):
            return m
    return None


def linear_sources(prefix: str, attr: str, lin: nn.Module, **where) -> tuple[Source, ...]:
    """The weight (and bias, if any) of linear layer ``prefix.attr`` as sources ``where``."""
    out = [Source(join(prefix, f"{attr}.weight"), **where)]
    if getattr(lin, "bias", None) is not None:
        out.append(Source(join(prefix, f"{attr}.bias"), **where))
    return tuple(out)


def find_rotary(model: nn.Module, config) -> str | None:
    """Evidence of rotary embeddings anywhere in the model: a module named like one, else a
    rotary setting of the config."""
    for name, module in model.named_modules():
        cls = type(module).__name__.lower()
        if "rotary" in cls or "rope" in cls or "rotary" in name.lower():
            return name or cls
    if config is not None:
        if getattr(config, "position_embedding_type", None) in ("rotary", "rope"):
            return "config.position_embedding_type"
        for attr in ("rope_parameters", "rope_theta", "rotary_dim", "rotary_pct", "rope_scaling"):
            if getattr(config, attr, None) not in (None, 0):
                return f"config.{attr}"
    return None


class DiscoveryContext:
    """What a reader may read besides its module, built once per :func:`find_symmetries` call.

    Attributes:
        model: the model walked.
        config: its first Hugging Face-style ``config`` (``model_type``, head counts, rotary
            settings), or ``None``.
        rotary: rotary embeddings found in the model (a module named like one or a rotary
            config setting) with their pairing (``rotary_pairing=`` of :func:`find_symmetries`,
            else ``ROTARY_PAIRING`` of the ``model_type``), or ``None``.
        rotary_pairing: the pairing stated to :func:`find_symmetries` (``None``: none).
    """

    def __init__(self, model: nn.Module, rotary_pairing: str | None = None):
        self.model = model
        self.config = next(
            (c for _, mod in model.named_modules() if (c := getattr(mod, "config", None))), None
        )
        self.rotary_pairing = rotary_pairing
        found = find_rotary(model, self.config)
        model_type = getattr(self.config, "model_type", None) or ""
        pairing = rotary_pairing or ROTARY_PAIRING.get(model_type)
        self.rotary: Rotary | None = None if found is None else Rotary(found, pairing)
        self._parents: dict[int, tuple[str, nn.Module]] = {}
        for name, module in model.named_modules():
            for child in module.children():
                self._parents[id(child)] = (name, module)

    def parent(self, module: nn.Module) -> tuple[str, nn.Module] | None:
        """``(name, parent)`` of ``module`` in the model (``None`` for the model itself)."""
        return self._parents.get(id(module))

    def heads(self, module: nn.Module) -> tuple[int, int]:
        """``(heads, kv_heads)`` from the module, its ``config`` or the model's config
        (``num_heads``/``num_attention_heads``/``n_heads``/``n_head``, and
        ``num_key_value_heads``/``num_kv_heads``/``n_kv_heads``, default ``heads``); raises
        :class:`Unmapped` if not found."""
        holders = [
            h for h in (module, getattr(module, "config", None), self.config) if h is not None
        ]
        counts = [
            integer(h, "num_heads", "num_attention_heads", "n_heads", "n_head") for h in holders
        ]
        heads = next((c for c in counts if c is not None), None)
        if heads is None:
            raise Unmapped("attention head count not found")
        counts = [integer(h, "num_key_value_heads", "num_kv_heads", "n_kv_heads") for h in holders]
        kv = next((c for c in counts if c is not None), heads)
        if kv < 1 or heads % kv:
            raise Unmapped(f"{heads} query heads do not split into {kv} key/value groups")
        return heads, kv

    def output(self, prefix: str, module: nn.Module, width: int) -> tuple[Source, ...] | None:
        """The output projection's head columns: an own ``nn.Linear`` with ``width`` inputs
        (``o_proj``, ``out_proj``, ``o``, ``dense``, ``out``, ``out_lin``, ``proj``, ``Wo``),
        else the parent's ``output.dense`` (BERT); ``None`` if none."""
        for attr in ("o_proj", "out_proj", "o", "dense", "out", "out_lin", "proj", "Wo"):
            lin = linear(module, attr)
            if lin is not None and lin.in_features == width:
                return (Source(join(prefix, f"{attr}.weight"), axis=1),)
        parent = self.parent(module)
        if parent is not None:
            pname, pmod = parent
            out = getattr(pmod, "output", None)
            lin = linear(out, "dense") if out is not None else None
            if lin is not None and lin.in_features == width:
                return (Source(join(pname, "output.dense.weight"), axis=1),)
        return None

    def rotary_for(self, module: nn.Module, head_dim: int) -> Rotary | None:
        """:attr:`rotary` with the rotated coordinates per head of ``module``:
        ``rotary_ndims``/``rotary_dim`` of the module, else of its config, else ``head_dim ×``
        the partial rotary factor (``partial_rotary_factor``, also inside ``rope_parameters``,
        or ``rotary_pct``); ``dims=None`` when all are rotated."""
        if self.rotary is None:
            return None
        dims = integer(module, "rotary_ndims", "rotary_dim")
        config = getattr(module, "config", None) or self.config
        if dims is None and config is not None:
            dims = integer(config, "rotary_dim")
            params = getattr(config, "rope_parameters", None)
            factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
            for attr in ("partial_rotary_factor", "rotary_pct"):
                if factor is None:
                    factor = getattr(config, attr, None)
            if dims is None and factor is not None:
                dims = int(head_dim * factor)
        dims = None if dims is None or dims >= head_dim else dims
        return Rotary(self.rotary.found, self.rotary.pairing, dims)

    def position_scores(self, module: nn.Module) -> str | None:
        """``position_embedding_type`` of the module or its config when it adds scores read
        from q or k alone (anything but absolute or rotary), else ``None``."""
        pos = getattr(module, "position_embedding_type", None)
        if pos is None:
            pos = getattr(getattr(module, "config", None), "position_embedding_type", None)
        if isinstance(pos, str) and pos not in ("absolute", "rotary", "rope"):
            return f"position_embedding_type={pos!r}"
        return None
