"""Symmetries defined by a user through the generic base: a subclass missing a primitive fails at
construction, a complete one works, and the example script (its loss, sharpness and Riemannian
gradient unchanged along the orbits) runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quotientgeo.manifolds import QuotientManifold

DT = torch.float64
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "define_a_symmetry.py"

PRIMITIVES = {
    "lie_shape": lambda self, p: (),
    "vertical": lambda self, p, omega: omega[..., None] * p.x,
    "metric": lambda self, p, u: u,
}


@pytest.mark.parametrize("missing", sorted(PRIMITIVES))
def test_subclass_missing_a_primitive_fails_at_construction(missing):
    methods = {k: f for k, f in PRIMITIVES.items() if k != missing}
    cls = type("Incomplete", (QuotientManifold,), {"ndim": 1, **methods})
    with pytest.raises(TypeError, match=missing):
        cls()


def test_complete_user_subclass_works():
    cls = type("Complete", (QuotientManifold,), {"ndim": 1, **PRIMITIVES})
    m = cls()
    x = torch.tensor([[1.0, 2.0, 2.0]], dtype=DT)
    u = torch.tensor([[1.0, 0.0, 0.0]], dtype=DT)
    assert torch.allclose(m.proju(x, u), u - x / 9)
    assert torch.allclose(m.christoffel(x, u), torch.zeros_like(u))  # flat metric


def test_example_script_runs():
    out = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, check=True
    )
    lines = out.stdout.splitlines()
    assert lines[0].startswith("step   0") and "rescaled" in lines[-1]
    riemann = [float(line.rsplit(" ", 1)[-1]) for line in lines[-2:]]
    assert riemann[0] == pytest.approx(riemann[1], rel=1e-6)
    sharp = [float(line.rsplit(" ", 1)[-1]) for line in lines if "geodesic sharpness" in line]
    assert len(sharp) == 2 and sharp[0] > 0
    assert sharp[0] == pytest.approx(sharp[1], rel=1e-4)  # measured on the model, orbit-invariant
