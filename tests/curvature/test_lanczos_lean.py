"""The lean Lanczos recurrence (method="lanczos_lean"): its extreme eigenvalue equals the dense
one, its residual bound holds the true error, it keeps few vectors, and it refuses k > 1."""

from __future__ import annotations

import warnings

import pytest
import torch
from curvature_models import TwoFactor, cubic_loss, data, tiny_transformer
from hypothesis import given, settings
from hypothesis import strategies as st

import quotientgeo as qg
from quotientgeo.curvature.lanczos import lanczos_extreme
from quotientgeo.curvature.operator import _SymmetricOperator
from quotientgeo.testing import cross_entropy


class Dense(_SymmetricOperator):
    """A dense symmetric matrix as an operator; counts the vectors it multiplies."""

    def __init__(self, A: torch.Tensor):
        self.A = A
        self.shape = tuple(A.shape)
        self.dtype = A.dtype
        self.device = A.device
        self.products = 0

    def _matmat(self, Z):
        self.products += Z.shape[1]
        return self.A @ Z


def spectrum_matrix(values: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(len(values), len(values), generator=gen, dtype=values.dtype))
    return (Q * values) @ Q.T


@settings(max_examples=25, deadline=None)
@given(
    dim=st.integers(8, 60),
    seed=st.integers(0, 2**16),
    gap=st.floats(0.05, 1.0),
    largest=st.booleans(),
)
def test_extreme_eigenvalue_of_a_matrix(dim, seed, gap, largest):
    gen = torch.Generator().manual_seed(seed + 1)
    values = torch.rand(dim, generator=gen, dtype=torch.float64) * 2 - 1
    values[0] = 1 + gap  # an isolated top and bottom
    values[1] = -1 - gap
    A = Dense(spectrum_matrix(values, seed))
    found = lanczos_extreme(A, largest=largest, tol=1e-12, max_iter=4 * dim, seed=seed)
    target = float(values.max() if largest else values.min())
    assert found.converged
    assert found.value == pytest.approx(target, rel=1e-8)
    assert found.residual_bound <= 1e-12 * abs(found.value)
    assert found.iterations == A.products <= 4 * dim


@settings(max_examples=25, deadline=None)
@given(dim=st.integers(30, 80), seed=st.integers(0, 2**16), steps=st.integers(2, 12))
def test_residual_bound_holds_the_error_of_an_unconverged_value(dim, seed, steps):
    """After a few steps, the distance from the Ritz value to the spectrum is within the bound,
    and the Ritz value lies inside the spectrum (below the top eigenvalue)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(dim, generator=gen, dtype=torch.float64)
    A = Dense(spectrum_matrix(values, seed))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        found = lanczos_extreme(A, tol=1e-14, max_iter=steps, seed=seed)
    nearest = float((values - found.value).abs().min())
    assert nearest <= found.residual_bound * (1 + 1e-9) + 1e-13
    assert found.value <= float(values.max()) + 1e-12


def test_ghosts_do_not_move_the_extreme_value():
    """More steps than the dimension (exact arithmetic would stop at 40), possible only as the
    vectors lost their orthogonality: the converged top value stays the top eigenvalue."""
    values = torch.linspace(0, 1, 40, dtype=torch.float64) ** 3
    A = Dense(spectrum_matrix(values, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        found = lanczos_extreme(A, tol=1e-300, max_iter=200, seed=3)
    assert found.iterations > 40
    assert found.value == pytest.approx(1.0, rel=1e-12)


def test_too_few_iterations_warn_and_report_the_bound():
    values = torch.linspace(-1, 1, 50, dtype=torch.float64)
    A = Dense(spectrum_matrix(values, 1))
    with pytest.warns(RuntimeWarning, match="did not reach tol"):
        found = lanczos_extreme(A, tol=1e-10, max_iter=3, seed=0)
    assert not found.converged and found.iterations == 3
    assert 1.0 - found.value <= found.residual_bound


def test_an_invariant_start_stops_with_the_exact_value():
    A = Dense(torch.diag(torch.tensor([3.0, 3.0, 3.0], dtype=torch.float64)))
    found = lanczos_extreme(A, tol=1e-300, max_iter=10)
    assert found.converged and found.iterations == 1 and found.value == pytest.approx(3.0)


@pytest.mark.parametrize("which", ["largest", "smallest"])
@pytest.mark.parametrize("shape", [(5, 4, 2, 0), (7, 3, 2, 1), (6, 6, 3, 2)])
def test_equals_the_dense_eigenvalue_of_the_hessian(which, shape):
    n, m, h, seed = shape
    model = TwoFactor(n, m, h, bias=True, seed=seed)
    batches = data(d_in=n, d_out=m, seed=seed + 1)
    kw = dict(symmetries=model.geometry("inv"), which=which, progress=False)
    exact = qg.hessian_eigenvalues(model, cubic_loss, batches, method="exact", **kw)
    lean = qg.hessian_eigenvalues(
        model, cubic_loss, batches, method="lanczos_lean", tol=1e-12, seed=seed, **kw
    )
    assert lean.values == pytest.approx(exact.values, rel=1e-8)
    assert lean.residual_bound is not None and exact.residual_bound is None
    assert lean.residual_bound <= 1e-12 * abs(lean.values[0])
    assert lean.settings["method"] == "lanczos_lean"


def test_equals_arpack_on_a_transformer_also_per_block():
    model, batches = tiny_transformer()
    kw = dict(per_block=True, tol=1e-12, progress=False)
    arpack = qg.hessian_eigenvalues(model, cross_entropy, batches, method="lanczos", **kw)
    lean = qg.hessian_eigenvalues(model, cross_entropy, batches, method="lanczos_lean", **kw)
    assert lean.values == pytest.approx(arpack.values, rel=1e-8)
    assert lean.per_block is not None and arpack.per_block is not None
    for a, b in zip(lean.per_block, arpack.per_block, strict=True):
        assert a.values == pytest.approx(b.values, rel=1e-8)
        assert (a.residual_bound is None) == (b.dim <= 64)  # small groups: dense
    assert "±" in repr(lean)


def test_two_vectors_of_the_operator_size_are_alive_at_each_product():
    """The recurrence's tensors of size D alive at each product: ``v_j`` and ``v_{j-1}``."""
    A = spectrum_matrix(torch.linspace(0, 1, 30, dtype=torch.float64), 0)

    class Watching(Dense):
        def _matmat(self, Z):
            alive = [
                t
                for t in gc_tensors()
                if t.numel() == self.shape[0] and t.dim() == 1 and t.data_ptr() != 0
            ]
            self.alive = max(getattr(self, "alive", 0), len({t.data_ptr() for t in alive}))
            return super()._matmat(Z)

    op = Watching(A)
    lanczos_extreme(op, tol=1e-10, max_iter=30)
    assert op.alive == 2  # v_j and v_{j-1} (the count sees them: it is 2, not 0)


