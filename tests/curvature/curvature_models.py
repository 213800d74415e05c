"""Small float64 models for the curvature tests."""

from __future__ import annotations

import torch
from torch import nn

import quotientgeo as qg
from quotientgeo.testing import TinyTransformerClassifier, random_batches

Tensor = torch.Tensor


class TwoFactor(nn.Module):
    """``y = x G Hᵀ + b``: one GL(h) pair ``(G, H)`` (and a bias, in the adaptive rest, when
    ``bias``)."""

    def __init__(self, n=5, m=4, h=2, *, bias=False, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.G = nn.Parameter(torch.randn(n, h, generator=gen, dtype=torch.float64))
        self.H = nn.Parameter(torch.randn(m, h, generator=gen, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(m, generator=gen, dtype=torch.float64)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = x @ self.G @ self.H.T
        return y if self.b is None else y + self.b

    def geometry(self, metric="mix") -> qg.ParameterGeometry:
        return qg.ParameterGeometry(self).add_gl_pair(
            qg.Source("G", axis=1), qg.Source("H", axis=1), metric=metric
        )


def cubic_loss(model: nn.Module, batch) -> Tensor:
    """Squared error plus a cubic term: a loss whose gradient is far from zero."""
    x, y = batch
    out = model(x)
    return ((out - y) ** 2).mean() + 0.1 * (out**3).mean()


def squared_error(model: nn.Module, batch) -> Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def data(n=20, d_in=5, d_out=4, seed=1, batches=2):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(n, d_in, generator=gen, dtype=torch.float64),
            torch.randn(n, d_out, generator=gen, dtype=torch.float64),
        )
        for _ in range(batches)
    ]


def tiny_transformer(seed=0):
    """A 1-layer, 2-head, width-8 transformer classifier (491 entries) and two batches."""
    torch.manual_seed(seed)
    model = TinyTransformerClassifier(d=8, heads=2, layers=1, dim_feedforward=8).double()
    return model, random_batches(2, batch=6, seq=3, d=8, seed=seed)


class WithNorm(nn.Module):
    """A two-factor layer, then a batch norm (buffers that a forward in train mode updates)."""

    def __init__(self):
        super().__init__()
        self.pair = TwoFactor(bias=True)
        self.norm = nn.BatchNorm1d(4).double()

    def forward(self, x):
        return self.norm(self.pair(x))


def snapshot(model):
    """Weights and buffers (copied), each parameter with its ``.grad``, the modules' modes."""
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [(p, p.grad) for p in model.parameters()],
        [m.training for m in model.modules()],
    )
