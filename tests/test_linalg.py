"""Batched linear-algebra helpers: Gram/eps relaxation, Cholesky errors, Sylvester, CG."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given
from hypothesis import strategies as st

from quotientgeo.linalg import (
    cholesky,
    conjugate_gradient,
    gram,
    mT,
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
