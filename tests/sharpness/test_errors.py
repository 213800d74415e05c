"""Errors that name the weights at fault: rank-deficient heads and non-finite weights.

- a rank-deficient head found during a sharpness call or a GeodesicSAM step raises a
  ``ValueError`` naming the block label, layer, head and the parameters of the failing factor,
  chained from the original failure;
- a NaN or an infinity in a weight (in a symmetry block or only in the adaptive rest) is
  reported as non-finite with the parameter's name, not as rank deficiency;
- both leave the model as it was (parameters, buffers, ``.grad``, train/eval modes);
- on a healthy model the results equal those of the same code path without the diagnosis.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from torch import nn

import quotientgeo.geometry.diagnosis as diagnosis_module
import quotientgeo.optim.sam as sam_module
import quotientgeo.sharpness.objective as objective_module
import quotientgeo.sharpness.run as run_module
from quotientgeo import ParameterGeometry, Source
from quotientgeo.optim import GeodesicSAM
from quotientgeo.sharpness import average_sharpness, geodesic_sharpness
from quotientgeo.sharpness.ranks import SplitBatch
from quotientgeo.testing import TinyTransformerClassifier, cross_entropy, models
from quotientgeo.testing.assertions import assert_same, snapshot

pytestmark = pytest.mark.filterwarnings("ignore:no parameter symmetry detected:UserWarning")

DT = torch.float64
HEAD = 4  # tiny BERT: 4 heads of width 4, 2 layers
IDS = torch.randint(0, 40, (6, 8), generator=torch.Generator().manual_seed(0))
TARGET = torch.randn(6, 16, generator=torch.Generator().manual_seed(1), dtype=DT)


def bert_loss(model, batch):
    out = model(input_ids=batch).last_hidden_state.mean(1)
    return (out - TARGET.to(out.dtype)).square().mean()


def stateful_bert(dtype=DT):
    """Tiny BERT in mixed train/eval modes, with ``.grad`` set on all but one parameter."""
    pytest.importorskip("transformers")
    model = models.tiny_bert(dtype)
    model.train()
    model.encoder.layer[0].eval()
    bert_loss(model, IDS).backward()
    model.pooler.dense.bias.grad = None
    return model


def zero_query_feature(model, layer: int, head: int) -> None:
    """One query feature of ``head`` in ``layer`` set to zero (weight row and bias entry): a
    zero column of that head's ``G`` in the QK pair."""
    q = model.encoder.layer[layer].attention.self.query
    with torch.no_grad():
        q.weight[head * HEAD + 1] = 0.0
        q.bias[head * HEAD + 1] = 0.0


def attention(layer: int) -> str:
    return f"encoder.layer.{layer}.attention"


# ---------------------------------------------------------------------- rank deficiency
@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize(("layer", "head"), [(0, 0), (1, 2), (0, 3)])
def test_rank_deficient_head_is_named_and_the_model_restored(layer, head, metric):
    model = stateful_bert()
    zero_query_feature(model, layer, head)
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        geodesic_sharpness(
            model, bert_loss, [IDS], rho=0.05, n_iter=3, metric=metric, progress=False
        )
    message = str(info.value)
    self_ = f"{attention(layer)}.self"
    assert message.startswith("rank-deficient factors in 1 head(s) of the symmetry blocks")
    assert f"{self_}.QK (layer {layer}), head {head}: G has condition number" in message
    assert f"({self_}.query.weight, {self_}.query.bias)" in message
    assert "key.weight" not in message  # the other factor is fine
    assert "torch.float64" in message and "eps > 0" in message and "float64 or" not in message
    assert message.endswith("the model is restored")
    assert info.value.__cause__ is not None  # chained from the failure it explains
    assert_same(before, snapshot(model))


def test_several_heads_are_listed_with_a_count_and_float32_advice(tiny_bert):
    model = tiny_bert(torch.float32)
    for layer in (0, 1):
        for head in range(HEAD):
            zero_query_feature(model, layer, head)
    with torch.no_grad():  # and the VO pair of layer 0, head 3: its output columns
        model.encoder.layer[0].attention.output.dense.weight[:, 12:16] = 0.0
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        average_sharpness(model, bert_loss, [IDS], rho=0.05, n_samples=2, progress=False)
    message = str(info.value)
    assert message.startswith("rank-deficient factors in 9 head(s)")
    assert "torch.float32" in message and "worst condition number inf" in message
    lines = message.splitlines()
    assert lines[1].strip().startswith(f"{attention(0)}.self.QK (layer 0), head 0: G")
    assert "  … and 5 more" in lines  # 4 of 9 shown
    assert "compute in float64 or relax the geometry with eps > 0" in message
    assert_same(before, snapshot(model))


