"""Discovery's public switches: readers registered for new attention layouts (undoable), the
rotary pairing stated by the caller, the metric declared, and attention blocks left out
because frozen (one warning, listed in ``geometry.skipped``).

Every claimed group is checked by moving the model along it: the output must not change.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from quotientgeo import RotaryGLQuotient, Source, find_symmetries
from quotientgeo.geometry import AttentionFinding, Unmapped, register_reader
from quotientgeo.geometry.discovery import registered_readers
from quotientgeo.testing import moved_along_orbits

DT = torch.float64


def attend(q, k, v, kv_heads: int, heads: int) -> torch.Tensor:
    """Softmax attention of ``(B, heads, T, h)`` queries on grouped keys/values."""
    r = heads // kv_heads
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v


class ToQKVAttention(nn.Module):
    """An attention layout no built-in reader knows: ``to_q``/``to_k``/``to_v``/``to_out``,
    with ``kv`` key/value heads shared by groups of query heads."""

    def __init__(self, d=16, heads=4, kv=2):
        super().__init__()
        self.heads, self.kv, self.h = heads, kv, d // heads
        self.to_q = nn.Linear(d, d)
        self.to_k, self.to_v = nn.Linear(d, kv * self.h), nn.Linear(d, kv * self.h)
        self.to_out = nn.Linear(d, d)

    def forward(self, x):
        B, T, _ = x.shape
        split = lambda t, n: t.view(B, T, n, self.h).transpose(1, 2)  # noqa: E731
        q = split(self.to_q(x), self.heads)
        k, v = split(self.to_k(x), self.kv), split(self.to_v(x), self.kv)
        return self.to_out(attend(q, k, v, self.kv, self.heads).transpose(1, 2).flatten(2))


def read_to_qkv(name, module, context):
    if not isinstance(module, ToQKVAttention):
        return None

    def linear(attr):
        return (Source(f"{name}.{attr}.weight"), Source(f"{name}.{attr}.bias"))

    return AttentionFinding(
        label=name,
        heads=module.heads,
        kv_heads=module.kv,
        q=linear("to_q"),
        k=linear("to_k"),
        v=linear("to_v"),
        o=(Source(f"{name}.to_out.weight", axis=1),),
    )


def rotate(x: torch.Tensor, pairing: str) -> torch.Tensor:
    """Rotary embedding of ``(B, H, T, h)`` at positions ``0..T-1``, coordinates paired as
    ``pairing`` says."""
    T, h = x.shape[-2], x.shape[-1]
    freqs = 1.0 / 100.0 ** (torch.arange(h // 2, dtype=x.dtype) / (h // 2))
    angles = torch.arange(T, dtype=x.dtype)[:, None] * freqs
    cos, sin = angles.cos(), angles.sin()
    if pairing == "half":
        a, b = x[..., : h // 2], x[..., h // 2 :]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)


class RotaryEmbedding(nn.Module):
    def __init__(self, pairing):
        super().__init__()
        self.pairing = pairing

    def forward(self, q, k):
        return rotate(q, self.pairing), rotate(k, self.pairing)


class RotaryAttention(nn.Module):
    """``q_proj``/``k_proj``/``v_proj``/``o_proj`` with rotary embeddings, no config: the
    pairing cannot be read from a ``model_type``."""

    def __init__(self, d=16, heads=2, pairing="half"):
        super().__init__()
        self.num_heads, self.h = heads, d // heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d) for _ in "qkv")
        self.o_proj = nn.Linear(d, d, bias=False)
        self.rotary_emb = RotaryEmbedding(pairing)

    def forward(self, x):
        B, T, _ = x.shape
        split = lambda t: t.view(B, T, self.num_heads, self.h).transpose(1, 2)  # noqa: E731
        q, k = self.rotary_emb(split(self.q_proj(x)), split(self.k_proj(x)))
        out = attend(q, k, split(self.v_proj(x)), self.num_heads, self.num_heads)
        return self.o_proj(out.transpose(1, 2).flatten(2))


def two_layers(layer, **kw) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(layer(**kw), nn.Tanh(), layer(**kw)).to(DT)


def caught_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught]


# ---------------------------------------------------------------------- registered readers
def test_registered_reader_maps_a_new_layout_exactly_and_is_undone():
    model = two_layers(ToQKVAttention)
    x = torch.randn(2, 5, 16, dtype=DT)
    geometry, messages = caught_warnings(lambda: find_symmetries(model))
    assert not geometry.blocks
    assert messages[0].startswith("0 (ToQKVAttention): attention-like module with no known")
    assert geometry.skipped == tuple(messages)

    with register_reader(read_to_qkv) as handle:
        assert registered_readers()[-1] is read_to_qkv
        geometry, messages = caught_warnings(lambda: find_symmetries(model))
        assert not messages
        assert [b.label for b in geometry.blocks] == ["0.QK", "0.VO", "2.QK", "2.VO"]
        # 2 key/value heads, each stacking the rows of its 2 query heads: (2·17 + 17, 4)
        assert {k.shape for k in geometry.kinds} == {(2 * 17 + 17, 4), (17 + 2 * 16, 4)}
        assert geometry.skipped == ()
        moved = moved_along_orbits(model, scale=3.0, seed=1)
        torch.testing.assert_close(moved(x), model(x), rtol=1e-9, atol=1e-9)
        assert not torch.allclose(moved[0].to_q.weight, model[0].to_q.weight)
    assert read_to_qkv not in registered_readers()
    assert "removed" in repr(handle)
    handle.remove()  # a second removal does nothing
    assert not find_symmetries(model, warn=False).blocks


def test_reader_registered_first_is_tried_before_the_built_in_ones():
    """A reader with ``first=True`` reads a layout a built-in reader also recognises."""

    def no_qk(name, module, context):
        if not isinstance(module, RotaryAttention):
            return None
        raise Unmapped("its scores are gated")

    model = RotaryAttention().to(DT)
    handle = register_reader(no_qk)
    try:  # registered last: the built-in q_proj/k_proj/v_proj reader wins
        labels = [b.label for b in find_symmetries(model, rotary_pairing="half").blocks]
    finally:
        handle.remove()
    assert labels == ["RotaryAttention.QK", "RotaryAttention.VO"]
    handle = register_reader(no_qk, first=True)
    try:
        geometry, messages = caught_warnings(lambda: find_symmetries(model))
    finally:
        handle.remove()
    assert not geometry.blocks
    assert messages == ["RotaryAttention: its scores are gated; left to the adaptive geometry"]
    assert no_qk not in registered_readers()


def test_reader_results_are_checked():
    with pytest.raises(TypeError, match="must be callable"):
        register_reader("not a reader")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="3 query heads do not split into 2"):
        AttentionFinding("a", 3, 2, "q", "k", "v", None)
    handle = register_reader(lambda name, module, context: "q_proj", first=True)
    try:
        with pytest.raises(TypeError, match="readers return an AttentionFinding or None"):
            find_symmetries(nn.Linear(2, 2))
    finally:
        handle.remove()


# ---------------------------------------------------------------------- rotary pairing, metric
@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_stated_rotary_pairing_gives_the_rotary_subgroup(pairing):
    model = two_layers(RotaryAttention, pairing=pairing)
    x = torch.randn(2, 6, 16, dtype=DT)
    with pytest.warns(UserWarning, match="pairing not known .* rotary_pairing="):
        assert [b.label for b in find_symmetries(model).blocks] == ["0.VO", "2.VO"]

    def found(m):
        return find_symmetries(m, rotary_pairing=pairing)

    geometry = found(model)
    qk = [b.manifold for b in geometry.blocks if b.label.endswith(".QK")]
    assert len(qk) == 2
    assert all(isinstance(m, RotaryGLQuotient) and m.pairing == pairing for m in qk)
    moved = moved_along_orbits(model, scale=2.0, seed=3, symmetries=found)
    torch.testing.assert_close(moved(x), model(x), rtol=1e-9, atol=1e-9)
    # the other pairing is no symmetry of this model: moving along it changes the output
    other = "interleaved" if pairing == "half" else "half"
    wrong = moved_along_orbits(
        model, scale=2.0, seed=3, symmetries=lambda m: find_symmetries(m, rotary_pairing=other)
    )
    with torch.no_grad():
        assert (wrong(x) - model(x)).abs().max() > 1e-3 * model(x).abs().max()


@pytest.mark.parametrize("metric", ["mix", "inv", 0.25])
def test_declared_blocks_carry_the_metric(metric):
    model = nn.Sequential(two_layers(RotaryAttention), two_layers(ToQKVAttention, d=8, kv=4))
    with register_reader(read_to_qkv):
        geometry = find_symmetries(model, metric=metric, rotary_pairing="half")
    kinds = [type(k.manifold).__name__ for k in geometry.kinds]
    assert "RotaryGLQuotient" in kinds and len(kinds) >= 3
    assert {k.manifold.metric_name for k in geometry.kinds} == {metric}
    assert geometry.metrics == (metric,)


def test_default_metric_and_bad_switches():
    from quotientgeo.manifolds import DEFAULT_METRIC

    assert find_symmetries(two_layers(RotaryAttention), warn=False).metrics == (DEFAULT_METRIC,)
    with pytest.raises(ValueError, match="metric must be"):
        find_symmetries(nn.Linear(2, 2), metric="euclid")
    with pytest.raises(ValueError, match="rotary_pairing must be 'half', 'interleaved'"):
        find_symmetries(nn.Linear(2, 2), rotary_pairing="neox")


# ---------------------------------------------------------------------- frozen attention
def test_frozen_attention_is_reported_once_and_listed(tiny_bert):
    """Only the pooler trainable: the 2 attention blocks are named as frozen, not missing."""
    model = tiny_bert()
    model.requires_grad_(False)
    model.pooler.requires_grad_(True)
    geometry, messages = caught_warnings(lambda: find_symmetries(model))
    assert not geometry.kinds
    assert messages == [
        "2 attention blocks found but their parameters are frozen (requires_grad=False): "
        "left out of the geometry (geometry.skipped lists them)"
    ]
    prefix = "encoder.layer.{}.attention.self.{}: its parameters are frozen (requires_grad=False)"
    assert geometry.skipped == tuple(prefix.format(i, p) for i in (0, 1) for p in ("QK", "VO"))
    assert find_symmetries(model, warn=False).skipped == geometry.skipped


def test_partly_frozen_attention(tiny_bert):
    """One layer frozen: counted alone; a pair with some frozen factors is warned as before."""
    model = tiny_bert()
    model.encoder.layer[0].attention.requires_grad_(False)
    model.encoder.layer[1].attention.self.query.requires_grad_(False)
    geometry, messages = caught_warnings(lambda: find_symmetries(model))
    assert [b.label for b in geometry.blocks] == ["encoder.layer.1.attention.self.VO"]
    assert messages == [
        "encoder.layer.1.attention.self.QK: some factors are frozen; left to the adaptive geometry",
        "1 attention block found but its parameters are frozen (requires_grad=False): "
        "left out of the geometry (geometry.skipped lists them)",
    ]
    assert len(geometry.skipped) == 3
    assert geometry.with_metric("inv").skipped == geometry.skipped
