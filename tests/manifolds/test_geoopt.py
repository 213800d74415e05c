"""geoopt composition: ManifoldParameter + Riemannian optimizers on GLQuotient.

Low-rank matrix factorisation ``||G Hᵀ − T||²``. With the mix metric, Riemannian gradient
descent is the scaled gradient descent of Tong, Ma & Chi (2021), whose iteration count does
not depend on the condition number of ``T``; Euclidean gradient descent's grows like ``κ(T)``.
"""

from __future__ import annotations

import math

import geoopt
import pytest
import torch

from quotientgeo import GLQuotient
from quotientgeo.linalg import mT

N, M, R = 30, 20, 3
TARGET = 1e-8


def low_rank_problem(kappa: float, seed: int = 0, noise: float = 0.05):
    """``T = U diag(s) Vᵀ`` (30×20, rank 3, ``s`` from 1 to ``1/κ``) and a perturbed balanced
    spectral initialisation ``(U s^{1/2}, V s^{1/2}) + noise``, as in Tong, Ma & Chi (2021)."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(N, R, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(M, R, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -math.log10(kappa), R, dtype=torch.float64)
    T = (U * s) @ V.T
    noise = noise * s[-1].sqrt()
    G0 = U * s.sqrt() + noise * torch.randn(N, R, generator=g, dtype=torch.float64) / N**0.5
    H0 = V * s.sqrt() + noise * torch.randn(M, R, generator=g, dtype=torch.float64) / M**0.5
    return T, G0, H0


def rel_error(G, H, T) -> float:
    return (torch.linalg.matrix_norm(G @ mT(H) - T) / torch.linalg.matrix_norm(T)).max().item()


def riemannian_iterations(metric: str, kappa: float, lr: float, cap: int) -> int | None:
    """Iterations of geoopt's RiemannianSGD (fixed step) to reach relative error 1e-8."""
    T, G0, H0 = low_rank_problem(kappa)
    man = GLQuotient(N, metric)
    p = geoopt.ManifoldParameter(man.join(G0, H0), manifold=man)
    opt = geoopt.optim.RiemannianSGD([p], lr=lr)
    for it in range(cap + 1):
        G, H = man.split(p)
        loss = ((G @ mT(H) - T) ** 2).sum()
        if rel_error(G.detach(), H.detach(), T) < TARGET:
            return it
        opt.zero_grad()
        loss.backward()
        opt.step()
    return None


def euclidean_iterations(kappa: float, lr: float, cap: int) -> int | None:
    """Plain torch gradient descent on ``||G Hᵀ − T||²`` with fixed step ``lr / σ_max(T)``."""
    T, G, H = low_rank_problem(kappa)
    for it in range(cap + 1):
        Res = G @ H.T - T
        if rel_error(G, H, T) < TARGET:
            return it
        G, H = G - lr * 2 * Res @ H, H - lr * 2 * Res.T @ G
    return None


def test_scaled_gd_iterations_independent_of_condition_number():
    """mix-metric RGD: iterations within a factor 2 over κ(T) ∈ {1, 10, 100}; Euclidean GD
    (best fixed step of a grid, σ_max(T) = 1) is more than 10× slower at κ = 100 than at 1."""
    lr = 0.3
    counts = [riemannian_iterations("mix", kappa, lr, cap=200) for kappa in (1, 10, 100)]
    assert None not in counts, counts
    assert max(counts) <= 2 * min(counts), counts

    steps = (0.1, 0.2, 0.3, 0.4)
    base = [euclidean_iterations(1, s, cap=200) for s in steps]
    best = min(c for c in base if c is not None)
    assert best <= 2 * max(counts)  # the Euclidean baseline is tuned: as fast at κ = 1
    # at κ = 100 no step of the grid gets there within 10× the κ = 1 count
    assert all(euclidean_iterations(100, s, cap=10 * best) is None for s in steps)


@pytest.mark.parametrize("metric", ["inv", "mix"])
@pytest.mark.parametrize(
    ("make_opt", "iters", "target"),
    [
        (lambda p: geoopt.optim.RiemannianSGD([p], lr=0.1), 200, 1e-10),
        (lambda p: geoopt.optim.RiemannianSGD([p], lr=0.05, momentum=0.9), 300, 1e-6),
        (lambda p: geoopt.optim.RiemannianAdam([p], lr=0.05), 300, 5e-3),
    ],
    ids=["sgd", "momentum", "adam"],
)
def test_optimizers_converge_on_factorisation(metric, make_opt, iters, target):
    """RiemannianSGD (plain: ``retr``; momentum: ``retr_transp``) and RiemannianAdam from a
    start at relative error 0.4. geoopt's Adam keeps one second-moment scalar per point
    (``component_inner``), so it runs with a decaying step and is asked for less accuracy."""
    T, G0, H0 = low_rank_problem(1, seed=3, noise=0.3)
    man = GLQuotient(N, metric)
    p = geoopt.ManifoldParameter(man.join(G0, H0), manifold=man)
    assert p.manifold is man
    opt = make_opt(p)
    adam = isinstance(opt, geoopt.optim.RiemannianAdam)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.97) if adam else None
    start = rel_error(G0, H0, T)
    for _ in range(iters):
        G, H = man.split(p)
        loss = ((G @ mT(H) - T) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
    end = rel_error(*(t.detach() for t in man.split(p)), T)
    assert start > 0.3
    assert end < target, (start, end)
    assert man.check_point_on_manifold(p.detach())


def test_manifold_parameter_roundtrip():
    man = GLQuotient(4, "inv")
    x = man.random(3, 7, 2, dtype=torch.float64)
    p = geoopt.ManifoldParameter(x.clone(), manifold=man)
    assert isinstance(p, torch.nn.Parameter)
    assert torch.equal(p.detach(), x)
    u = torch.randn_like(x)
    assert torch.allclose(p.proju(u), man.proju(x, u))
    assert torch.allclose(p.retr(0.01 * u), x + 0.01 * u)