def test_rank_deficient_output_projection_names_the_H_factor(tiny_bert):
    model = tiny_bert(DT)
    with torch.no_grad():
        model.encoder.layer[1].attention.output.dense.weight[:, 4:8] = 0.0  # head 1's columns
    with pytest.raises(ValueError) as info:
        geodesic_sharpness(model, bert_loss, [IDS], rho=0.05, n_iter=2, progress=False)
    message = str(info.value)
    assert (
        f"{attention(1)}.self.VO (layer 1), head 1: H has condition number inf "
        f"({attention(1)}.output.dense.weight)"
    ) in message


def test_nearly_singular_head_is_named_in_a_non_finite_loss_error(tiny_bert):
    model = tiny_bert(DT)
    q = model.encoder.layer[1].attention.self.query
    with torch.no_grad():  # two equal features: rank deficient, yet the factorizations pass
        q.weight[9] = q.weight[8]
        q.bias[9] = q.bias[8]
    calls = {"n": 0}

    def loss_fn(m, batch):
        calls["n"] += 1
        loss = bert_loss(m, batch)
        return loss * float("nan") if calls["n"] == 2 else loss

    with pytest.raises(ValueError) as info:
        geodesic_sharpness(model, loss_fn, [IDS], rho=0.05, n_iter=3, progress=False)
    message = str(info.value)
    assert re.match(
        r"loss_fn returned a non-finite loss \(nan\) on batch 0 at iteration 1 \(restart 0\), "
        r"likely from rank-deficient factors in 1 head\(s\)",
        message,
    )
    assert f"{attention(1)}.self.QK (layer 1), head 2: G" in message


def test_failures_that_are_not_the_weights_pass_through_unchanged(tiny_bert):
    model = tiny_bert(DT)

    def loss_fn(m, batch):
        raise torch.linalg.LinAlgError("the user's own factorization failed")

    with pytest.raises(torch.linalg.LinAlgError, match="the user's own factorization"):
        geodesic_sharpness(model, loss_fn, [IDS], rho=0.05, n_iter=2, progress=False)
    with pytest.raises(ValueError, match=r"^loss_fn returned a non-finite loss \(nan\).*restored$"):
        geodesic_sharpness(
            model, lambda m, b: bert_loss(m, b) * float("nan"), [IDS], rho=0.05, n_iter=2,
            progress=False,
        )  # fmt: skip


class Diagonal(nn.Module):
    """``y = X (u ⊙ v)``: one re-scaling pair."""

    def __init__(self):
        super().__init__()
        self.u = nn.Parameter(torch.randn(5, dtype=DT))
        self.v = nn.Parameter(torch.randn(5, dtype=DT))

    def forward(self, X):
        return X @ (self.u * self.v)


def test_degenerate_point_of_another_manifold_gives_its_reason_and_the_head():
    torch.manual_seed(0)
    model = Diagonal()
    with torch.no_grad():
        model.u[2] = 0.0
    geometry = ParameterGeometry(model).add_rescale_pair("u", "v", label="diagonal")
    X, y = torch.randn(8, 5, dtype=DT), torch.randn(8, dtype=DT)
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        geodesic_sharpness(
            model, lambda m, b: (m(b[0]) - b[1]).square().mean(), [(X, y)], rho=0.1, n_iter=2,
            symmetries=geometry, progress=False,
        )  # fmt: skip
    lines = str(info.value).splitlines()
    assert lines[0] == "degenerate points in 1 head(s) of the symmetry blocks:"
    assert lines[1].startswith("  diagonal, head 0: ") and lines[1].endswith(" (u, v)")
    assert "zero entries" in lines[1]  # the manifold's own reason
    assert lines[2:] == ["the model is restored"]
    assert_same(before, snapshot(model))


