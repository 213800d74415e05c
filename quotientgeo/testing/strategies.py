"""Hypothesis strategies of random quotient points and tangent vectors (GL(h) two-factor,
scale, interpolated GL), over shapes, batch dimensions, seeds and dtypes.

This module needs `hypothesis <https://hypothesis.readthedocs.io>`_ (in the ``test`` extra);
``import quotientgeo.testing`` does not import it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    from hypothesis import strategies as st
except ImportError as error:  # pragma: no cover - the test extra installs hypothesis
    raise ImportError(
        "quotientgeo.testing.strategies needs hypothesis: pip install hypothesis"
    ) from error

from ..manifolds import GLQuotient, InterpolatedGLQuotient, ScaleQuotient
from .numerics import conditioned, gen, well_conditioned

Tensor = torch.Tensor

__all__ = [
    "BATCHES",
    "DTYPES",
    "METRICS",
    "GLCase",
    "gl_cases",
    "interpolated_cases",
    "scale_cases",
]

#: The dtypes the properties are checked in.
DTYPES = (torch.float32, torch.float64)
#: Batch shapes: none, one dimension, two dimensions.
BATCHES: tuple[tuple[int, ...], ...] = ((), (2,), (2, 3))
#: The two metrics of the GL(h) quotient.
METRICS = ("inv", "mix")


@dataclass
class GLCase:
    """A random GL(h) quotient point with two tangent vectors."""

    manifold: GLQuotient
    x: Tensor
    u: Tensor
    v: Tensor
    batch: tuple[int, ...]
    n: int
    m: int
    h: int
    seed: int

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def group(self, cond: float, seed_offset: int = 1) -> Tensor:
        """A batch of ``A ∈ GL(h)`` with condition number ``cond`` (float64 build)."""
        g = gen(self.seed + 7919 * seed_offset)
        return conditioned(self.batch, self.h, self.h, cond, g, self.dtype)


@st.composite
def gl_cases(
    draw,
    metric: str | None = None,
    dtype: torch.dtype | None = None,
    eps: float = 0.0,
    max_h: int = 4,
    max_extra: int = 4,
    factor_cond: float = 10.0,
    batches: tuple[tuple[int, ...], ...] = BATCHES,
    same_rows: bool | None = None,
) -> GLCase:
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


@st.composite
def scale_cases(draw) -> tuple[ScaleQuotient, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(manifold, x, u, v, g, omega)``: a :class:`~quotientgeo.ScaleQuotient` of 1 or 2 block
    dimensions, a float64 point, two tangent vectors, a positive group element and a Lie
    algebra element per batch entry."""
    ndim = draw(st.integers(1, 2))
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    # a block of one entry has a single point as quotient; start at two entries
    block = (
        draw(st.integers(2, 4)),
        *draw(st.lists(st.integers(1, 3), min_size=ndim - 1, max_size=ndim - 1)),
    )
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    m = ScaleQuotient(ndim)
    x = torch.randn(*batch, *block, generator=generator, dtype=torch.float64) + 0.1
    u, v = (torch.randn(x.shape, generator=generator, dtype=torch.float64) for _ in range(2))
    g = torch.exp(torch.randn(batch, generator=generator, dtype=torch.float64))
    omega = torch.randn(batch, generator=generator, dtype=torch.float64)
    return m, x, u, v, g, omega


@st.composite
def interpolated_cases(
    draw, s: float | None = None
) -> tuple[InterpolatedGLQuotient, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(manifold, x, u, v, A, omega)``: an :class:`~quotientgeo.manifolds.InterpolatedGLQuotient`
    (``s`` drawn from ``[0, 1]`` unless given), a float64 point with factors of condition ≤ 4,
    two tangent vectors, a group element of condition ≤ 4 and a Lie algebra element."""
    s = draw(st.floats(0, 1)) if s is None else s
    batch = tuple(draw(st.lists(st.integers(1, 2), max_size=2)))
    h = draw(st.integers(1, 3))
    n, m_rows = h + draw(st.integers(0, 3)), h + draw(st.integers(0, 3))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.cat(
        [
            well_conditioned(generator, batch, n, h),
            well_conditioned(generator, batch, m_rows, h),
        ],
        dim=-2,
    )
    u, v = (torch.randn(x.shape, generator=generator, dtype=torch.float64) for _ in range(2))
    A = well_conditioned(generator, batch, h, h)
    omega = torch.randn(*batch, h, h, generator=generator, dtype=torch.float64)
    return InterpolatedGLQuotient(n, s), x, u, v, A, omega
