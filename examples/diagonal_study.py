"""The paper's diagonal-network study (section 5.1) in a few library calls.

Train a population of diagonal networks ``xᵀ(u ⊙ v)`` on sparse regression, declare their
re-scaling symmetry explicitly, and correlate sharpness with the generalization gap.
``quotientgeo reproduce diagonal`` is the full version (figure, JSON, progress bars). The data
and the networks come from the studies: ``pip install ./studies`` from a clone.
"""

from scipy.stats import kendalltau

from quotientgeo import ParameterGeometry, adaptive_sharpness, geodesic_sharpness
from quotientgeo_studies.diagonal import (
    DiagonalNet,
    TrainingConfig,
    hyperparameters,
    make_data,
    mse,
    train_population,
)

cfg = TrainingConfig(n_models=20)
data = make_data(cfg, seed=0)
nets = train_population(data, hyperparameters(cfg.n_models, cfg.n, seed=0), cfg, seed=0)
gap = (nets["test_loss"] - nets["train_loss"]).tolist()
batches = [(data["X"], data["y"])]

scores = {"adaptive": [], "geodesic inv": [], "geodesic mix": []}
for u, v in zip(nets["u"], nets["v"], strict=True):
    model = DiagonalNet(u, v)
    symmetry = ParameterGeometry(model).add_rescale_pair("u", "v")
    kw = dict(rho=0.1, n_iter=100, progress=False)
    scores["adaptive"].append(adaptive_sharpness(model, mse, batches, **kw).value)
    for metric in ("inv", "mix"):
        s = geodesic_sharpness(model, mse, batches, symmetries=symmetry.with_metric(metric), **kw)
        scores[f"geodesic {metric}"].append(s.value)

for name, values in scores.items():
    tau, p = kendalltau(values, gap)
    print(f"{name:13s} Kendall tau = {tau:+.2f} (p = {p:.1e})")
