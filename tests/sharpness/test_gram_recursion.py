"""After a step, the Gram pass takes only the products with the gradient.

``ξ_{k+1} = c · (ξ_k, ξ_{k-1}, g)``, so the iterates' own products after the step follow from
the last Gram matrix ``K``: ``<ξ_{k+1}, ξ_{k+1}> = cᵀ K c``, ``<ξ_{k+1}, ξ_k> = (K c)₀``,
``<ξ_k, ξ_k> = K₀₀``; after a restart both iterates are the best one, whose square norm was
known when it was kept. Here: the formulas against the products of explicit vectors, and whole
Auto-PGD runs (restarts included) against the same runs with every Gram pass taken whole, in
float64. Tolerance: relative ``1e-10`` (the kept products are those of the exact combination,
the full pass's those of the iterates as stored, ``x₀ + ξ`` rounded: the two differ at the
level of rounding, ``1e-14`` here, while a different iterate or restart moves values by
``1e-3`` or more).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quotientgeo import Measure
from quotientgeo.sharpness import objective as ob
from quotientgeo.testing import TinyTransformerClassifier, cross_entropy, random_batches


@settings(max_examples=30, deadline=None)
@given(n=st.integers(3, 50), seed=st.integers(0, 2**16))
def test_the_kept_products_are_those_of_the_combination(n, seed):
    gen = torch.Generator().manual_seed(seed)
    vectors = torch.randn(3, n, generator=gen, dtype=torch.float64)  # ξ_k, ξ_{k-1}, g
    metric = torch.rand(n, generator=gen, dtype=torch.float64) + 0.1  # a diagonal metric
    K = (vectors * metric) @ vectors.T
    c = torch.randn(3, generator=gen, dtype=torch.float64)
    new = c @ vectors  # ξ_{k+1}
    block = ob._next_block(K, c)
    expected = ((new * metric) @ new, (new * metric) @ vectors[0], K[0, 0])
    for got, want in zip(block, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # and K again from its block and its last column
    assert torch.equal(ob._bordered((K[0, 0], K[0, 1], K[1, 1]), K[:, 2]), ob.mirror_upper(K))


def _run(measure, model, batches, *, recursion: bool, monkeypatch):
    counts = {"row passes": 0, "restarts": 0}
    bordered, restart, init = ob._bordered, ob.Objective.restart, ob.Objective.__init__

    def counting_bordered(*args):
        counts["row passes"] += 1
        return bordered(*args)

    def counting_restart(self, *args):
        counts["restarts"] += 1
        return restart(self, *args)

    def without_recursion(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._exact_iterates = self._exact_iterates and recursion

    with monkeypatch.context() as mp:
        mp.setattr(ob, "_bordered", counting_bordered)
        mp.setattr(ob.Objective, "restart", counting_restart)
        mp.setattr(ob.Objective, "__init__", without_recursion)
        result = measure.evaluate(model, cross_entropy, batches, progress=False,
                                  return_perturbation=True)  # fmt: skip
    return result, counts


@pytest.mark.parametrize(
    "measure",
    [
        Measure.adaptive(0.1, n_iter=16),
        Measure.geodesic(0.1, metric="mix", n_iter=16),
        Measure.geodesic(0.1, metric="inv", perturbation="exact", n_iter=16),
    ],
    ids=["adaptive", "geodesic_mix", "geodesic_inv_exact"],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_auto_pgd_runs_as_with_whole_gram_passes(measure, seed, monkeypatch):
    torch.manual_seed(seed)
    model = TinyTransformerClassifier(16, 2, 2, classes=3).to(torch.float64).eval()
    batches = random_batches(2, batch=6, seq=5, d=16, seed=seed + 3)
    kept, counts = _run(measure, model, batches, recursion=True, monkeypatch=monkeypatch)
    whole, none = _run(measure, model, batches, recursion=False, monkeypatch=monkeypatch)
    # one whole pass per run (the first iteration), every other one by the kept products,
    # after a restart too (both runs restart at the same checkpoints)
    assert counts["restarts"] > 0
    assert counts["row passes"] == len(batches) * (16 - 1)
    assert none["row passes"] == 0 and none["restarts"] == counts["restarts"]
    torch.testing.assert_close(kept.per_batch, whole.per_batch, rtol=1e-10, atol=0)
    torch.testing.assert_close(kept.trace, whole.trace, rtol=1e-10, atol=0)
    assert kept.perturbations is not None and whole.perturbations is not None
    for a, b in zip(kept.perturbations, whole.perturbations, strict=True):
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-10, atol=1e-14)


@pytest.mark.filterwarnings("ignore:the model has torch.bfloat16 parameters")
def test_iterates_kept_in_lower_precision_take_whole_passes(monkeypatch):
    """Iterates stored in bfloat16 are not the combination the step computed: every Gram
    pass is whole."""
    torch.manual_seed(0)
    model = TinyTransformerClassifier(16, 2, 1, classes=3).to(torch.bfloat16).eval()
    batches = [
        tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in batch)
        for batch in random_batches(1, batch=6, seq=5, d=16, seed=3)
    ]
    _, counts = _run(
        Measure.adaptive(0.1, n_iter=6), model, batches, recursion=True, monkeypatch=monkeypatch
    )
    assert counts["row passes"] == 0
