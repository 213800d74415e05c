"""Shared hypothesis settings, strategies and numerical helpers of the test-suite.

Tolerances are stated in units of the dtype's machine epsilon (``tol(dtype, k)`` is
``k · eps``) and, where an operation involves a conditioned matrix, scaled by its condition
number, so that the same property is checked at the same strictness in float32 and float64.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

# geomstats picks its backend when first imported; the property tests use its pytorch backend.
os.environ.setdefault("GEOMSTATS_BACKEND", "pytorch")

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from quotientgeo import GLQuotient, ScaleQuotient
from quotientgeo.manifolds import InterpolatedGLQuotient

# Two xdist workers on two cores: one BLAS thread each avoids oversubscription.
torch.set_num_threads(1)

settings.register_profile(
    "default",
    deadline=None,
    max_examples=12,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "thorough",
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
# CI replays the same examples on every run (a red CI must be reproducible); locally each
# run draws new ones. HYPOTHESIS_PROFILE=thorough for a long search.
settings.register_profile("ci", settings.get_profile("default"), derandomize=True)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default")
)

DTYPES = (torch.float32, torch.float64)
BATCHES = ((), (2,), (2, 3))
METRICS = ("inv", "mix")


# --------------------------------------------------------------------------- numerics
def eps_of(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def tol(dtype: torch.dtype, k: float = 100.0) -> float:
    """``k`` machine epsilons of ``dtype``."""
    return k * eps_of(dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor, event_dims: int = 2) -> float:
    """Largest (over batch entries) ``||a - b|| / ||b||``, computed in float64."""
    a, b = a.double(), b.double()
    dims = tuple(range(-event_dims, 0))
    num = torch.linalg.vector_norm(a - b, dim=dims)
    den = torch.linalg.vector_norm(b, dim=dims).clamp_min(torch.finfo(torch.float64).tiny)
    return (num / den).max().item()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed_gen: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=seed_gen, dtype=torch.float64).to(dtype)


def orthogonal(*shape, g: torch.Generator) -> torch.Tensor:
    """Random matrices with orthonormal columns, ``shape = (..., r, c)``, ``r >= c`` (float64)."""
    q, r = torch.linalg.qr(torch.randn(*shape, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)


def conditioned(batch, rows, cols, cond, g, dtype=torch.float64) -> torch.Tensor:
    """``U diag(s) Vᵀ`` with log-spaced singular values from 1 down to ``1/cond`` (float64 build).

    The spectrum is rescaled to geometric mean 1 so that entries stay of order one.
    """
    k = min(rows, cols)
    U = orthogonal(*batch, rows, k, g=g)
    V = orthogonal(*batch, cols, k, g=g)
    s = torch.logspace(0.0, -math.log10(cond), k, dtype=torch.float64) if k > 1 else None
    if s is None:
        s = torch.ones(1, dtype=torch.float64)
    s = s / s.log().mean().exp()
    return ((U * s) @ V.transpose(-1, -2)).to(dtype)


# --------------------------------------------------------------------------- GL cases
@dataclass
class GLCase:
    """A random GL(h) quotient point with two tangent vectors."""

    manifold: GLQuotient
    x: torch.Tensor
    u: torch.Tensor
    v: torch.Tensor
    batch: tuple
    n: int
    m: int
    h: int
    seed: int

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def group(self, cond: float, seed_offset: int = 1) -> torch.Tensor:
        """A batch of ``A ∈ GL(h)`` with condition number ``cond`` (float64 build)."""
        g = gen(self.seed + 7919 * seed_offset)
        return conditioned(self.batch, self.h, self.h, cond, g, self.dtype)


@st.composite
def gl_cases(
    draw,
    metric=None,
    dtype=None,
    eps: float = 0.0,
    max_h: int = 4,
    max_extra: int = 4,
    factor_cond: float = 10.0,
    batches=BATCHES,
    same_rows: bool | None = None,
):
    """GL(h) quotient cases over shapes, batch dims (none, one, two), seeds and dtypes.

    The factors ``G``, ``H`` get condition numbers up to ``factor_cond`` so that an error bound
    stated in machine epsilons is meaningful in float32 too. ``same_rows`` forces ``n == m``
    (True) or ``n != m`` (False); ``None`` draws either.
    """
    metric = draw(st.sampled_from(METRICS)) if metric is None else metric
    dtype = draw(st.sampled_from(DTYPES)) if dtype is None else dtype
    batch = draw(st.sampled_from(batches))
    h = draw(st.integers(1, max_h))
    n = h + draw(st.integers(0, max_extra))
    m = h + draw(st.integers(0, max_extra))
    if same_rows is not None and (n == m) != same_rows:
        m = n if same_rows else n + 1
    seed = draw(st.integers(0, 2**31 - 1))
    cond_g = draw(st.floats(1.0, factor_cond))
    cond_h = draw(st.floats(1.0, factor_cond))
    g = gen(seed)
    G = conditioned(batch, n, h, cond_g, g)
    H = conditioned(batch, m, h, cond_h, g)
    manifold = GLQuotient(n, metric, eps=eps)
    x = manifold.join(G, H).to(dtype)
    u = torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype)
    return GLCase(manifold, x, u, v, batch, n, m, h, seed)


@pytest.fixture(autouse=True)
def _default_dtype():
    """Tests must not depend on (or leak) the global default dtype."""
    old = torch.get_default_dtype()
    yield
    torch.set_default_dtype(old)


# --------------------------------------------------------------------------- autodiff oracle
def autodiff_christoffel(metric_matrix, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``Γ(u, u) = M⁻¹ [DM[u] u - ½ ∇ₓ(uᵀ M u)]`` from a dense metric matrix ``M(x)``.

    ``metric_matrix`` maps a flat float64 point of length ``N`` to its ``N × N`` metric matrix;
    its derivative is taken by :func:`torch.autograd.functional.jacobian`, independently of the
    library's code paths. ``x`` and ``u`` are single (unbatched) points/vectors of any shape.
    """
    xf = x.detach().double().reshape(-1)
    uf = u.detach().double().reshape(-1)
    M = metric_matrix(xf)
    # J[i, j, k] = ∂M_ij / ∂x_k
    J = torch.autograd.functional.jacobian(metric_matrix, xf, vectorize=True)
    dMuu = torch.einsum("ijk,k,j->i", J, uf, uf)
    grad = torch.einsum("i,ijk,j->k", uf, J, uf)
    return torch.linalg.solve(M, dMuu - 0.5 * grad).reshape(u.shape)


