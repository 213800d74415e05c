r"""``quotientgeo reproduce diagonal``: sharpness vs generalization of diagonal linear networks.

Paper section 5.1, Figure 3 and Table 1 (row 1). Sparse regression ``y = xᵀβ*`` with Gaussian
``x ∈ R^d`` (``d = 200``), ``n = 100 < d`` training samples and a 90 %-sparse ``β*``. A population
of diagonal networks ``f(x) = xᵀ(u ⊙ v)`` is trained by mini-batch SGD to a training loss (mean
squared error) below ``1e-5``, with varied initialisation scale ``α`` (``u₀ = √2 α``, ``v₀ = 0``;
small ``α`` gives sparse, well-generalising interpolators, large ``α`` dense ones), learning rate
and batch size. All networks train at once as one ``(K, d)`` batch of parameters. For every
network we measure, through the library, the worst-case adaptive sharpness and the geodesic
sharpness with the ``inv`` and ``mix`` metrics of the re-scaling quotient (declared explicitly:
``ParameterGeometry(model).add_rescale_pair("u", "v")``), and correlate each with the
generalization gap (test loss on fresh samples minus training loss) by Kendall τ.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from quotientgeo import Measure
from quotientgeo.manifolds import DEFAULT_METRIC

from . import _common as C

PAPER_TAU = {"adaptive": -0.68, "geodesic_inv": -0.83, "geodesic_mix": -0.86}
MAIN = ("adaptive", "geodesic_inv", "geodesic_mix")
#: ablation rows: exact geodesics (closed form for the re-scaling quotient) instead of 2nd order
MEASURES = (*MAIN, "exact_inv", "exact_mix")


@dataclass
class Config:
    """Sizes and budgets of one run (``--quick`` shrinks them)."""

    d: int = 200
    n: int = 100
    n_test: int = 5000
    sparsity: float = 0.9
    n_models: int = 50
    target_loss: float = 1e-5
    max_steps: int = 300_000
    rho: float = 0.1
    n_iter: int = 100

    @classmethod
    def quick(cls) -> Config:
        return cls(d=40, n=20, n_test=500, n_models=8, target_loss=1e-3, max_steps=20_000, n_iter=5)


# ---------------------------------------------------------------------- data and training
def make_data(cfg: Config, seed: int) -> dict[str, torch.Tensor]:
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


def train_population(
    data: dict[str, torch.Tensor], hp: dict[str, torch.Tensor], cfg: Config, seed: int, bar=None
) -> dict[str, torch.Tensor]:
    """SGD on all networks at once until each one's training loss is below ``cfg.target_loss``.

    Network ``k`` takes steps of size ``lr_factor_k / (λ_max · max_i(u_i² + v_i²))`` (a fraction of
    the local stability limit, recomputed every step) on mini-batches of ``batch_size_k`` samples
    (the first ``batch_size_k`` of one shared random permutation per step); it stops once its
    full-batch loss reaches the target. Runs in float32 on one thread (the tensors are tiny).
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
    test = (beta @ data["X_test"].T - data["y_test"]).square().mean(1)
    return {"u": u, "v": v, "train_loss": train, "test_loss": test, "steps": steps}


# ---------------------------------------------------------------------- measures
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


def measures(rho: float, n_iter: int, seed: int) -> dict[str, Measure]:
    """The study's rows: adaptive, and geodesic sharpness in the ``inv`` and ``mix`` metrics with
    the second-order map (``geodesic_*``) and the exact geodesic (``exact_*``). The geodesic rows
    are measured on :func:`rescale_geometry` declared in their metric (:func:`measure_model`)."""
    out = {"adaptive": Measure.adaptive(rho, n_iter=n_iter, seed=seed)}
    for name, perturbation in (("geodesic", "second_order"), ("exact", "exact")):
        for metric in ("inv", "mix"):
            out[f"{name}_{metric}"] = Measure.geodesic(
                rho, metric=metric, perturbation=perturbation, n_iter=n_iter, seed=seed
            )
    return out  # the order of MEASURES