# ---------------------------------------------------------------------- non-finite weights
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_symmetric_weight_is_named_not_rank_deficient(value):
    model = stateful_bert()
    with torch.no_grad():
        model.encoder.layer[1].attention.self.query.weight[9, 3] = value  # head 2
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        geodesic_sharpness(model, bert_loss, [IDS], rho=0.05, n_iter=2, progress=False)
    message = str(info.value)
    assert message.startswith("non-finite weights (NaN or Inf) in 1 parameter(s):")
    assert (
        f"{attention(1)}.self.query.weight: {attention(1)}.self.QK (layer 1), head 2\n"
    ) in message
    assert "rank" not in message and message.endswith("the model is restored")
    assert_same(before, snapshot(model))


@pytest.mark.parametrize(
    "name",
    [
        "encoder.layer.0.output.LayerNorm.weight",
        "pooler.dense.bias",
        "embeddings.word_embeddings.weight",
    ],
)
def test_non_finite_adaptive_weight_is_named(name):
    model = stateful_bert()
    with torch.no_grad():
        model.get_parameter(name).view(-1)[3] = float("nan")
    before = snapshot(model)
    for measure in (geodesic_sharpness, average_sharpness):
        kw = dict(n_iter=2) if measure is geodesic_sharpness else dict(n_samples=2)
        with pytest.raises(ValueError) as info:
            measure(model, bert_loss, [IDS], rho=0.05, progress=False, **kw)
        message = str(info.value)
        assert message.startswith("non-finite weights (NaN or Inf) in 1 parameter(s):")
        assert f"  {name}: adaptive geometry\n" in message and "rank" not in message
        assert_same(before, snapshot(model))


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_non_finite_entries_of_partly_covered_parameters():
    torch.manual_seed(0)
    model = TwoLayer().to(DT)
    geometry = ParameterGeometry(model).add_gl_pair(
        [Source("fc1.weight", rows=(0, 4)), Source("fc1.bias", rows=(0, 4))],
        Source("fc2.weight", axis=1, cols=(0, 4)),
        heads=4,
        label="neurons",
    )
    batch = (torch.randn(8, 5, dtype=DT), torch.randint(0, 3, (8,)))

    def loss_fn(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])

    with torch.no_grad():
        model.fc1.weight[1, 0] = float("nan")  # neuron 1: in the block
        model.fc2.weight[0, 5] = float("inf")  # unit 5: adaptive entry of a covered tensor
    with pytest.raises(ValueError) as info:
        geodesic_sharpness(
            model, loss_fn, [batch], rho=0.1, n_iter=2, symmetries=geometry, progress=False
        )
    message = str(info.value)
    assert "in 2 parameter(s)" in message
    assert "  fc1.weight: neurons, head 1\n" in message
    assert "  fc2.weight: its adaptive entries\n" in message


# ---------------------------------------------------------------------- the happy path
class _NoDiagnosis:
    """The diagnosis taken out of the code path: what the measures did before it existed."""

    def __init__(self, *args):
        pass

    def check_finite(self, tensors=None):
        pass

    def rank_deficient(self):
        return None

    def explain(self, err):
        return None

    def located(self):
        return contextlib.nullcontext()


@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_healthy_model_gives_the_results_of_the_code_path_without_diagnosis(
    tiny_bert, metric, monkeypatch
):
    model = tiny_bert(DT, initializer_range=0.3)
    kw = dict(rho=0.05, metric=metric, progress=False)

    def run():
        g = geodesic_sharpness(model, bert_loss, [IDS, IDS.flip(0)], n_iter=6, restarts=2, **kw)
        a = average_sharpness(model, bert_loss, [IDS], n_samples=3, **kw)
        return g.per_batch, g.trace, g.first_order_losses, a.per_batch, a.trace

    checks = {"n": 0}
    real_check = diagnosis_module.Diagnosis.check_finite

    def counted(self, *args):
        checks["n"] += 1
        return real_check(self, *args)

    def never(*args):
        raise AssertionError("the diagnosis ran on a healthy model")

    monkeypatch.setattr(diagnosis_module.Diagnosis, "check_finite", counted)
    monkeypatch.setattr(diagnosis_module.Diagnosis, "explain", never)
    monkeypatch.setattr(diagnosis_module.Diagnosis, "rank_deficient", never)
    diagnosed = run()
    assert checks["n"] == 2  # once per call, not per batch or iteration
    monkeypatch.setattr(objective_module, "Diagnosis", _NoDiagnosis)
    assert diagnosed == run()


