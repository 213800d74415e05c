"""The studies' statistics against scipy's: the batched τ-b of bootstrap resamples is
:func:`scipy.stats.kendalltau` on each resample, to the bit, and the bootstrap interval is the
one that calls it once per resample."""

from __future__ import annotations

import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import DegenerateDataWarning, bootstrap, kendalltau

from quotientgeo_studies import _common as C


def samples(draw, n: int) -> np.ndarray:
    """``n`` values: continuous, or a few levels (ties), or constant."""
    kind = draw(st.sampled_from(["normal", "levels", "constant"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "normal":
        return rng.normal(size=n)
    if kind == "levels":
        return rng.integers(0, draw(st.integers(1, 4)), n).astype(float)
    return np.full(n, 0.5)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_resampled_tau_b_is_scipys_on_each_resample(data):
    n = data.draw(st.integers(2, 30))
    x, y = samples(data.draw, n), samples(data.draw, n)
    shape = data.draw(st.sampled_from([(), (5,), (2, 3)]))
    m = data.draw(st.integers(2, 30))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    indices = rng.integers(0, n, (*shape, m))
    got = C.resampled_tau_b(x, y, indices)
    assert got.shape == shape
    for i in np.ndindex(shape):
        expected = kendalltau(x[indices[i]], y[indices[i]])[0]
        assert np.isnan(got[i]) if np.isnan(expected) else got[i] == expected, (i, got[i])


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_kendall_interval_is_the_per_resample_bootstrap(data):
    n = data.draw(st.integers(3, 60))
    x, y = samples(data.draw, n), samples(data.draw, n)
    x[data.draw(st.integers(0, n - 1))] = data.draw(st.sampled_from([np.nan, np.inf, 0.0]))
    seed = data.draw(st.integers(0, 1000))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DegenerateDataWarning)
        res = bootstrap(
            C.finite_pairs(x, y),
            lambda a, b: kendalltau(a, b)[0],
            paired=True,
            vectorized=False,
            n_resamples=300,
            method="percentile",
            rng=np.random.default_rng(seed),
        )
        if np.isnan(res.bootstrap_distribution).all():
            return  # no defined τ: nanpercentile has nothing to take
        tail = 50 * (1 - 0.9)
        expected = np.nanpercentile(res.bootstrap_distribution, [tail, 100 - tail])
    got = C.kendall_interval(x, y, resamples=300, seed=seed)
    assert got == (float(expected[0]), float(expected[1]))
