"""``blockwise``: the block-wise right multiplication ``(u_G W_G, u_H W_H) (+ add)`` of GL
points against one concatenation of the two products, for square (``G`` and ``H`` of as many
rows) and non-square points, with and without ``add``, in place or not, with broadcast
weights, and under ``torch.func``; a non-square point's products both written into the rows of
one output (an accelerator's path, forced here) and concatenated (the CPU's)."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quotientgeo.manifolds.gl import blocks
from quotientgeo.manifolds.gl.blocks import blockwise

SHAPES = st.tuples(
    st.lists(st.integers(1, 3), min_size=0, max_size=2),  # batch dimensions
    st.integers(1, 5),  # n, rows of G
    st.integers(0, 2),  # rows of H beyond n - 1 (m = n - 1 + this)
    st.integers(1, 4),  # h
    st.booleans(),  # the weights broadcast (no batch dimensions of their own)
    st.integers(0, 2**16),
)


def _draw(shape):
    batch, n, extra, h, shared, seed = shape
    m = max(1, n - 1 + extra)
    gen = torch.Generator().manual_seed(seed)
    randn = functools.partial(torch.randn, generator=gen, dtype=torch.float64)
    u = randn(*batch, n + m, h)
    wbatch = () if shared else tuple(batch)
    W_G, W_H = randn(*wbatch, h, h), randn(*wbatch, h, h)
    add = randn(*batch, n + m, h)
    return n, u, W_G, W_H, add


def _reference(n, u, W_G, W_H, add=None):
    out = torch.cat((u[..., :n, :] @ W_G, u[..., n:, :] @ W_H), dim=-2)
    return out if add is None else out + add


def _nan_like(t, **kwargs):
    """``torch.empty_like`` whose new tensors hold NaN: a result that read them would show it."""
    return torch.full_like(t, float("nan"), **kwargs)


@pytest.mark.parametrize("in_rows", [True, False], ids=["rows-in-place", "concatenated"])
@settings(max_examples=60, deadline=None)
@given(shape=SHAPES)
def test_blockwise_equals_the_concatenated_products(in_rows, shape):
    n, u, W_G, W_H, add = _draw(shape)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "empty_like", _nan_like)
        patch.setattr(blocks, "_rows_written_in_place", lambda *tensors: in_rows)
        plain = blockwise(n, u, W_G, W_H)
        added = blockwise(n, u, W_G, W_H, add)
        target = add.clone()
        into = blockwise(n, u, W_G, W_H, target, into=True)
    torch.testing.assert_close(plain, _reference(n, u, W_G, W_H), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(added, _reference(n, u, W_G, W_H, add), rtol=1e-12, atol=1e-12)
    assert into is target  # accumulated in place
    torch.testing.assert_close(into, _reference(n, u, W_G, W_H, add), rtol=1e-12, atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(SHAPES)
def test_blockwise_under_torch_func_equals_the_concatenated_products(shape):
    n, u, W_G, W_H, _ = _draw(shape)
    vmapped = torch.func.vmap(lambda v: blockwise(n, v, W_G, W_H))(u[None].expand(2, *u.shape))
    torch.testing.assert_close(vmapped[1], _reference(n, u, W_G, W_H), rtol=1e-12, atol=1e-12)
    jac = torch.func.jacrev(lambda W: blockwise(n, u, W, W_H))(W_G)
    expected = torch.func.jacrev(lambda W: _reference(n, u, W, W_H))(W_G)
    torch.testing.assert_close(jac, expected, rtol=1e-12, atol=1e-12)


def test_blockwise_backward_equals_the_concatenated_products():
    n, u, W_G, W_H, _ = _draw(((2,), 3, 0, 2, False, 7))  # a non-square point
    u.requires_grad_(True)
    grad = torch.autograd.grad(blockwise(n, u, W_G, W_H).square().sum(), u)[0]
    expected = torch.autograd.grad(_reference(n, u, W_G, W_H).square().sum(), u)[0]
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