# ---------------------------------------------------------------------- GeodesicSAM
@pytest.mark.parametrize("metric", ["inv", "mix"])
def test_sam_step_names_a_rank_deficient_head_and_changes_nothing(metric):
    model = stateful_bert()
    zero_query_feature(model, 1, 3)
    opt = GeodesicSAM(model, torch.optim.SGD, rho=0.05, lr=0.1, metric=metric)
    bert_loss(model, IDS).backward()
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        opt.first_step(zero_grad=True)
    message = str(info.value)
    self_ = f"{attention(1)}.self"
    assert f"{self_}.QK (layer 1), head 3: G has condition number" in message
    assert f"({self_}.query.weight, {self_}.query.bias)" in message
    assert message.endswith("the weights are unchanged") and info.value.__cause__ is not None
    assert_same(before, snapshot(model))
    with pytest.raises(RuntimeError, match="second_step needs a first_step"):
        opt.second_step()  # nothing half-done to undo


def test_sam_step_names_a_non_finite_weight():
    model = stateful_bert()
    opt = GeodesicSAM(model, torch.optim.SGD, rho=0.05, lr=0.1)
    bert_loss(model, IDS).backward()
    with torch.no_grad():
        model.encoder.layer[0].attention.self.key.weight[2, 5] = float("nan")  # head 0
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        opt.first_step()
    message = str(info.value)
    assert message.startswith("non-finite weights (NaN or Inf) in 1 parameter(s):")
    assert f"{attention(0)}.self.key.weight: {attention(0)}.self.QK (layer 0), head 0" in message
    assert "rank" not in message
    assert_same(before, snapshot(model))


def test_sam_step_on_a_healthy_model_is_the_step_without_diagnosis(tiny_bert, monkeypatch):
    def step():
        model = tiny_bert(DT, initializer_range=0.3)
        opt = GeodesicSAM(model, torch.optim.SGD, rho=0.05, lr=0.1)
        opt.step(lambda: bert_loss(model, IDS).backward())
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def never(*args):
        raise AssertionError("the diagnosis ran on a healthy model")

    monkeypatch.setattr(diagnosis_module.Diagnosis, "explain", never)
    diagnosed = step()
    monkeypatch.setattr(sam_module, "Diagnosis", _NoDiagnosis)
    plain = step()
    assert diagnosed.keys() == plain.keys()
    assert all(torch.equal(diagnosed[n], plain[n]) for n in plain)


def test_split_batch_raises_the_located_failure(tiny_bert, monkeypatch):
    """With ``distributed="split_batch"`` every rank holds the same weights and the averaged
    gradients, so the geometry fails alike on all of them, and each raises the error that
    names the head (no rank waits in a collective)."""

    class SplitRanks(SplitBatch):  # the one collective the evaluation makes, on a group of one
        def __init__(self):
            self.rank, self.world = 0, 1
            self.first_failure, self.local_losses = None, []

        def batch_offset(self, batches):
            return 0

        def average(self, loss, space):
            return loss

    model = tiny_bert(DT)
    zero_query_feature(model, 0, 1)
    monkeypatch.setattr(run_module, "ranks_for", lambda mode, sharded=False: SplitRanks())
    with pytest.raises(ValueError) as info:
        geodesic_sharpness(
            model, bert_loss, [IDS], rho=0.05, n_iter=2, distributed="split_batch",
            progress=False,
        )  # fmt: skip
    message = str(info.value)
    assert message.startswith("rank-deficient factors in 1 head(s) of the symmetry blocks")
    assert f"{attention(0)}.self.QK (layer 0), head 1: G" in message


@pytest.mark.parametrize("build", ["measure", "sam"])
def test_a_model_on_the_meta_device_is_named(build):
    with torch.device("meta"):
        model = TinyTransformerClassifier(d=8, heads=2, layers=1, classes=3)
    with pytest.raises(ValueError, match=r"meta device \(.*\).*materialise"):
        if build == "measure":
            geodesic_sharpness(model, cross_entropy, [None], rho=0.1, n_iter=2, progress=False)
        else:
            GeodesicSAM(model, torch.optim.SGD, rho=0.1, lr=0.1)
