"""Batched linear-algebra helpers: Gram/eps relaxation, Cholesky errors, Sylvester, CG."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given
from hypothesis import strategies as st

from quotientgeo import linalg
from quotientgeo.bench.cost import CostCounter
from quotientgeo.linalg import (
    DeferredChecks,
    cholesky,
    conjugate_gradient,
    deferred_checks,
    expm,
    gram,
    matmul_add,
    mT,
    one_norms,
    solve_sylvester,
    sylvester_basis,
    sym,
)
from quotientgeo.testing.numerics import conditioned, gen, rel_err, tol
from quotientgeo.testing.strategies import BATCHES, DTYPES


@st.composite
def spd_pairs(draw):
    dtype = draw(st.sampled_from(DTYPES))
    batch = draw(st.sampled_from(BATCHES))
    h = draw(st.integers(1, 6))
    cond = 10 ** draw(st.floats(0, 1.5))
    g = gen(draw(st.integers(0, 2**31 - 1)))
    F = conditioned(batch, h + 2, h, cond, g)
    K = conditioned(batch, h + 3, h, cond, g)
    B = torch.randn(*batch, h, h, generator=g, dtype=torch.float64)
    return mT(F) @ F, mT(K) @ K, B, dtype


def test_mT_sym_gram():
    a = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    assert torch.equal(mT(a), a.transpose(-1, -2))
    s = sym(a[..., :4])
    assert torch.equal(s, mT(s))
    g = gram(a, 0.5)
    assert torch.allclose(g, mT(a) @ a + 0.5 * torch.eye(5, dtype=torch.float64))
    assert torch.equal(gram(a), mT(a) @ a)
    assert gram(a.float(), 1e-3).dtype == torch.float32


def test_cholesky_error_names_what_and_suggests_eps():
    singular = torch.zeros(2, 3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"HᵀH is not positive definite.*eps") as info:
        cholesky(singular, "HᵀH")
    assert isinstance(info.value.__cause__, torch.linalg.LinAlgError)
    spd = torch.eye(3, dtype=torch.float64) * 4
    assert torch.allclose(cholesky(spd), 2 * torch.eye(3, dtype=torch.float64))


@given(n=st.integers(1, 5), bad=st.integers(-1, 4), batch=st.sampled_from(BATCHES))
def test_deferred_checks_read_once_and_raise_the_first_failure(n, bad, batch):
    """Inside :func:`deferred_checks` ``n`` factorisations make no host read; leaving the block
    reads once, and raises the error of the first that failed (``bad``; ``-1``: none)."""
    spd = torch.eye(3, dtype=torch.float64).expand(*batch, 3, 3) * 4
    singular = spd.clone()
    singular.view(-1, 3, 3)[-1, 2, 2] = 0.0  # the last batch entry is singular
    mats = [singular if i == bad else spd for i in range(n)]
    fails = 0 <= bad < n
    factors, error = [], None
    with CostCounter() as counter:
        try:
            with deferred_checks():
                factors = [cholesky(m, f"matrix {i}") for i, m in enumerate(mats)]
                inside = counter.host_reads
        except ValueError as err:
            error = str(err)
    assert inside == 0
    if fails:
        assert error is not None and f"matrix {bad} is not positive definite" in error
    else:
        assert error is None
        for L in factors:
            torch.testing.assert_close(L, 2 * torch.eye(3, dtype=torch.float64).expand_as(L))
    # one read to find out, and one per factorisation up to the failed one to name it
    assert counter.host_reads == (1 + bad + 1 if fails else 1)


def test_deferred_checks_pass_exceptions_and_nest():
    """An exception of the block passes unchanged (nothing is read); a nested block checks its
    own factorisations; outside any block :func:`cholesky` checks at once again."""
    singular = torch.zeros(3, 3, dtype=torch.float64)
    with pytest.raises(KeyError), deferred_checks():
        cholesky(singular, "GᵀG")
        raise KeyError("mine")
    with pytest.raises(ValueError, match="inner"), deferred_checks():
        with deferred_checks():
            cholesky(singular, "inner")
        cholesky(singular, "outer")
    with pytest.raises(ValueError, match="outer"), deferred_checks():
        with deferred_checks():
            cholesky(torch.eye(3), "inner")
        cholesky(singular, "outer")
    with pytest.raises(ValueError, match="at once"):
        cholesky(singular, "at once")


@given(
    flags=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=0, max_size=5),
    batch=st.sampled_from(BATCHES),
)
def test_deferred_checks_of_both_polarities(flags, batch):
    """Checks recorded as failure flags (nonzero where a check failed) and as ``held`` flags
    (true where it held), in any mix: :meth:`DeferredChecks.failed` is whether any failed, and
    :meth:`DeferredChecks.raise_failed` raises the first that failed, in recording order."""
    checks = DeferredChecks()
    for i, (held, fails) in enumerate(flags):
        flag = torch.zeros(batch, dtype=torch.bool)
        if fails:  # the last entry of the batch fails
            flag.view(-1)[-1:] = True
        if held:
            flag = ~flag
        checks.record(flag, lambda i=i: ValueError(f"check {i}"), held=held)
    failing = [i for i, (_, fails) in enumerate(flags) if fails and math.prod(batch) > 0]
    failed = checks.failed()
    assert (failed is None) == (not flags)
    if failed is not None:
        assert bool(failed) == bool(failing)
    if failing:
        with pytest.raises(ValueError, match=f"check {failing[0]}$"):
            checks.raise_failed()
    else:
        checks.raise_failed()
    assert not checks.pending


@given(
    batch=st.sampled_from([(), (0,), (1,), (3,), (2, 3)]),
    n=st.integers(1, 4),
    k=st.integers(1, 4),
    m=st.integers(1, 4),
    beta=st.sampled_from([1.0, -1.0, 0.5]),
    alpha=st.sampled_from([1.0, -1.0, 2.0]),
    views=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matmul_add(batch, n, k, m, beta, alpha, views, seed):
    """``β C + α A B`` over any leading dimensions, in one operator where the inputs are a
    contiguous batch or slices and transposes of one (no copy), to rounding in float64."""
    g = gen(seed)
    if views:  # C the top rows of a taller batch, A a transposed batch
        C = torch.randn(*batch, n + 2, m, generator=g, dtype=torch.float64)[..., :n, :]
        A = mT(torch.randn(*batch, k, n, generator=g, dtype=torch.float64))
    else:
        C = torch.randn(*batch, n, m, generator=g, dtype=torch.float64)
        A = torch.randn(*batch, n, k, generator=g, dtype=torch.float64)
    B = torch.randn(*batch, k, m, generator=g, dtype=torch.float64)
    with CostCounter() as counter:
        out = matmul_add(C, A, B, beta=beta, alpha=alpha)
    assert counter.ops == 1
    torch.testing.assert_close(out, beta * C + alpha * (A @ B), rtol=1e-14, atol=1e-14)


@given(spd_pairs())
def test_solve_sylvester_vs_scipy(case):
    """``A X + X A = B`` with ``A = P Q`` (not symmetric), per head against scipy."""
    P, Q, B, dtype = case
    h = P.shape[-1]
    basis = sylvester_basis(P.to(dtype), Q.to(dtype))
    X = solve_sylvester(basis, B.to(dtype))
    assert X.dtype == dtype and X.shape == B.shape
    A = (P @ Q).reshape(-1, h, h).numpy()
    Bn = B.reshape(-1, h, h).numpy()
    ref = np.stack([scipy.linalg.solve_sylvester(a, a, b) for a, b in zip(A, Bn, strict=True)])
    ref = torch.from_numpy(ref).reshape(B.shape)
    cond = (torch.linalg.cond(P) * torch.linalg.cond(Q)).max().item()
    assert rel_err(X, ref) <= tol(dtype, 100) * cond
    # residual of the equation itself
    Ad = (P @ Q).to(dtype)
    assert rel_err(Ad @ X + X @ Ad, B.to(dtype)) <= tol(dtype, 100) * cond


@given(spd_pairs())
def test_sylvester_basis_diagonalises(case):
    """``A = V diag(d) V⁻¹`` with ``V⁻¹ V = I`` and ``d_i + d_j > 0``."""
    P, Q, _, dtype = case
    V, V_inv, denom = sylvester_basis(P.to(dtype), Q.to(dtype))
    h = P.shape[-1]
    eye = torch.eye(h, dtype=torch.float64)
    cond = (torch.linalg.cond(P) * torch.linalg.cond(Q)).max().item()
    assert rel_err(V_inv.double() @ V.double(), eye.expand_as(P)) <= tol(dtype, 100) * math.sqrt(
        cond
    )
    d = torch.diagonal(denom, dim1=-2, dim2=-1) / 2
    A = P @ Q
    assert (
        rel_err(V.double() @ torch.diag_embed(d.double()) @ V_inv.double(), A)
        <= tol(dtype, 100) * cond
    )
    assert bool((denom > 0).all())


@given(st.sampled_from(DTYPES), st.sampled_from(BATCHES), st.integers(1, 8), st.integers(0, 999))
def test_conjugate_gradient_vs_solve(dtype, batch, k, seed):
    g = gen(seed)
    F = conditioned(batch, k + 2, k, 5.0, g)
    A = (mT(F) @ F).to(dtype)
    b = torch.randn(*batch, k, generator=g, dtype=torch.float64).to(dtype)
    x = conjugate_gradient(lambda v: (A @ v.unsqueeze(-1)).squeeze(-1), b, event_dims=1)
    ref = torch.linalg.solve(A.double(), b.double().unsqueeze(-1)).squeeze(-1)
    assert x.dtype == dtype
    assert rel_err(x, ref, 1) <= (1e-11 if dtype == torch.float64 else 1e-4)


def test_conjugate_gradient_zero_rhs_and_matrix_events():
    A = torch.eye(6, dtype=torch.float64) * 3
    b = torch.zeros(2, 2, 3, dtype=torch.float64)
    x = conjugate_gradient(lambda v: 3 * v, b, event_dims=2)
    assert torch.equal(x, b)
    b = torch.randn(2, 2, 3, dtype=torch.float64)
    x = conjugate_gradient(lambda v: (A @ v.reshape(2, 6, 1)).reshape(2, 2, 3), b, event_dims=2)
    assert torch.allclose(x, b / 3, rtol=1e-12, atol=0)


def _old_expm(A: torch.Tensor) -> torch.Tensor:
    """The previous :func:`expm`: one ``s`` for the batch, its largest 1-norm read on the host
    (the reference the new one must equal to rounding): the same Taylor polynomial
    (``squarings=0``) of ``A / 2ˢ``, squared ``s`` times."""
    norm = float(one_norms(A).max())  # rounded as expm's checks round it
    s = max(0, math.ceil(math.log2(norm / 0.5))) if norm > 0 else 0
    E = expm(A / 2.0**s, squarings=0)
    for _ in range(s):
        E = E @ E
    return E


def _rel_errs(E: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (E - ref).norm(dim=(-2, -1)) / ref.norm(dim=(-2, -1))


@given(
    batch=st.sampled_from([(), (1,), (3,), (2, 3)]),
    k=st.integers(1, 7),
    exponents=st.lists(st.floats(-8, 1.5), min_size=1, max_size=6),
    seed=st.integers(0, 2**31 - 1),
    deferred=st.booleans(),
)
def test_expm_agrees_with_matrix_exp_and_scipy(batch, k, exponents, seed, deferred):
    """Per-matrix squarings: every matrix of a batch whose 1-norms span several orders of
    magnitude (``10^-8`` to ``30``) agrees with ``torch.linalg.matrix_exp`` and with
    ``scipy.linalg.expm`` to ``1e-13 · max(1, ‖A‖₁)`` relative in float64, inside a block (no
    host read) or outside (one)."""
    g = gen(seed)
    A = torch.randn(*batch, k, k, generator=g, dtype=torch.float64)
    norms = torch.tensor(exponents, dtype=torch.float64)[
        torch.randint(len(exponents), batch, generator=g)
    ]
    A = A / A.abs().sum(-2).amax(-1)[..., None, None] * (10**norms)[..., None, None]
    with CostCounter() as counter:
        if deferred:
            with deferred_checks():
                E = expm(A)
                inside = counter.host_reads
            assert inside == 0
        else:
            E = expm(A)
    assert counter.host_reads == 1
    ref = torch.linalg.matrix_exp(A)
    flat = A.reshape(-1, k, k).numpy()
    ref_scipy = torch.from_numpy(np.stack([scipy.linalg.expm(a) for a in flat])).reshape(A.shape)

    # the truncation is a relative backward error (of Aᵢ) of order θ¹²/13!: the forward error
    # grows with ‖Aᵢ‖₁ (the previous algorithm's too); 1e-13 up to ‖Aᵢ‖₁ = 1. SciPy's
    # (Al-Mohy & Higham) is the oracle; torch.linalg.matrix_exp is itself off by up to ~1e-12
    # at small norms (its low-degree approximants), so against it the bound adds its own
    # distance from SciPy (triangle inequality)
    bound = 1e-13 * (10**norms).clamp_min(1)
    assert (_rel_errs(E, ref_scipy) <= bound).all()
    assert (_rel_errs(E, ref) <= bound + _rel_errs(ref, ref_scipy)).all()


@pytest.mark.parametrize("deferred", [False, True])
def test_expm_at_norms_on_the_squarings_boundary(deferred):
    """Batches whose largest 1-norm is ``θ·2ˢ`` as the caller computes it (matrices normalised
    by their column sums): the count of squarings chosen on the host and the checks made on
    the device round the norms alike, so no matrix is refused as one that needs a squaring
    more; every result agrees with SciPy."""
    g = gen(2)
    for scale in (0.5, 1.0, 2.0, 4.0) * 10:
        A = torch.randn(3, 5, 5, generator=g, dtype=torch.float64)
        A = A / A.abs().sum(-2).amax(-1)[..., None, None] * scale
        if deferred:
            with deferred_checks():
                E = expm(A)
        else:
            E = expm(A)
        ref = torch.from_numpy(np.stack([scipy.linalg.expm(a) for a in A.numpy()]))
        assert (_rel_errs(E, ref) <= 1e-13 * scale).all()


@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 5))
def test_expm_equals_the_batch_shared_squarings_to_rounding(seed, k):
    """Against the previous algorithm (one ``s``, the batch's largest, so more squarings for
    the smaller matrices of a batch): equal to rounding, and bit for bit for one matrix."""
    g = gen(seed)
    A = torch.randn(4, k, k, generator=g, dtype=torch.float64)
    A = A * torch.tensor([1e-3, 0.1, 1.0, 10.0], dtype=torch.float64)[:, None, None]
    bound = 1e-13 * A.abs().sum(-2).amax(-1).clamp_min(1)
    assert (_rel_errs(expm(A), _old_expm(A)) <= bound).all()
    one = A[3:]  # alone in its batch: the same squarings, the same operations
    assert torch.equal(expm(one), _old_expm(one))


@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 6), batch=st.integers(1, 4))
def test_expm_without_squarings_is_the_scaled_path_and_nan_beyond_it(seed, k, batch):
    """``squarings=0`` skips the scaling (``A`` itself): bit for bit the values and gradients
    of the path with squarings allowed wherever a matrix needs none (``‖A‖₁ ≤ θ``), and
    ``NaN`` for a matrix that needs some, its failure recorded inside deferred checks."""
    g = gen(seed)
    A = torch.randn(batch, k, k, generator=g, dtype=torch.float64)
    A = A / A.abs().sum(-2).amax(-1)[..., None, None] * 0.49
    A[0] *= 3.0  # needs squarings

    def run(squarings):
        a = A.clone().requires_grad_()
        with DeferredChecks(factorisations=False) as checks:
            E = expm(a, squarings)
        (E.nan_to_num() ** 2).sum().backward()
        assert a.grad is not None
        return E.detach(), a.grad, checks.failed()

    E0, grad0, failed0 = run(0)
    E3, grad3, failed3 = run(3)
    assert failed0 is not None and bool(failed0) and failed3 is not None and not bool(failed3)
    assert E0[0].isnan().all() and torch.equal(E0[1:], E3[1:])
    assert torch.equal(grad0[1:], grad3[1:])


@given(
    batch=st.sampled_from([(), (1,), (3,), (2, 3)]),
    k=st.integers(1, 6),
    scale=st.floats(1e-6, 0.5),
    seed=st.integers(0, 2**31 - 1),
)
def test_taylor_polynomial_function_equals_autograd_through_its_products(batch, k, scale, seed):
    """The Taylor polynomial with its own backward pass (the one every reverse-mode
    :func:`expm` uses) against the same polynomial differentiated by autograd through its
    products (the one ``torch.func`` transforms and forward-mode AD use): the values and the
    vector-Jacobian products to rounding in float64, at 1-norms up to ``θ``, for contiguous and
    transposed inputs."""
    g = gen(seed)
    A = torch.randn(*batch, k, k, generator=g, dtype=torch.float64)
    A = A / A.abs().sum(-2).amax(-1)[..., None, None] * scale
    grad = torch.randn(*batch, k, k, generator=g, dtype=torch.float64)
    for B in (A, A.mT):
        B = B.detach().requires_grad_()
        mine, reference = linalg._TaylorPolynomial.apply(B), linalg._taylor(B)
        torch.testing.assert_close(mine, reference, rtol=1e-14, atol=1e-15)
        (vjp,) = torch.autograd.grad(mine, B, grad)
        (expected,) = torch.autograd.grad(reference, B, grad)
        torch.testing.assert_close(vjp, expected, rtol=1e-13, atol=1e-14)


def test_taylor_polynomial_function_passes_gradcheck_and_refuses_a_second_derivative():
    g = gen(3)
    B = (0.3 * torch.randn(2, 4, 4, generator=g, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(linalg._TaylorPolynomial.apply, (B,))
    (vjp,) = torch.autograd.grad(linalg._TaylorPolynomial.apply(B).sum(), B, create_graph=True)
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.autograd.grad(vjp.sum(), B)


def test_expm_under_torch_func_and_forward_ad_differentiates_through_the_products():
    """``torch.func.jvp`` and forward-mode AD take the polynomial's products (the custom
    backward has no forward rule): their tangents agree with ``torch.linalg.matrix_exp``'s."""
    g = gen(4)
    A = 0.4 * torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    V = torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    tangent = torch.func.jvp(lambda a: expm(a, squarings=2), (A,), (V,))[1]
    expected = torch.func.jvp(torch.linalg.matrix_exp, (A,), (V,))[1]
    torch.testing.assert_close(tangent, expected, rtol=1e-12, atol=1e-13)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(A, V)
        out = torch.autograd.forward_ad.unpack_dual(expm(dual, squarings=2)).tangent
    assert out is not None
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-13)


