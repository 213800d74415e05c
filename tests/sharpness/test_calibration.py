"""calibrate_rho: the radius at which a measure reaches a target loss increase."""

from __future__ import annotations

import itertools

import pytest
import torch

from quotientgeo import calibrate_rho, geodesic_sharpness
from quotientgeo.testing import TinyTransformerClassifier, cross_entropy

DT = torch.float64
KW = dict(n_iter=5, progress=False)


def problem():
    torch.manual_seed(0)
    model = TinyTransformerClassifier(d=16, heads=4, layers=1, classes=3).to(DT).eval()
    gen = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(12, 5, 16, generator=gen, dtype=DT),
        torch.randint(0, 3, (12,), generator=gen),
    )
    return model, [(x, y)]


@pytest.mark.parametrize(
    ("measure", "extra"),
    [("geodesic", {"metric": "mix"}), ("geodesic", {"metric": "inv"}), ("adaptive", {}),
     ("average", {"n_samples": 6})],
)  # fmt: skip
def test_the_value_at_the_calibrated_rho_hits_the_target(measure, extra):
    model, batches = problem()
    kw = {} if measure == "average" else {"n_iter": 5}
    found = calibrate_rho(
        model, cross_entropy, batches, target=0.3, measure=measure, rtol=0.05, progress=False,
        **kw, **extra,
    )  # fmt: skip
    assert abs(found.value - 0.3) <= 0.05 * 0.3
    assert found.evaluations[-1] == (found.rho, found.value)
    if measure == "geodesic":  # an independent measurement at that ρ gives the same value
        again = geodesic_sharpness(model, cross_entropy, batches, rho=found.rho, **KW, **extra)
        assert again.value == pytest.approx(found.value, rel=1e-12)
    # the values measured grow with ρ (the bisection relies on it)
    ordered = sorted(found.evaluations)
    assert all(a[1] <= b[1] * (1 + 1e-9) for a, b in itertools.pairwise(ordered))


def test_the_bracket_widens_both_ways():
    model, batches = problem()
    small = calibrate_rho(model, cross_entropy, batches, target=1e-3, low=0.5, high=1.0,
                          progress=False, n_iter=5)  # fmt: skip
    assert small.rho < 0.5
    large = calibrate_rho(model, cross_entropy, batches, target=1.0, low=1e-3, high=2e-3,
                          progress=False, n_iter=5)  # fmt: skip
    assert large.rho > 2e-3


def test_bad_input():
    model, batches = problem()
    with pytest.raises(ValueError, match="measure"):
        calibrate_rho(model, cross_entropy, batches, target=1.0, measure="flat")
    with pytest.raises(ValueError, match="target"):
        calibrate_rho(model, cross_entropy, batches, target=0.0)
    with pytest.raises(ValueError, match="low must be smaller"):
        calibrate_rho(model, cross_entropy, batches, target=1.0, low=1.0, high=0.5)
    with pytest.raises(ValueError, match="max_evals"):
        calibrate_rho(model, cross_entropy, batches, target=1e6, max_evals=3, progress=False,
                      n_iter=2)  # fmt: skip


def test_an_iterator_of_batches_is_refused_before_it_is_consumed():
    model, batches = problem()
    generator = (batch for batch in batches)
    with pytest.raises(TypeError, match=r"iterator .*generator.*consume"):
        calibrate_rho(model, cross_entropy, generator, target=0.3, progress=False, n_iter=2)
    assert next(generator) is batches[0]  # untouched
