"""The Measure value, its entry point, and the guards a new user meets."""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from quotientgeo import (
    FlatnessResult,
    Measure,
    SharpnessTracker,
    adaptive_sharpness,
    average_sharpness,
    calibrate_rho,
    geodesic_sharpness,
)
from quotientgeo.options import Norm, Perturbation
from quotientgeo.progress import progress_bar
from quotientgeo.sharpness import RelativeFlatness, SharpnessMeasure
from quotientgeo.testing import TinyTransformerClassifier, cross_entropy
from quotientgeo.testing.assertions import assert_same, snapshot

DT = torch.float64


def transformer(seed=0, dtype=DT):
    torch.manual_seed(seed)
    return TinyTransformerClassifier(8, 2, 1, classes=3).to(dtype).eval()


def batches(n=2, dtype=DT):
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 5, 8, generator=gen, dtype=dtype), torch.randint(0, 3, (4,), generator=gen))
        for _ in range(n)
    ]


def mlp(dtype=DT):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def mlp_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


MLP_BATCH = (torch.randn(10, 5, dtype=DT), torch.randint(0, 3, (10,)))


# ---------------------------------------------------------------------- the value
@settings(max_examples=8, deadline=None)
@given(
    rho=st.floats(1e-3, 1.0),
    metric=st.sampled_from([None, "mix", "inv", 0.25]),
    perturbation=st.sampled_from(list(Perturbation)),
    seed=st.integers(0, 3),
)
def test_the_functions_are_their_measures(rho, metric, perturbation, seed):
    """Each public function returns exactly what its ``Measure`` evaluates to."""
    model, data = transformer(), batches(1)
    kw = dict(metric=metric, perturbation=perturbation, seed=seed)
    direct = geodesic_sharpness(model, cross_entropy, data, rho=rho, n_iter=3, progress=False, **kw)
    measure = Measure.geodesic(rho, n_iter=3, **kw)
    via = measure.evaluate(model, cross_entropy, data, progress=False)
    assert direct.per_batch == via.per_batch and direct.trace == via.trace
    assert {k: v for k, v in direct.settings.items()} == via.settings
    avg = average_sharpness(model, cross_entropy, data, rho=rho, n_samples=3, **kw, progress=False)
    via = Measure.average(rho, n_samples=3, **kw).evaluate(
        model, cross_entropy, data, progress=False
    )
    assert avg.per_batch == via.per_batch
    ada = adaptive_sharpness(model, cross_entropy, data, rho=rho, n_iter=3, progress=False)
    via = Measure.adaptive(rho, n_iter=3).evaluate(model, cross_entropy, data, progress=False)
    assert ada.per_batch == via.per_batch


