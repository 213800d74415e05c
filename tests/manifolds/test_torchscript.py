"""quotientgeo without geoopt's TorchScript.

geoopt 0.5.1 compiles 73 helpers with ``torch.jit.script`` when it is imported (its
stereographic and Lorentz models, its linear algebra and sign utilities). TorchScript is
deprecated, and unsupported from Python 3.14. quotientgeo calls none of those helpers: it uses
geoopt's ``Manifold`` base class, ``ManifoldParameter`` and Riemannian optimizers, which are
plain Python. So quotientgeo computes the same with every scripted helper broken, and with
``PYTORCH_JIT=0``, under which ``torch.jit.script`` returns each function as it is and geoopt
imports without compiling anything: the fallback where scripting fails on import.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

WORKLOAD = """
import sys

import geoopt
import torch

from quotientgeo import GLQuotient, geodesic_sharpness
from quotientgeo.testing import TinyTransformerClassifier, cross_entropy


def workload():
    '''The manifold's maps, geoopt's Riemannian Adam on it, and a geodesic sharpness.'''
    torch.manual_seed(0)
    m = GLQuotient(n=6, metric="mix")
    x = m.random(3, 10, 2, dtype=torch.float64)
    xi = m.proju(x, torch.randn_like(x))
    values = [m.inner(x, xi).sum(), m.expmap2(x, 0.1 * xi).sum(), m.retr(x, 0.1 * xi).sum()]
    p = geoopt.ManifoldParameter(x.clone(), manifold=m)
    opt = geoopt.optim.RiemannianAdam([p], lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        p.square().sum().backward()
        opt.step()
    values.append(p.detach().sum())
    model = TinyTransformerClassifier(d=8, heads=2, layers=1, classes=3).double().eval()
    batch = (torch.randn(4, 5, 8, dtype=torch.float64), torch.randint(0, 3, (4,)))
    result = geodesic_sharpness(model, cross_entropy, [batch], rho=0.05, n_iter=3, progress=False)
    values.append(torch.tensor(result.value, dtype=torch.float64))
    return torch.stack(values)


def scripted_helpers():
    '''(module, name) of every compiled function in geoopt's modules.'''
    return [
        (module, name)
        for module_name, module in sorted(sys.modules.items())
        if module_name == "geoopt" or module_name.startswith("geoopt.")
        for name, value in sorted(vars(module).items())
        if isinstance(value, torch.jit.ScriptFunction)
    ]
"""


def _namespace() -> dict:
    namespace: dict = {}
    exec(WORKLOAD, namespace)
    return namespace


def test_quotientgeo_calls_none_of_geoopts_scripted_helpers(monkeypatch):
    """Every compiled geoopt helper replaced by one that raises: the same values."""
    ns = _namespace()
    expected = ns["workload"]()
    helpers = ns["scripted_helpers"]()
    if torch.jit._state._enabled:  # under PYTORCH_JIT=0 nothing is compiled
        assert len(helpers) >= 50, len(helpers)

    def broken(*args, **kwargs):
        raise AssertionError("quotientgeo called a TorchScript helper of geoopt")

    for module, name in helpers:
        monkeypatch.setattr(module, name, broken)
    torch.testing.assert_close(ns["workload"](), expected, rtol=0, atol=0)


def test_geoopt_without_torchscript_gives_the_same_values():
    """``PYTORCH_JIT=0`` in a fresh interpreter: geoopt compiles nothing, quotientgeo imports
    and its values are those computed here, with geoopt's helpers compiled (or not, as this
    process was started)."""
    probe = WORKLOAD + (
        "torch.set_num_threads(1)\n"
        "import quotientgeo\n"
        "assert not scripted_helpers(), scripted_helpers()[:3]\n"
        "print(repr(workload().tolist()))\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTORCH_JIT": "0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    values = torch.tensor(eval(done.stdout.strip().splitlines()[-1]), dtype=torch.float64)
    torch.testing.assert_close(values, _namespace()["workload"](), rtol=0, atol=0)