def gc_tensors():
    import gc

    return [o for o in gc.get_objects() if type(o) is torch.Tensor]


def test_bad_input():
    model, batches = TwoFactor(), data()
    kw = dict(symmetries=model.geometry(), method="lanczos_lean", progress=False)
    with pytest.raises(ValueError, match="one eigenvalue"):
        qg.hessian_eigenvalues(model, cubic_loss, batches, k=2, **kw)
    with pytest.raises(ValueError, match="tol"):
        qg.hessian_eigenvalues(model, cubic_loss, batches, tol=0.0, **kw)
    with pytest.raises(ValueError, match="max_iter"):
        qg.hessian_eigenvalues(model, cubic_loss, batches, max_iter=0, **kw)
    A = Dense(torch.eye(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="max_iter"):
        lanczos_extreme(A, max_iter=0)
    with pytest.raises(ValueError, match="tol"):
        lanczos_extreme(A, tol=-1.0)
    with pytest.raises(ValueError, match="lanczos_lean"):
        qg.hessian_eigenvalues(model, cubic_loss, batches, **(kw | {"method": "lean"}))


def test_the_finite_difference_step_reaches_the_operator():
    """``step`` of the functions is the operator's: the settings record it, the values follow
    it (the central difference's error is O(t²)), and a bad one is refused."""
    model, batches = TwoFactor(bias=True), data()
    kw = dict(symmetries=model.geometry(), product="finite_difference", progress=False)
    exact = qg.hessian_trace(
        model, cubic_loss, batches, method="exact", **kw | {"product": "double_backward"}
    )
    errors = []
    for step in (1e-2, 1e-3):
        found = qg.hessian_trace(model, cubic_loss, batches, method="exact", step=step, **kw)
        assert found.settings["step"] == step
        errors.append(abs(found.value - exact.value))
    assert errors[1] < errors[0] / 50  # O(t²): 100 times smaller, up to rounding
    for fn in (qg.hessian_trace, qg.hessian_eigenvalues, qg.hessian_density):
        with pytest.raises(ValueError, match="step"):
            fn(model, cubic_loss, batches, step=0.0, **kw)


def test_with_the_finite_difference_product_and_the_model_restored():
    model, batches = TwoFactor(6, 5, 2, bias=True, seed=3), data(d_in=6, d_out=5, seed=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    kw = dict(symmetries=model.geometry(), progress=False)
    exact = qg.hessian_eigenvalues(model, cubic_loss, batches, method="exact", **kw)
    lean = qg.hessian_eigenvalues(
        model, cubic_loss, batches, method="lanczos_lean", product="finite_difference",
        tol=1e-10, **kw,
    )  # fmt: skip
    assert lean.values == pytest.approx(exact.values, rel=1e-7)  # the difference's O(t²)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None
