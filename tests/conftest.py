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

# Local runs and CI draw their examples differently, on purpose.
#
# - Locally ("default") every run draws fresh examples: a property must hold on any draw, and a
#   run that explores is how a draw-dependent failure gets found. Hypothesis' example database
#   (.hypothesis/, git-ignored) replays a draw that failed here first on the next runs, until it
#   passes. A failure prints its ``@reproduce_failure`` blob (``print_blob``), and
#   ``--hypothesis-seed=N`` replays a whole run's draws, so a failure seen on one machine can be
#   reproduced on another.
# - CI ("ci", chosen by HYPOTHESIS_PROFILE=ci or the CI variable) replays the same examples on
#   every run (``derandomize``, which implies no database): a red CI must be reproducible, and
#   must not come from a draw unrelated to the change under test.
#
# Local runs do not replay CI's examples as well: they are a fixed sample of the same
# properties, every one of which CI runs on every change, so replaying them locally would find
# nothing CI does not, at the price of running each property twice (the 137 hypothesis tests
# took 6 minutes with -n 0 on a shared 2-core machine, 2026-11-27). HYPOTHESIS_PROFILE=ci
# replays exactly CI's draws locally; HYPOTHESIS_PROFILE=thorough searches longer.
settings.register_profile(
    "default",
    deadline=None,
    max_examples=12,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile("thorough", settings.get_profile("default"), max_examples=200)
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