def measure_model(model: DiagonalNet, batches, rows: dict[str, Measure]) -> dict[str, float]:
    """Each row's value on ``model``; geodesic rows on the re-scaling pair in their metric."""
    values = {}
    for name, m in rows.items():
        if m.symmetries is not None:  # the pair is declared explicitly, in the row's metric
            metric = DEFAULT_METRIC if m.metric is None else str(m.metric)
            m = m.replace(symmetries=rescale_geometry(model, metric))
        # each rank of a population run measures its own models
        values[name] = m.evaluate(model, mse, batches, progress=False, distributed="off").value
    return values


def sharpness_of(model: DiagonalNet, batches, *, rho: float, n_iter: int, seed: int) -> dict:
    """Adaptive and geodesic (inv, mix; second-order and exact geodesics) worst-case sharpness."""
    return measure_model(model, batches, measures(rho, n_iter, seed))


# ---------------------------------------------------------------------- the study
@dataclass(frozen=True)
class Study:
    """Everything that decides a run: the sizes, the seed and the measured rows."""

    sizes: Config
    seed: int
    quick: bool
    rows: dict[str, Measure]


@dataclass(frozen=True)
class Member:
    """One trained network and its measured values."""

    alpha: float
    lr_factor: float
    batch_size: int
    steps: int
    train_loss: float
    test_loss: float
    values: dict[str, float]

    @property
    def gap(self) -> float:
        return self.test_loss - self.train_loss


@dataclass(frozen=True)
class Records:
    members: list[Member]  # the networks that did not diverge, in population order
    n_models: int
    n_converged: int
    training_seconds: float


@dataclass(frozen=True)
class Analysis:
    records: Records
    values: dict[str, list[float]]
    gap: list[float]
    taus: dict[str, float]
    pvalues: dict[str, float]


def config(args: argparse.Namespace) -> Study:
    sizes = Config.quick() if args.quick else Config()
    for field in ("rho", "n_models", "n_iter"):
        if getattr(args, field, None) is not None:
            setattr(sizes, field, getattr(args, field))
    rows = measures(sizes.rho, sizes.n_iter, args.seed)
    return Study(sizes=sizes, seed=args.seed, quick=args.quick, rows=rows)


def collect(study: Study, population: C.Population, args: argparse.Namespace) -> Records:
    """Train the population (every rank: one batched program, seconds), measure this rank's
    share of the networks, gather the members in population order."""
    t0 = time.perf_counter()
    cfg = study.sizes
    data = make_data(cfg, study.seed)
    hp = hyperparameters(cfg.n_models, cfg.n, study.seed)
    bar = C.progress(None, args=args, desc="training (converged)", total=cfg.n_models)
    with bar:
        trained = train_population(data, hp, cfg, study.seed, bar)
    training_seconds = time.perf_counter() - t0
    finite = torch.isfinite(trained["test_loss"]) & torch.isfinite(trained["train_loss"])
    keep = finite.nonzero().flatten().tolist()
    if len(keep) < cfg.n_models and population.is_reporter:
        print(f"{cfg.n_models - len(keep)} network(s) diverged and are left out")
    if len(keep) < 3:
        raise RuntimeError("fewer than 3 networks trained without diverging; try another --seed")
    batches = [(data["X"], data["y"])]
    values = {}
    with C.threads(1):
        for i in C.progress(population.mine(len(keep)), args=args, desc="sharpness (models)"):
            model = DiagonalNet(trained["u"][keep[i]], trained["v"][keep[i]])
            values[i] = measure_model(model, batches, study.rows)
    gathered = population.gather(values)
    members = [
        Member(
            alpha=float(hp["alpha"][k]),
            lr_factor=float(hp["lr_factor"][k]),
            batch_size=int(hp["batch_size"][k]),
            steps=int(trained["steps"][k]),
            train_loss=float(trained["train_loss"][k]),
            test_loss=float(trained["test_loss"][k]),
            values=v,
        )
        for k, v in zip(keep, gathered, strict=True)
    ]
    converged = int((trained["train_loss"] < cfg.target_loss).sum())
    return Records(members, cfg.n_models, converged, training_seconds)