def gl_metric_matrix(n: int, h: int, metric: str, eps: float = 0.0):
    """Dense flattened GL(h) metric for a row-major flattened ``[G; H]``.

    ``tr(W η_Gᵀ ζ_G) = Σ_i η_{G,i} W ζ_{G,i}ᵀ`` over rows, so the G block is ``I_n ⊗ W``.
    """

    def metric_matrix(xf: torch.Tensor) -> torch.Tensor:
        x = xf.reshape(-1, h)
        G, H = x[:n], x[n:]
        eye = torch.eye(h, dtype=xf.dtype)
        P = G.T @ G + eps * eye
        Q = H.T @ H + eps * eye
        WG, WH = (torch.linalg.inv(P), torch.linalg.inv(Q)) if metric == "inv" else (Q, P)
        return torch.block_diag(
            torch.kron(torch.eye(G.shape[0], dtype=xf.dtype), WG.contiguous()),
            torch.kron(torch.eye(H.shape[0], dtype=xf.dtype), WH.contiguous()),
        )

    return metric_matrix


def geomstats_christoffel(metric_matrix, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``Γ^k_ij u^i u^j`` from geomstats' autodiff Christoffel symbols of ``metric_matrix``."""
    pytest.importorskip("geomstats")
    import geomstats.backend as gs
    from geomstats.geometry.euclidean import Euclidean
    from geomstats.geometry.riemannian_metric import RiemannianMetric

    if not gs.__name__.endswith("pytorch"):
        pytest.skip(f"geomstats runs on {gs.__name__}, not its pytorch backend")

    class DenseMetric(RiemannianMetric):
        def metric_matrix(self, base_point=None):
            return metric_matrix(base_point)

    xf = x.detach().double().reshape(-1)
    uf = u.detach().double().reshape(-1)
    metric = DenseMetric(Euclidean(xf.numel(), equip=False))
    gamma = metric.christoffels(xf)  # [k, i, j], contravariant index first
    return torch.einsum("kij,i,j->k", gamma, uf, uf).reshape(u.shape)


# --------------------------------------------------------------------------- Hugging Face models
def tiny_bert(dtype=torch.float64, **overrides):
    """A 2-layer, 4-head, width-16 ``BertModel`` (eager attention) in eval mode, seed 0.

    Skips the test when transformers is not installed; ``overrides`` go to ``BertConfig``.
    """
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=24,
        max_position_embeddings=12,
        attn_implementation="eager",
        **overrides,
    )
    torch.manual_seed(0)
    return transformers.BertModel(config).to(dtype).eval()