def test_expm_gradient_flows():
    """``gradcheck`` in float64 through the masked squarings, with a batch whose matrices
    need 0, 1 and 3 squarings, inside a block and outside."""
    g = gen(0)
    A = torch.randn(3, 3, 3, generator=g, dtype=torch.float64)
    A = A / A.abs().sum(-2).amax(-1)[..., None, None]
    A = (A * torch.tensor([0.3, 0.9, 3.5], dtype=torch.float64)[:, None, None]).requires_grad_()
    assert torch.autograd.gradcheck(expm, (A,))
    assert torch.autograd.gradcheck(lambda a: expm(a, squarings=3), (A,))

    def deferred(a):
        with deferred_checks():
            return expm(a)

    assert torch.autograd.gradcheck(deferred, (A,))


def test_expm_over_the_bound():
    """A matrix needing more squarings than the bound: inside a block its result is NaN and
    leaving the block raises a ``ValueError`` naming the bound (the others are exact); outside
    a block the bound is checked at once and the batch computed again, exactly."""
    A = torch.stack([0.1 * torch.eye(3), 100 * torch.eye(3)]).to(torch.float64)
    A[1, 0, 1] = 3.0
    ref = torch.linalg.matrix_exp(A)
    with pytest.raises(ValueError, match=r"1-norm above 32 .* 6 squarings"), deferred_checks():
        E = expm(A)
        assert E[1].isnan().all()
        torch.testing.assert_close(E[0], ref[0], rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match=r"1-norm above 2 "), deferred_checks():
        expm(A, squarings=2)
    with CostCounter() as counter:
        E = expm(A, squarings=2)
    assert counter.host_reads == 2  # the check, then the norm of the computation again
    torch.testing.assert_close(E, ref, rtol=1e-13 * 103, atol=0)  # (‖A₁‖₁ = 103)
    checks = DeferredChecks(factorisations=False)
    with checks:
        expm(A)
        L = cholesky(torch.eye(2, dtype=torch.float64))  # checked at once: not deferred
    assert len(checks.pending) == 1 and checks.failed() is not None and bool(checks.failed())
    with pytest.raises(ValueError, match="squarings"):
        checks.raise_failed()
    assert not checks.pending and torch.equal(L, torch.eye(2, dtype=torch.float64))


