"""Invariance: a model moved along the orbits of its symmetries has the same quotient Hessian
trace and eigenvalues (to 1e-9 relative in float64), while the Euclidean figures move."""

from __future__ import annotations

import pytest
import torch
from curvature_models import tiny_transformer

import quotientgeo as qg
from quotientgeo.testing import cross_entropy, moved_along_orbits


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b))


@pytest.fixture(scope="module")
def models():
    model, batches = tiny_transformer()
    return model, moved_along_orbits(model, seed=3, condition=25), batches


EXACT = dict(method="exact", per_block=True, progress=False, chunk_size=64)


@pytest.mark.parametrize("metric", ["mix", "inv"])
def test_exact_trace_is_invariant(models, metric):
    model, moved, batches = models
    kw = EXACT
    a = qg.hessian_trace(model, cross_entropy, batches, metric=metric, **kw)
    b = qg.hessian_trace(moved, cross_entropy, batches, metric=metric, **kw)
    assert relative(a.value, b.value) < 1e-9
    assert a.per_block is not None and b.per_block is not None
    for x, y in zip(a.per_block, b.per_block, strict=True):
        assert x.name == y.name
        assert relative(x.value, y.value) < 1e-9, x.name


def test_exact_euclidean_trace_is_not_invariant(models):
    model, moved, batches = models
    e = [
        qg.hessian_trace(m, cross_entropy, batches, geometry="euclidean", **EXACT)
        for m in (model, moved)
    ]
    assert relative(e[0].value, e[1].value) > 1e-2
    attention = [x for x in e[0].per_block or [] if x.kind == "attention"]
    moved_attention = [x for x in e[1].per_block or [] if x.kind == "attention"]
    assert relative(attention[0].value, moved_attention[0].value) > 1e-2


def test_converged_top_eigenvalues_are_invariant_and_the_euclidean_ones_are_not(models):
    model, moved, batches = models
    kw = dict(k=3, tol=1e-13, progress=False)
    a = qg.hessian_eigenvalues(model, cross_entropy, batches, **kw)
    b = qg.hessian_eigenvalues(moved, cross_entropy, batches, **kw)
    for x, y in zip(a.values, b.values, strict=True):
        assert relative(x, y) < 1e-9
    e = [
        qg.hessian_eigenvalues(m, cross_entropy, batches, geometry="euclidean", **kw)
        for m in (model, moved)
    ]
    assert relative(e[0].values[0], e[1].values[0]) > 1e-2


def test_a_hugging_face_model_with_dict_batches():
    pytest.importorskip("transformers")
    from quotientgeo.testing.models import tiny_bert

    model = tiny_bert()
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 40, (4, 6), generator=gen)} for _ in range(2)]

    def loss_fn(m, batch):
        return m(**batch).last_hidden_state.pow(2).mean()

    kw = dict(k=2, tol=1e-12, progress=False)
    a = qg.hessian_eigenvalues(model, loss_fn, batches, **kw)
    b = qg.hessian_eigenvalues(moved_along_orbits(model, seed=1), loss_fn, batches, **kw)
    assert a.settings["symmetric_blocks"] == 4  # QK and VO of both layers
    for x, y in zip(a.values, b.values, strict=True):
        assert relative(x, y) < 1e-9
