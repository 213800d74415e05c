"""Agreement with independent computations: with geometry="euclidean" the operator is the
plain Hessian (torch.func.hessian, torch.autograd.functional.hessian, curvlinops'
HessianLinearOperator); with every parameter adaptive it is diag(|w|) ∇²f diag(|w|); the
functions' figures equal those of the dense matrix."""

from __future__ import annotations

import pytest
import torch
from curvature_models import TwoFactor, cubic_loss, data, squared_error, tiny_transformer
from torch.nn.attention import SDPBackend, sdpa_kernel

import quotientgeo as qg
from quotientgeo.curvature import RiemannianHessian
from quotientgeo.testing import cross_entropy


def permutation(hessian: RiemannianHessian, names: list[str]) -> torch.Tensor:
    """``P`` with ``P v`` the parameter-ordered entries of operator coordinates ``v``."""
    eye = torch.eye(hessian.dim, dtype=hessian.dtype)
    columns = []
    for col in eye:
        params = hessian.to_parameters(col)
        columns.append(torch.cat([params[n].reshape(-1) for n in names]))
    return torch.stack(columns, dim=1)


def dense_hessian(model, loss_fn, batches, *, forward_mode=True):
    """``∇²f`` in parameter order (``torch.func.hessian``, or reverse-over-reverse)."""
    names = [n for n, _ in model.named_parameters()]
    shapes = {n: p.shape for n, p in model.named_parameters()}
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    sizes = [p.numel() for p in model.parameters()]

    def f(v):
        params = {n: t.reshape(shapes[n]) for n, t in zip(names, v.split(sizes), strict=True)}
        call = lambda x: torch.func.functional_call(model, params, (x,))  # noqa: E731
        with sdpa_kernel(SDPBackend.MATH):
            return sum(loss_fn(call, b) for b in batches) / len(batches)

    if forward_mode:
        return names, flat, torch.func.hessian(f)(flat)
    return names, flat, torch.autograd.functional.hessian(f, flat)


def test_euclidean_operator_is_torch_func_hessian():
    model, batches = TwoFactor(bias=True), data()
    hessian = RiemannianHessian(
        model, cubic_loss, batches, symmetries=model.geometry(), geometry="euclidean"
    )
    names, _, H = dense_hessian(model, cubic_loss, batches)
    P = permutation(hessian, names)
    assert torch.allclose(P @ hessian.to_dense() @ P.T, H, rtol=1e-12, atol=1e-12)


def test_adaptive_geometry_is_the_hessian_scaled_by_the_weights():
    model, batches = TwoFactor(bias=True), data()
    hessian = RiemannianHessian(model, cubic_loss, batches, symmetries=None)
    names, flat, H = dense_hessian(model, cubic_loss, batches)
    P = permutation(hessian, names)
    scale = torch.diag(flat.abs())
    assert torch.allclose(P @ hessian.to_dense() @ P.T, scale @ H @ scale, rtol=1e-12, atol=1e-12)


def test_euclidean_operator_of_a_transformer_is_its_hessian():
    model, batches = tiny_transformer()
    hessian = RiemannianHessian(model, cross_entropy, batches, geometry="euclidean")
    # reverse over reverse: torch.func.hessian's forward mode gives an asymmetric matrix here
    names, _, H = dense_hessian(model, cross_entropy, batches, forward_mode=False)
    P = permutation(hessian, names)
    assert torch.allclose(P @ hessian.to_dense() @ P.T, H, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("geometry", ["riemannian", "euclidean"])
def test_functions_agree_with_the_dense_matrix(geometry):
    model, batches = TwoFactor(6, 5, 2, bias=True), data(d_in=6, d_out=5)
    kw = dict(symmetries=model.geometry("inv"), geometry=geometry, progress=False)
    A = RiemannianHessian(
        model, cubic_loss, batches, symmetries=kw["symmetries"], geometry=geometry
    )
    eigenvalues = torch.linalg.eigvalsh(A.to_dense())
    top, bottom = eigenvalues.flip(0)[:3].tolist(), eigenvalues[:3].tolist()
    trace = qg.hessian_trace(model, cubic_loss, batches, method="exact", per_block=True, **kw)
    assert trace.value == pytest.approx(float(eigenvalues.sum()), rel=1e-12)
    assert trace.per_block is not None
    assert sum(b.value for b in trace.per_block) == pytest.approx(trace.value, rel=1e-12)
    for method in ("lanczos", "lobpcg", "exact"):
        found = qg.hessian_eigenvalues(model, cubic_loss, batches, k=3, method=method, **kw)
        assert found.values == pytest.approx(top, rel=1e-7), method
    low = qg.hessian_eigenvalues(model, cubic_loss, batches, k=3, which="smallest", **kw)
    assert low.values == pytest.approx(bottom, rel=1e-7, abs=1e-9)


def test_curvlinops_hessian_and_estimators_agree():
    curvlinops = pytest.importorskip("curvlinops")
    model, batches = TwoFactor(bias=True), data()
    hessian = RiemannianHessian(
        model, squared_error, batches, symmetries=model.geometry(), geometry="euclidean"
    )
    names = [n for n, _ in model.named_parameters()]
    theirs = curvlinops.HessianLinearOperator(
        model,
        torch.nn.MSELoss(),
        list(model.parameters()),
        batches,
        progressbar=False,
    )
    P = permutation(hessian, names)
    eye = torch.eye(hessian.dim, dtype=torch.float64)
    assert torch.allclose(P @ hessian.to_dense() @ P.T, theirs @ eye, rtol=1e-12, atol=1e-12)
    # the operator is one their estimators take: same probes, same value
    for method, estimator in (("hutch++", curvlinops.hutchpp_trace), ("xtrace", curvlinops.xtrace)):
        ours = qg.hessian_trace(
            model, squared_error, batches, symmetries=model.geometry(), geometry="euclidean",
            method=method, n_probes=12, seed=5, progress=False,
        )  # fmt: skip
        torch.manual_seed(5)
        assert ours.value == pytest.approx(float(estimator(hessian, 12)), rel=1e-12)