@pytest.mark.parametrize("deferred", [False, True])
def test_expm_rejects_non_finite(deferred):
    A = torch.eye(2, dtype=torch.float64).repeat(2, 1, 1)
    A[1, 0, 0] = math.nan
    if deferred:
        with pytest.raises(ValueError, match="non-finite"), deferred_checks():
            E = expm(A)
            assert E[1].isnan().all() and not E[0].isnan().any()
    else:
        with pytest.raises(ValueError, match="non-finite"):
            expm(A)


def test_expm_of_empty_and_zero_matrices():
    assert expm(torch.zeros(3, 0, 0)).shape == (3, 0, 0)
    assert torch.equal(expm(torch.zeros(2, 4, 4)), torch.eye(4).expand(2, 4, 4))


def test_expm_first_called_in_inference_mode_still_differentiates():
    """The Taylor coefficients and the identity are made once per dtype and device; made under
    ``torch.inference_mode`` they must still be usable in a graph that autograd differentiates
    (the gradient against ``torch.linalg.matrix_exp``'s)."""
    from quotientgeo import linalg

    linalg._constant.cache_clear()
    linalg._identity.cache_clear()
    gen = torch.Generator().manual_seed(0)
    A = 0.5 * torch.randn(3, 4, 4, generator=gen, dtype=torch.float64)
    with torch.inference_mode():
        expm(A)
    X = A.clone().requires_grad_()
    (expm(X) ** 2).sum().backward()
    Y = A.clone().requires_grad_()
    (torch.linalg.matrix_exp(Y) ** 2).sum().backward()
    torch.testing.assert_close(X.grad, Y.grad, rtol=1e-12, atol=1e-12)