def analyse(study: Study, records: Records) -> Analysis:
    """Kendall τ (and its p-value) of every row with the generalization gap."""
    gap = [m.gap for m in records.members]
    values = {key: [m.values[key] for m in records.members] for key in study.rows}
    taus, pvalues = {}, {}
    for key in study.rows:
        taus[key], pvalues[key] = C.kendall(values[key], gap)
    return Analysis(records, values, gap, taus, pvalues)


def report(study: Study, analysis: Analysis, out, *, ranks: int, started: float) -> dict:
    """The table, ``diagonal.json`` and ``diagonal.png`` (``started``: the run's start time,
    ``time.perf_counter()``)."""
    cfg, records, gap = study.sizes, analysis.records, analysis.gap
    taus, pvalues, values = analysis.taus, analysis.pvalues, analysis.values
    C.print_table(
        f"Kendall τ with the generalization gap ({len(gap)} diagonal networks, ρ = {cfg.rho})",
        ["measure", "τ (ours)", "p-value", "τ (paper)"],
        [[k, taus[k], f"{pvalues[k]:.1e}", PAPER_TAU.get(k)] for k in study.rows],
    )
    print(
        f"{records.n_converged}/{cfg.n_models} networks reached training loss < "
        f"{cfg.target_loss:g}; generalization gap from {min(gap):.3g} to {max(gap):.3g}"
    )
    figure(gap, values, taus, out / "diagonal.png")
    models = [
        {
            "alpha": m.alpha,
            "lr_factor": m.lr_factor,
            "batch_size": m.batch_size,
            "steps": m.steps,
            "train_loss": m.train_loss,
            "test_loss": m.test_loss,
            "gap": m.gap,
            **m.values,
        }
        for m in records.members
    ]
    payload = {
        "command": "diagonal",
        "quick": study.quick,
        "seed": study.seed,
        "config": vars(cfg),
        "ranks": ranks,
        "kendall_tau": {k: C.finite_or_none(v) for k, v in taus.items()},
        "p_value": {k: C.finite_or_none(v) for k, v in pvalues.items()},
        "paper_kendall_tau": PAPER_TAU,
        "n_converged": records.n_converged,
        "n_diverged": records.n_models - len(records.members),
        "models": models,
        "seconds": {
            "training": records.training_seconds,
            "total": time.perf_counter() - started,
        },
    }
    C.write_json(out / "diagonal.json", payload)
    print(f"wrote {out / 'diagonal.json'} and {out / 'diagonal.png'}")
    return payload


# ---------------------------------------------------------------------- figure and command
def figure(gap, values: dict, taus: dict, path):
    plt = C.pyplot()
    titles = {
        "adaptive": "adaptive",
        "geodesic_inv": "geodesic (inv)",
        "geodesic_mix": "geodesic (mix)",
    }
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key in zip(axes, MAIN, strict=True):
        ax.scatter(values[key], gap, s=18, alpha=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"{titles[key]} sharpness")
        ax.set_title(f"{titles[key]}: τ = {taus[key]:+.2f} (paper {PAPER_TAU[key]:+.2f})")
    axes[0].set_ylabel("generalization gap")
    fig.suptitle("Diagonal linear networks, sparse regression")
    fig.tight_layout()
    return C.save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, "diagonal")
    parser.add_argument("--rho", type=float, default=None, help="ball radius (default 0.1)")
    parser.add_argument("--n-models", type=int, default=None, help="population size (default 50)")
    parser.add_argument("--n-iter", type=int, default=None, help="Auto-PGD iterations (100)")


def run(args: argparse.Namespace) -> int:
    """Diagonal networks (paper §5.1, Fig. 3): Kendall τ of adaptive/geodesic sharpness vs gap.

    ``config`` → ``collect`` → ``analyse`` → ``report``. Under ``torchrun --nproc_per_node N``
    every rank trains the population (one batched tensor program, seconds) and measures its
    share of the networks; rank 0 gathers the values in population order and writes the same
    JSON and figure.
    """
    t0 = time.perf_counter()
    study = config(args)
    out = C.out_dir(args)
    with C.Population() as population:
        args.no_progress = args.no_progress or not population.is_reporter
        records = collect(study, population, args)
        if not population.is_reporter:
            return 0
        report(study, analyse(study, records), out, ranks=population.world, started=t0)
    return 0
