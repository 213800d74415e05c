r"""``quotientgeo reproduce diagonal``: sharpness vs generalization of diagonal linear networks,
across the radius ``ρ``, on two populations.

Paper section 5.1, Figure 3 and Table 1 (row 1). Sparse regression ``y = xᵀβ*`` with Gaussian
``x ∈ R^d`` (``d = 200``), ``n = 100 < d`` training samples and a 90 %-sparse ``β*``; diagonal
networks ``f(x) = xᵀ(u ⊙ v)`` trained by mini-batch SGD to a training loss (mean squared
error) below ``1e-5`` (:mod:`.training`). The generalization gap is test loss on fresh samples
minus training loss.

- **populations** (``--population init|sgd|both``, default both): ``init``, the paper's
  design, varies the initialisation scale ``α`` (``u₀ = √2 α``, ``v₀ = 0``), the learning rate
  and the batch size by random draws; ``sgd`` varies only the SGD noise, learning rate × batch
  size × batch-order seed on a grid, at one fixed ``α``;
- **rows**: adaptive sharpness; geodesic sharpness in the ``inv`` and ``mix`` metrics of the
  re-scaling quotient (declared explicitly, ``ParameterGeometry(model).add_rescale_pair("u",
  "v")``) with second-order, first-order and exact perturbations; adaptive average sharpness.
  Relative flatness is left out: it needs an ``nn.Linear`` feature layer, which ``xᵀ(u ⊙ v)``
  does not have;
- **radii**: per population, each ball calibrated with :func:`quotientgeo.calibrate_rho` on
  the reference member (the middle one of the population order) to a loss increase of 1 % of
  the training labels' mean square; every member is measured at ``ρ = f · ρ₁``,
  ``f ∈ 10^{-1}, 10^{-0.5}, …, 10^{1}``;
- **statistics** (:mod:`.analyse`): the gap spread over the test noise (standard deviation of
  the gaps over the mean standard error of a test loss), Kendall τ with the gap at every radius
  with 90 % bootstrap bands and p-values, and on the grid population the granulated τ of Jiang
  et al. (2020) per axis and Ψ.

The study is a pipeline (:mod:`..pipeline`): :mod:`.config`, :mod:`.collect` (typed records,
:mod:`.records`), :mod:`.analyse` and :mod:`.report` (tables, JSON, :mod:`.figures`). Every
rank trains each population (one batched tensor program per batch-order seed, seconds) and
measures its share of the networks; the work is split over ``--workers`` local processes (2 by
default; ``--quick``: 1) or the ranks of ``torchrun --nproc_per_node N``; rank 0 writes
``diagonal.json``, ``diagonal.png`` and ``diagonal_tau_by_rho.png``.
"""

from __future__ import annotations

import argparse

from .. import _common as C
from .. import _curvature
from ..pipeline import Study, add_workers_argument, run_with_workers
from .analyse import analyse as _analyse
from .collect import collect as _collect
from .collect import curvature_populations
from .config import MAIN, MEASURES, PAPER_TAU, POPULATIONS, Config
from .config import config as _config
from .figures import figures
from .report import report as _report
from .training import (
    DiagonalNet,
    TrainingConfig,
    hyperparameters,
    make_data,
    mse,
    rescale_geometry,
    sgd_grid,
    train_population,
)

__all__ = [
    "MAIN",
    "MEASURES",
    "PAPER_TAU",
    "STUDY",
    "Config",
    "DiagonalNet",
    "TrainingConfig",
    "add_arguments",
    "figures",
    "hyperparameters",
    "make_data",
    "mse",
    "rescale_geometry",
    "run",
    "sgd_grid",
    "train_population",
]


STUDY = Study(_config, _collect, _analyse, _report)
"""The study (:class:`~..pipeline.Study`): :class:`Config` and the functions of :mod:`.config`,
:mod:`.collect`, :mod:`.analyse` and :mod:`.report`."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, "diagonal")
    parser.add_argument(
        "--population",
        choices=(*POPULATIONS, "both"),
        default="both",
        help="init: α, learning rate and batch size drawn at random (the paper's design); "
        "sgd: learning rate × batch size at one α; both (default)",
    )
    parser.add_argument(
        "--n-models", type=int, default=None, help="size of the init population (50)"
    )
    parser.add_argument("--n-iter", type=int, default=None, help="Auto-PGD iterations (100)")
    _curvature.add_argument(parser)
    add_workers_argument(parser)


def curvature_config(args: argparse.Namespace) -> _curvature.Config:
    """The curvature rows of the study's populations (:mod:`.._curvature`)."""
    return _curvature.Config.of_study("diagonal", _config(args), curvature_populations)


def run(args: argparse.Namespace) -> int:
    """Diagonal networks (paper §5.1, Fig. 3): Kendall τ of sharpness vs gap across ρ, on a
    population that varies α and one that varies only SGD noise; then (``--curvature``) the
    curvature rows."""
    return run_with_workers(run, _curvature.studies(STUDY, curvature_config, args), args)