@given(
    batch=st.sampled_from(BATCHES),
    h=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_cholesky_inverse_and_its_derivatives_are_those_of_the_inverse(batch, h, seed):
    """``(L Lᵀ)⁻¹`` and its tangents against ``torch.linalg.inv(L Lᵀ)``'s, in reverse mode,
    under ``torch.func.jvp`` and with forward-mode AD (where ``torch.cholesky_inverse``'s own
    tangent is wrong, and the helper takes another path)."""
    g = gen(seed)
    A = torch.randn(*batch, h, 2 * h, generator=g, dtype=torch.float64)
    L = torch.linalg.cholesky(A @ A.mT + 0.1 * torch.eye(h, dtype=torch.float64))
    tangent = torch.randn(L.shape, generator=g, dtype=torch.float64).tril()

    def inverse(L):
        return torch.linalg.inv(L @ L.mT)

    torch.testing.assert_close(linalg.cholesky_inverse(L), inverse(L), rtol=1e-9, atol=1e-12)
    expected = torch.func.jvp(inverse, (L,), (tangent,))[1]
    jvp = torch.func.jvp(linalg.cholesky_inverse, (L,), (tangent,))[1]
    torch.testing.assert_close(jvp, expected, rtol=1e-9, atol=1e-12)
    with torch.autograd.forward_ad.dual_level():
        dual = linalg.cholesky_inverse(torch.autograd.forward_ad.make_dual(L, tangent))
        forward = torch.autograd.forward_ad.unpack_dual(dual).tangent
    torch.testing.assert_close(forward, expected, rtol=1e-9, atol=1e-12)
    cotangent = torch.randn(L.shape, generator=g, dtype=torch.float64)
    grads = [
        torch.autograd.grad(f(leaf.tril()), leaf, cotangent)[0]  # reverse mode, no transform
        for f, leaf in ((linalg.cholesky_inverse, L.clone().requires_grad_(True)),
                        (inverse, L.clone().requires_grad_(True)))
    ]  # fmt: skip
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("transform", ["jvp", "grad", "vmap"])
def test_cached_identities_and_constants_are_plain_tensors(transform):
    """``identity`` and ``constant`` first made inside a ``torch.func`` transform are cached as
    plain tensors, not as the transform's wrappers (which would outlive it)."""
    size = {"jvp": 17, "grad": 18, "vmap": 19}[transform]  # sizes no other test makes
    made = {}

    def f(x):
        made["eye"] = linalg.identity(size, x)
        made["constant"] = linalg.constant((float(size), 0.5), x)
        return (x * made["constant"][1]).sum()

    x = torch.ones(2, dtype=torch.float64)
    if transform == "jvp":
        torch.func.jvp(f, (x,), (x,))
    elif transform == "grad":
        torch.func.grad(f)(x)
    else:
        torch.func.vmap(f)(x[None].expand(3, 2))
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for t in (made["eye"], made["constant"]):
        assert not wrapped(t)
        assert t.untyped_storage().nbytes() > 0  # readable outside the transform
    assert linalg.identity(size, x) is made["eye"]
    assert torch.equal(made["eye"], torch.eye(size, dtype=torch.float64))