def test_a_measure_is_a_frozen_value():
    m = Measure.geodesic(0.1, metric="inv", perturbation="second_order", n_iter=7)
    assert m == Measure.geodesic(0.1, metric="inv", perturbation="second_order", n_iter=7)
    assert hash(m) == hash(
        Measure.geodesic(0.1, metric="inv", perturbation="second_order", n_iter=7)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.rho = 0.2  # type: ignore[misc]
    assert m.perturbation is Perturbation.SECOND_ORDER and m.norm is Norm.RIEMANNIAN
    assert m.with_rho(0.3).rho == 0.3 and m.rho == 0.1
    assert m.replace(n_iter=9).case.n_iter == 9 and m.case.n_iter == 7
    adaptive = Measure.adaptive(0.1)
    assert (adaptive.symmetries, adaptive.perturbation, adaptive.norm) == (
        None,
        Perturbation.FIRST_ORDER,
        Norm.ADAPTIVE,
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"perturbation": "third_order"}, "perturbation must be one of"),
        ({"norm": "l1"}, "norm must be one of"),
        ({"metric": "euclid"}, "metric must be one of"),
        ({"metric": 1.5}, "must lie in"),
        ({"n_iter": 0}, "n_iter must be a positive integer"),
        ({"symmetries": "all"}, "symmetries must be 'auto', None or a ParameterGeometry"),
    ],
)
def test_bad_fields_are_refused_when_the_measure_is_built(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Measure.geodesic(0.1, **kwargs)
    with pytest.raises(ValueError, match="rho"):
        Measure.geodesic(-1.0)


def test_calibration_takes_a_measure():
    """``calibrate_rho(measure=Measure)`` equals the named form with the same settings."""
    model, data = transformer(), batches(1)
    kw = dict(target=0.05, low=0.01, high=1.0, rtol=0.2, progress=False)
    by_value = calibrate_rho(
        model, cross_entropy, data, measure=Measure.geodesic(1.0, metric="inv", n_iter=4), **kw
    )
    by_name = calibrate_rho(
        model, cross_entropy, data, measure="geodesic", metric="inv", n_iter=4, **kw
    )
    assert by_value == by_name and by_value.measure == "geodesic"
    with pytest.raises(TypeError, match="constructor"):
        calibrate_rho(model, cross_entropy, data, measure=Measure.adaptive(1.0), n_iter=3, **kw)


# ---------------------------------------------------------------------- one measure type
KINDS = {
    "geodesic": Measure.geodesic(0.05, n_iter=3),
    "adaptive": Measure.adaptive(0.05, n_iter=3),
    "average": Measure.average(0.05, n_samples=3),
    "relative_flatness": Measure.relative_flatness("head"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_every_constructor_builds_the_one_measure_type(kind):
    """Every constructor returns a ``Measure`` whose ``evaluate`` takes exactly
    ``Measure.evaluate``'s arguments and whose ``with_rho`` keeps its type."""
    m = KINDS[kind]
    assert isinstance(m, Measure) and m.name == kind
    assert isinstance(m, RelativeFlatness if kind == "relative_flatness" else SharpnessMeasure)
    assert m.settings()["measure"] == m.name
    wider = m.with_rho(0.2)
    assert type(wider) is type(m) and wider.name == m.name
    params = list(inspect.signature(type(m).evaluate).parameters.values())
    assert params == list(inspect.signature(Measure.evaluate).parameters.values())
    with pytest.raises(ValueError, match="rho"):
        m.with_rho(-1.0)


@pytest.mark.parametrize("kind", KINDS)
def test_every_measure_evaluates_through_one_call(kind):
    """One call for every kind: the distributed modes (no process group here: each gives the
    same value, an unknown one is refused), a result with value, per_batch, settings and
    to_dict."""
    m, model, data = KINDS[kind], transformer(), batches(2)
    results = [
        m.evaluate(model, cross_entropy, data, progress=False, distributed=mode)
        for mode in ("auto", "batches", "split_batch", "off")
    ]
    assert len({r.value for r in results}) == 1
    r = results[0]
    assert r.settings["measure"] == m.name and r.settings["n_batches"] == 2
    assert (r.settings["distributed"], r.settings["world_size"]) == ("off", 1)
    assert len(r.per_batch) == 2 and r.value == pytest.approx(sum(r.per_batch) / 2, rel=1e-12)
    assert json.loads(json.dumps(r.to_dict()))["value"] == r.value and r.wall_time >= 0
    with pytest.raises(ValueError, match="distributed must be one of"):
        m.evaluate(model, cross_entropy, data, progress=False, distributed="ranks")


@pytest.mark.parametrize("kind", ["average", "relative_flatness"])
def test_return_perturbation_is_refused_by_a_measure_without_one(kind):
    with pytest.raises(ValueError, match="needs a worst-case measure"):
        KINDS[kind].evaluate(
            transformer(), cross_entropy, batches(1), progress=False, return_perturbation=True
        )


def test_relative_flatness_has_no_radius_to_calibrate():
    m = KINDS["relative_flatness"]
    assert m.with_rho(0.3) == m and m.with_rho(3.0).settings() == m.settings()
    with pytest.raises(ValueError, match="does not depend on ρ"):
        calibrate_rho(transformer(), cross_entropy, batches(1), target=0.1, measure=m)
    with pytest.raises(ValueError, match="chunk_size"):
        Measure.relative_flatness("head", chunk_size=0)


@dataclasses.dataclass(frozen=True)
class MeanLoss(Measure):
    """A measure of one's own: the mean loss over the batches (no ball)."""

    name: str = "mean_loss"

    def evaluate(
        self, model, loss_fn, batches, *, progress=True, distributed="auto",
        return_perturbation=False,
    ) -> FlatnessResult:  # fmt: skip
        with torch.no_grad():
            per_batch = [float(loss_fn(model, b)) for b in batches]
        value = sum(per_batch) / len(per_batch)
        return FlatnessResult(value, per_batch, per_batch, self.settings(), 0.0)

    def with_rho(self, rho: float) -> MeanLoss:
        return self

    def settings(self) -> dict:
        return {"measure": self.name}


def test_measure_is_abstract_and_the_tracker_takes_any_measure():
    """``Measure`` itself cannot be built; the tracker calls every measure, one of one's own
    included, through ``Measure.evaluate`` alone."""
    with pytest.raises(TypeError, match="abstract"):
        Measure()  # type: ignore[abstract]
    model, data = transformer(), batches(2)
    for m in (MeanLoss(), KINDS["relative_flatness"], KINDS["adaptive"]):
        tracker = SharpnessTracker(m, cross_entropy, data, every=2)
        assert tracker(model, 1) is None
        tracked = tracker(model, 2)
        assert tracked is not None and tracker.name == f"sharpness/{m.name}"
        expected = m.evaluate(model, cross_entropy, data, progress=False)
        assert tracked.value == expected.value and tracked.result.per_batch == expected.per_batch


@pytest.mark.parametrize("kind", ["adaptive", "relative_flatness"])
def test_the_tracker_gives_every_measure_its_distributed_mode(kind):
    tracker = SharpnessTracker(KINDS[kind], cross_entropy, batches(1), every=1, distributed="x")
    with pytest.raises(ValueError, match="distributed must be one of"):
        tracker(transformer(), 1)


# ---------------------------------------------------------------------- new-user guards
@pytest.mark.parametrize(
    ("loss_fn", "match"),
    [
        (lambda m, x, y: F.cross_entropy(m(x), y), r"signature is \(m, x, y\)"),
        (lambda batch: batch, r"signature is \(batch\)"),
    ],
)
def test_a_loss_fn_of_the_wrong_signature_is_named(loss_fn, match):
    model = mlp()
    before = snapshot(model)
    with pytest.raises(TypeError, match=r"loss_fn must be callable as loss_fn\(model, batch\)"):
        adaptive_sharpness(model, loss_fn, [MLP_BATCH], rho=0.1, n_iter=2, progress=False)
    with pytest.raises(TypeError, match=match):
        adaptive_sharpness(model, loss_fn, [MLP_BATCH], rho=0.1, n_iter=2, progress=False)
    assert_same(before, snapshot(model))


@pytest.mark.parametrize(
    ("one_batch", "match"),
    [
        (MLP_BATCH, r"tuple of 2 tensors: it looks like one batch \(x, y\)"),
        (MLP_BATCH[0], "batches is a tensor"),
        ({"x": MLP_BATCH[0]}, "batches is a mapping"),
        (3, "batches must be an iterable of batches"),
    ],
)
def test_one_batch_passed_as_batches_is_named(one_batch, match):
    with pytest.raises(TypeError, match=match):
        adaptive_sharpness(mlp(), mlp_loss, one_batch, rho=0.1, n_iter=2, progress=False)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
@pytest.mark.parametrize("fail_at", [0, 3])
def test_an_exception_in_loss_fn_names_batch_and_iteration(fail_at):
    """The exception keeps its type and gains a note with the batch and the iteration."""
    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        if calls["n"] > fail_at and batch is data[1]:
            raise KeyError("labels")
        return mlp_loss(model, batch)

    model, data = mlp(), [MLP_BATCH, (MLP_BATCH[0] + 1, MLP_BATCH[1])]
    before = snapshot(model)
    with pytest.raises(KeyError, match="labels") as info:
        geodesic_sharpness(model, loss_fn, data, rho=0.1, n_iter=5, progress=False)
    (note,) = info.value.__notes__
    assert note.startswith("raised by loss_fn on batch 1, iteration 0 (restart 0)")
    assert_same(before, snapshot(model))


@pytest.mark.parametrize(
    ("dtype", "eps"), [(torch.bfloat16, "0.00781"), (torch.float16, "0.000977")]
)
def test_a_half_precision_value_below_the_resolution_is_flagged(dtype, eps):
    """A half-precision loss whose increase is below its dtype's resolution does not pass for
    flatness, and the warning names that dtype and its resolution."""
    model = mlp(dtype)

    def flat_loss(model, batch):  # a loss far above the perturbation's effect at its resolution
        return (
            mlp_loss(model, batch) * 0
            + torch.tensor(300.0, dtype=dtype)
            + (model[0].weight.sum() * 1e-6).to(dtype)
        )

    data = [(MLP_BATCH[0].to(dtype), MLP_BATCH[1])]
    name = str(dtype).removeprefix("torch.")
    expected = f"below the resolution of the loss of a {name} model.*eps = {eps}"
    with pytest.warns(UserWarning, match=expected) as record:
        result = adaptive_sharpness(model, flat_loss, data, rho=1e-3, n_iter=2, progress=False)
    assert abs(result.value) < float(eps) * 300
    other = r"\bfloat16" if name == "bfloat16" else "bfloat16"  # the other dtype
    assert not any(re.search(other, str(w.message)) for w in record)


def test_a_progress_bar_is_off_where_output_is_not_a_terminal(monkeypatch):
    """``progress=True`` shows a bar on a terminal only, so batch-job logs are not flooded."""
    stream = io.StringIO()  # not a terminal
    bar = progress_bar(range(3), desc="x", enabled=True)
    assert bar.disable is False or not sys.stderr.isatty()
    quiet = progress_bar(range(3), enabled=True)
    quiet.fp = stream
    list(quiet)
    assert stream.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", stream)
    assert progress_bar(total=3, enabled=True).disable is True
    assert progress_bar(total=3, enabled=False).disable is True


def test_a_model_with_frozen_attention_is_told_why_nothing_is_measured():
    """Frozen attention is not "no symmetry detected": the message names what was left out."""
    model = transformer()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head"))
    with pytest.warns(UserWarning, match=r"discovery left out 2 block\(s\): .*QK: its parameters"):
        result = geodesic_sharpness(
            model, cross_entropy, batches(1), rho=0.1, n_iter=2, progress=False
        )
    assert result.settings["symmetric_blocks"] == 0
