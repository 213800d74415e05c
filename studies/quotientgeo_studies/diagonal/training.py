r"""Data, networks and training of the diagonal-network study.

Sparse regression ``y = xᵀβ*`` with Gaussian ``x ∈ R^d`` (``d = 200``), ``n = 100 < d`` training
samples and a 90 %-sparse ``β*``. Diagonal networks ``f(x) = xᵀ(u ⊙ v)`` are trained by
mini-batch SGD to a training loss (mean squared error) below ``1e-5``, from ``u₀ = √2 α``,
``v₀ = 0`` (small ``α`` gives sparse, well-generalising interpolators, large ``α`` dense ones).
All networks of a population train at once as one ``(K, d)`` batch of parameters.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from quotientgeo.manifolds import DEFAULT_METRIC

from .. import _common as C


@dataclass(frozen=True)
class TrainingConfig:
    """Data and training sizes (``--quick`` shrinks them); ``n_models``: the first population."""

    d: int = 200
    n: int = 100
    n_test: int = 5000
    sparsity: float = 0.9
    n_models: int = 50
    target_loss: float = 1e-5
    max_steps: int = 300_000

    @classmethod
    def quick(cls) -> TrainingConfig:
        return cls(d=40, n=20, n_test=500, n_models=8, target_loss=1e-3, max_steps=20_000)


# ---------------------------------------------------------------------- data and training
def make_data(cfg: TrainingConfig, seed: int) -> dict[str, torch.Tensor]:
    """Gaussian inputs, ``(1 - sparsity)·d`` non-zero Gaussian coefficients, noiseless labels."""
    gen = torch.Generator().manual_seed(seed)
    k = max(1, round((1 - cfg.sparsity) * cfg.d))
    beta = torch.zeros(cfg.d, dtype=torch.float64)
    beta[torch.randperm(cfg.d, generator=gen)[:k]] = torch.randn(k, generator=gen, dtype=beta.dtype)
    X = torch.randn(cfg.n, cfg.d, generator=gen, dtype=beta.dtype)
    X_test = torch.randn(cfg.n_test, cfg.d, generator=gen, dtype=beta.dtype)
    return {"X": X, "y": X @ beta, "X_test": X_test, "y_test": X_test @ beta, "beta_star": beta}


def hyperparameters(n_models: int, n: int, seed: int) -> dict[str, torch.Tensor]:
    """Initialisation scales (log-uniform grid), learning-rate factors and batch sizes."""
    gen = torch.Generator().manual_seed(seed + 1)
    alpha = torch.logspace(math.log10(0.02), math.log10(3.0), n_models, dtype=torch.float64)
    alpha = alpha[torch.randperm(n_models, generator=gen)]
    lr_factor = torch.empty(n_models, dtype=torch.float64).uniform_(0.3, 0.75, generator=gen)
    sizes = torch.tensor(sorted({max(1, n // 10), max(1, n // 4), max(1, n // 2), n}))
    batch = sizes[torch.randint(len(sizes), (n_models,), generator=gen)]
    return {"alpha": alpha, "lr_factor": lr_factor, "batch_size": batch}


def sgd_grid(
    alpha: float, lr_factors: Sequence[float], batch_sizes: Sequence[int], seeds: int
) -> dict[str, torch.Tensor]:
    """One initialisation scale ``alpha`` for every member; the grid learning-rate factor ×
    batch size × batch-order seed (``seed``: its index), in that order."""
    grid = list(itertools.product(lr_factors, batch_sizes, range(seeds)))
    return {
        "alpha": torch.full((len(grid),), float(alpha), dtype=torch.float64),
        "lr_factor": torch.tensor([g[0] for g in grid], dtype=torch.float64),
        "batch_size": torch.tensor([g[1] for g in grid]),
        "seed": torch.tensor([g[2] for g in grid]),
    }


def train_population(
    data: dict[str, torch.Tensor],
    hp: dict[str, torch.Tensor],
    cfg: TrainingConfig,
    seed: int,
    bar=None,
) -> dict[str, torch.Tensor]:
    """SGD on all networks at once until each one's training loss is below ``cfg.target_loss``.

    Network ``k`` takes steps of size ``lr_factor_k / (λ_max · max_i(u_i² + v_i²))`` (a fraction of
    the local stability limit, recomputed every step) on mini-batches of ``batch_size_k`` samples
    (the first ``batch_size_k`` of one shared random permutation per step); it stops once its
    full-batch loss reaches the target. Runs in float32 on one thread (the tensors are tiny).
    ``test_se`` is the standard error of each test loss, ``std_i(e_i) / √n_test`` over the
    per-sample squared errors ``e_i``.
    """
    dt = torch.float32
    X, y = data["X"].to(dt), data["y"].to(dt)
    n = X.shape[0]
    K = hp["alpha"].numel()
    gen = torch.Generator().manual_seed(seed + 2)
    u = (math.sqrt(2) * hp["alpha"].to(dt))[:, None].expand(K, X.shape[1]).clone()
    v = torch.zeros_like(u)
    lam = torch.linalg.eigvalsh(X.T @ X / n).max()
    lr_factor, bs = hp["lr_factor"].to(dt), hp["batch_size"]
    active = torch.ones(K, dtype=torch.bool)
    steps = torch.zeros(K, dtype=torch.long)
    XT = X.T.contiguous()
    with C.threads(1):
        for step in range(cfg.max_steps):
            r = (u * v) @ XT - y
            if step % 100 == 0:
                loss = r.square().mean(1)
                active = (loss >= cfg.target_loss) & torch.isfinite(loss)
                if bar is not None:
                    bar.n = K - int(active.sum())
                    bar.set_postfix(
                        step=step, worst=f"{float(loss[active].max()):.1e}" if active.any() else "-"
                    )
                    bar.refresh()
                if not active.any():
                    break
            rank = torch.randperm(n, generator=gen).argsort()
            mask = (rank[None, :] < bs[:, None]).to(dt)
            g = (r * mask) @ X * (2.0 / bs[:, None])
            scale = (u.square() + v.square()).amax(1).clamp_min(0.1)
            lr = (lr_factor / (lam * scale) * active)[:, None]
            u, v = u - lr * v * g, v - lr * u * g
            steps += active
    u, v = u.double(), v.double()
    beta = u * v
    train = (beta @ data["X"].T - data["y"]).square().mean(1)
    errors = (beta @ data["X_test"].T - data["y_test"]).square()
    test, test_se = errors.mean(1), errors.std(1) / math.sqrt(errors.shape[1])
    return {
        "u": u,
        "v": v,
        "train_loss": train,
        "test_loss": test,
        "test_se": test_se,
        "steps": steps,
    }


# ---------------------------------------------------------------------- the network
class DiagonalNet(nn.Module):
    """``f(x) = xᵀ(u ⊙ v)``."""

    def __init__(self, u: torch.Tensor, v: torch.Tensor):
        super().__init__()
        self.u = nn.Parameter(u.clone())
        self.v = nn.Parameter(v.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.u * self.v)


def mse(model: nn.Module, batch) -> torch.Tensor:
    """Mean squared error, the training loss."""
    x, y = batch
    return (model(x) - y).square().mean()


def rescale_geometry(model: DiagonalNet, metric: str = DEFAULT_METRIC):
    """The re-scaling symmetry ``(u, v) ~ (α u, v / α)``, declared in ``metric`` through the
    explicit API."""
    from quotientgeo.geometry import ParameterGeometry

    return ParameterGeometry(model).add_rescale_pair(
        "u", "v", label="diagonal network", metric=metric
    )
