"""The current iterate moves into the weights during the backward pass (``Objective._park``).

Parking changes where ``ξ_k`` of the symmetric parameters lives between the backward pass and
the next step, never a number: every result with it equals the result without it bit for bit,
on families with fused, grouped, rotary, partly covered and overlapping blocks. The hooks leave
the model with the measure, also when ``loss_fn`` raises, and a model that recomputes its
forward pass in the backward pass (activation checkpointing) is measured without parking.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quotientgeo import geodesic_sharpness
from quotientgeo.sharpness import objective as objective_module

sys.path.insert(0, str(Path(__file__).parents[1] / "geometry"))  # the families' tiny models
from tiny_families import regression

FAMILIES = ["gpt2", "llama", "gpt_neox", "bloom", "timm_vit_qk_norm"]
KW = dict(rho=0.05, n_iter=6, progress=False, return_perturbation=True)


def _parks(monkeypatch) -> list[str]:
    """The names that the hooks park, recorded."""
    parked, park = [], objective_module.Objective._park

    def spy(self, name, param):
        before = name in self._parked
        park(self, name, param)
        if not before and name in self._parked:
            parked.append(name)

    monkeypatch.setattr(objective_module.Objective, "_park", spy)
    return parked


def _measures(model, loss_fn):
    return [
        geodesic_sharpness(model, loss_fn, [None, None], metric="mix", **KW),
        geodesic_sharpness(model, loss_fn, [None], metric="inv", perturbation="exact", **KW),
        geodesic_sharpness(model, loss_fn, [None], metric="inv", perturbation="first_order", **KW),
    ]


@pytest.mark.parametrize("name", FAMILIES)
def test_parking_changes_no_number(name, monkeypatch):
    model, loss_fn = regression(name)
    parked = _parks(monkeypatch)
    with_parking = _measures(model, loss_fn)
    assert parked, "no symmetric parameter was parked: the comparison would be vacuous"
    monkeypatch.setattr(objective_module, "_recomputes_forward", lambda model: True)
    parked.clear()
    without = _measures(model, loss_fn)
    assert not parked
    for a, b in zip(with_parking, without, strict=True):
        assert a.value == b.value and a.per_batch == b.per_batch and a.trace == b.trace
        assert a.perturbations is not None and b.perturbations is not None
        for xa, xb in zip(a.perturbations, b.perturbations, strict=True):
            for key in xa:
                assert torch.equal(xa[key], xb[key]), key


def _hooks(model) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def test_the_hooks_leave_with_the_measure_also_on_errors():
    model, loss_fn = regression("gpt2")
    geodesic_sharpness(model, loss_fn, [None], rho=0.05, n_iter=3, progress=False)
    assert _hooks(model) == 0
    calls = []

    def failing(m, batch):
        calls.append(1)
        if len(calls) == 4:  # after two backward passes
            raise RuntimeError("boom")
        return loss_fn(m, batch)

    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="boom"):
        geodesic_sharpness(model, failing, [None], rho=0.05, n_iter=6, progress=False)
    assert _hooks(model) == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_model_that_recomputes_its_forward_pass_is_not_parked(monkeypatch):
    model, loss_fn = regression("gpt2")
    reference = geodesic_sharpness(model, loss_fn, [None], rho=0.05, n_iter=4, progress=False)
    model.gradient_checkpointing_enable()
    parked = _parks(monkeypatch)
    result = geodesic_sharpness(model, loss_fn, [None], rho=0.05, n_iter=4, progress=False)
    assert not parked and result.value == reference.value


@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=12),
    size=st.integers(1, 120),
)
@settings(max_examples=60, deadline=None)
def test_parking_groups_are_runs_of_the_backward_order_within_a_size(sizes, size):
    """The groups, in order, are the parameters in reverse, each run at most ``size`` entries
    (or one larger parameter), and a run ends only where the next parameter would not fit."""
    current = {f"p{i}": torch.empty(n) for i, n in enumerate(sizes)}
    groups = objective_module._parking_groups(current, size)
    assert [n for g in groups for n in g] == list(reversed(current))
    entries = [sum(current[n].numel() for n in g) for g in groups]
    for g, e in zip(groups, entries, strict=True):
        assert e <= size or len(g) == 1
    for g, nxt in itertools.pairwise(groups):
        assert sum(current[n].numel() for n in (*g, nxt[0])) > size


@pytest.mark.parametrize("piece_size", [1, 2**40])
def test_a_group_parks_at_once_whatever_its_size(piece_size, monkeypatch):
    """With one parameter per group or every symmetric parameter in one, each backward pass
    parks every symmetric parameter, and the numbers do not change."""
    model, loss_fn = regression("gpt2")
    reference = geodesic_sharpness(model, loss_fn, [None], rho=0.05, n_iter=4, progress=False)
    groups, backward_passes = [], []
    init, gradient = objective_module.Objective.__init__, objective_module.Objective.gradient

    def sized(self, model, loss_fn, space, *args, **kwargs):
        monkeypatch.setattr(space, "piece_size", piece_size)
        init(self, model, loss_fn, space, *args, **kwargs)
        groups.append(set(self._group.values()))

    def parks_all(self):
        gradient(self)
        backward_passes.append(self._parked == set(self._group) and bool(self._parked))

    monkeypatch.setattr(objective_module.Objective, "__init__", sized)
    monkeypatch.setattr(objective_module.Objective, "gradient", parks_all)
    result = geodesic_sharpness(model, loss_fn, [None], rho=0.05, n_iter=4, progress=False)
    assert result.value == reference.value and result.trace == reference.trace
    assert len(groups) == 1 and backward_passes and all(backward_passes)
    sizes = {len(g) for g in groups[0]}
    assert sizes == ({1} if piece_size == 1 else {len(set().union(*groups[0]))})
    assert piece_size == 1 or len(groups[0]) == 1