def assert_roundtrip_exact(geometry):
    """Scatter of the gathered points rebuilds every parameter bit-exactly, and the
    layer-batched scatter agrees with the per-block one."""
    points, w = geometry.gather()
    out = geometry.scatter(points, w)
    assert set(out) == set(geometry.params)
    for name, p in geometry.params.items():
        assert out[name].dtype == p.dtype and out[name].shape == p.shape
        assert torch.equal(out[name], p), name
    if geometry.plan.stacks is not None:  # the layer-batched and the per-block paths agree
        plan = geometry.plan
        try:
            moved = [x + torch.randn_like(x) for x in points]
            geometry._plan = dataclasses.replace(plan, stacks=None)
            per_block = geometry.scatter(moved, w)
        finally:
            geometry._plan = plan
        for name, value in geometry.scatter(moved, w).items():
            assert torch.equal(value, per_block[name]), name


# Orbit moves that show what an invariant measure must ignore: far from the identity (a scalar
# multiple of the identity leaves adaptive sharpness unchanged too), well inside float64.
ORBIT_CONDITION = 100.0


def relative_change(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def assert_sharpness_invariance(
    model,
    loss_fn,
    batches,
    outputs,
    *,
    rho,
    n_iter,
    scales,
    output_tol=None,
    adaptive_min,
    condition=ORBIT_CONDITION,
):
    """Moving ``model`` along its orbits (``moved_along_orbits`` with each of ``scales``, group
    elements of condition number up to ``condition``) keeps ``outputs(model)`` (to
    ``output_tol``, default float64 exact) and geodesic sharpness for both metrics (to 1e-3
    relative), while adaptive sharpness changes by more than ``adaptive_min`` relative for at
    least one scale."""
    from quotientgeo import adaptive_sharpness, geodesic_sharpness
    from quotientgeo.testing import moved_along_orbits

    def measures(m):
        kw = dict(rho=rho, n_iter=n_iter, progress=False)
        return {
            "mix": geodesic_sharpness(m, loss_fn, batches, metric="mix", **kw).value,
            "inv": geodesic_sharpness(m, loss_fn, batches, metric="inv", **kw).value,
            "adaptive": adaptive_sharpness(m, loss_fn, batches, **kw).value,
        }

    tolerance = dict(rtol=1e-9, atol=1e-10) if output_tol is None else output_tol
    reference = measures(model)
    assert all(v > 0 for v in reference.values())
    adaptive_changes = []
    for i, scale in enumerate(scales):
        moved = moved_along_orbits(model, scale=scale, seed=i, condition=condition)
        torch.testing.assert_close(outputs(moved), outputs(model), **tolerance)
        values = measures(moved)
        for metric in ("mix", "inv"):
            change = relative_change(values[metric], reference[metric])
            assert change < 1e-3, (scale, metric, values, reference)
        adaptive_changes.append(relative_change(values["adaptive"], reference["adaptive"]))
    assert max(adaptive_changes) > adaptive_min, adaptive_changes


# --------------------------------------------------------------------------- model state
def snapshot(model):
    """Identity and a copy of every parameter, buffer and ``.grad``, and every module's mode."""
    return {
        "params": {n: (id(p), p.detach().clone()) for n, p in model.named_parameters()},
        "buffers": {n: (id(b), b.clone()) for n, b in model.named_buffers()},
        "grads": {
            n: None if p.grad is None else (id(p.grad), p.grad.clone())
            for n, p in model.named_parameters()
        },
        "modes": [m.training for m in model.modules()],
    }


def assert_same(a, b):
    """Equal snapshots: the same objects with bit-equal values (NaNs in the same places)."""
    assert a["modes"] == b["modes"]
    for key in ("params", "buffers", "grads"):
        assert a[key].keys() == b[key].keys()
        for n in a[key]:
            if a[key][n] is None:
                assert b[key][n] is None, (key, n)
                continue
            (ia, ta), (ib, tb) = a[key][n], b[key][n]
            assert ia == ib and ta.dtype == tb.dtype, (key, n)
            assert torch.equal(ta.isnan(), tb.isnan()), (key, n)
            assert torch.equal(ta.masked_fill(ta.isnan(), 0), tb.masked_fill(tb.isnan(), 0)), (
                key,
                n,
            )


# --------------------------------------------------------------------------- generic-base cases
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` over the whole tensor (not per batch entry)."""
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def well_conditioned(gen, batch, rows, cols) -> torch.Tensor:
    """``U diag(σ) Vᵀ`` with orthonormal ``U`` (rows×cols), ``σ ∈ [0.5, 2]``: condition ≤ 4
    (float64)."""
    U = torch.linalg.qr(torch.randn(*batch, rows, cols, generator=gen, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(*batch, cols, cols, generator=gen, dtype=torch.float64))[0]
    sigma = 0.5 + 1.5 * torch.rand(*batch, 1, cols, generator=gen, dtype=torch.float64)
    return (U * sigma) @ V.transpose(-1, -2)


@st.composite
def scale_cases(draw):
    ndim = draw(st.integers(1, 2))
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    # a block of one entry has a single point as quotient; start at two entries
    block = (
        draw(st.integers(2, 4)),
        *draw(st.lists(st.integers(1, 3), min_size=ndim - 1, max_size=ndim - 1)),
    )
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    m = ScaleQuotient(ndim)
    x = torch.randn(*batch, *block, generator=gen, dtype=torch.float64) + 0.1
    u, v = (torch.randn(x.shape, generator=gen, dtype=torch.float64) for _ in range(2))
    g = torch.exp(torch.randn(batch, generator=gen, dtype=torch.float64))
    omega = torch.randn(batch, generator=gen, dtype=torch.float64)
    return m, x, u, v, g, omega


@st.composite
def interpolated_cases(draw, s=None):
    s = draw(st.floats(0, 1)) if s is None else s
    batch = tuple(draw(st.lists(st.integers(1, 2), max_size=2)))
    h = draw(st.integers(1, 3))
    n, m_rows = h + draw(st.integers(0, 3)), h + draw(st.integers(0, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.cat(
        [well_conditioned(gen, batch, n, h), well_conditioned(gen, batch, m_rows, h)], dim=-2
    )
    u, v = (torch.randn(x.shape, generator=gen, dtype=torch.float64) for _ in range(2))
    A = well_conditioned(gen, batch, h, h)
    omega = torch.randn(*batch, h, h, generator=gen, dtype=torch.float64)
    return InterpolatedGLQuotient(n, s), x, u, v, A, omega


def assert_parts_read_and_write_like_the_geometry(geometry, seed: int = 1):
    """The parts of :class:`~quotientgeo.geometry.perturbation.Perturbations` (chunks of symmetry
    blocks, one block per chunk or all together, and pieces of the adaptive rest) read the
    points and the adaptive entries of ``geometry.gather()`` bit for bit, write random points
    back exactly as ``geometry.scatter`` places them, and cut one random draw of the kinds and
    of ``w`` into parts exactly as ``scatter`` places that draw."""
    from quotientgeo.geometry.perturbation import Perturbations

    dtype = geometry.compute_dtype
    points, w = geometry.gather()
    g = torch.Generator().manual_seed(seed)
    new = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in points]
    new_w = torch.randn(w.shape, generator=g, dtype=w.dtype)
    expected = geometry.scatter(new, new_w)
    for chunk_bytes in (None, 1):
        space = Perturbations(geometry, "second_order", chunk_bytes=chunk_bytes)
        params = space.local()
        for ki, chunks in enumerate(space.chunks):
            got = torch.cat([c.read(params, dtype) for c in chunks])
            assert torch.equal(got, points[ki]) and got.dtype == points[ki].dtype
        if chunk_bytes == 1:  # one block (or one product) per chunk
            assert all(len(c.blocks) == 1 or c.heads == 1 for c in space.all_chunks())
        rest = [p.read(params, dtype) for p in space.rest]
        assert sum(r.numel() for r in rest) == w.numel()
        targets = {n: torch.zeros_like(t) for n, t in params.items()}
        for ki, chunks in enumerate(space.chunks):
            for c in chunks:
                c.write_(targets, new[ki][c.offset : c.offset + c.heads])
        for piece in space.rest:
            piece.write_(targets, piece.read(expected, dtype))
        for name, value in expected.items():
            assert torch.equal(targets[name], value), name
        # one draw per kind, then one over w, cut into the parts
        draws = list(space.random_parts(torch.Generator().manual_seed(seed)))
        g = torch.Generator().manual_seed(seed)
        kinds = [torch.randn(p.shape, generator=g, dtype=dtype) for p in points]
        flat = torch.randn(w.shape, generator=g, dtype=dtype) if w.numel() else w
        placed = geometry.scatter(kinds, flat)
        targets = {n: torch.zeros_like(t) for n, t in params.items()}
        for part, e in draws:
            part.write_(targets, e)
        for name, value in placed.items():
            assert torch.equal(targets[name], value), name
