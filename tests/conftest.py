"""Hypothesis profiles, the process set-up and the fixtures of the test-suite.

The helpers the tests share (numerics, strategies, oracles, assertions, tiny models) live in
:mod:`quotientgeo.testing`.
"""

from __future__ import annotations

import os

# geomstats picks its backend when first imported; the property tests use its pytorch backend.
os.environ.setdefault("GEOMSTATS_BACKEND", "pytorch")

import pytest
import torch
from hypothesis import HealthCheck, settings

from quotientgeo.testing import models

# Two xdist workers on two cores: one BLAS thread each avoids oversubscription.
torch.set_num_threads(1)

settings.register_profile(
    "default",
    deadline=None,
    max_examples=12,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "thorough",
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
# CI replays the same examples on every run (a red CI must be reproducible); locally each
# run draws new ones. HYPOTHESIS_PROFILE=thorough for a long search.
settings.register_profile("ci", settings.get_profile("default"), derandomize=True)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default")
)


@pytest.fixture(autouse=True)
def _default_dtype():
    """Tests must not depend on (or leak) the global default dtype."""
    old = torch.get_default_dtype()
    yield
    torch.set_default_dtype(old)


@pytest.fixture
def tiny_bert():
    """:func:`quotientgeo.testing.models.tiny_bert`; skips the test without transformers."""
    pytest.importorskip("transformers")
    return models.tiny_bert
