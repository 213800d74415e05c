r"""``quotientgeo reproduce transformers``: sharpness vs generalization of a fine-tuned ViT
population, across the radius ``ρ``.

The paper's study (section 5.3, Table 1, Appendix G) at laptop scale, in the paper's regime:

- **population**: one small ViT pretrained on the digits 0–4 and fine-tuned on the held-out
  digits 5–9 (:mod:`._finetune`); the generalization gap is test error minus train error (on
  the member's own, possibly noisy, training labels). ``--population grid`` (the default): label
  noise ``η ∈ {0, 0.15, 0.3, 0.45}`` × training-set size ``{1, 2/3, 1/3}`` of a 384-image
  pool × ``--seeds`` (3), everything else fixed, tested on the other 512 images; its
  ``gap_spread_over_noise`` (gap standard deviation over the binomial standard error of one
  test error) is printed before any sharpness. ``--population random`` (the first design):
  ``--n-models`` (40) recipes with random learning rate, weight decay, epochs, batch size,
  label smoothing, training subset and augmentation, tested on 448 images;
- **data of every measure**: the same fixed training points (inside every member's subset),
  with each member's own training labels;
- **radii**: each measure with its own ball (adaptive, geodesic inv and mix, average
  sharpness, and the ablations that change the ball) is calibrated on a reference member
  (member 0) with :func:`quotientgeo.calibrate_rho`: ``ρ₁`` is the radius at which its loss
  increase is ``--target`` nats (1). The study runs on the grid ``ρ = f · ρ₁`` with
  ``f ∈ 10^{-1}, 10^{-0.5}, …, 10^{1}`` (random population: from ``10^{-2}``);
- **τ(ρ)**: Kendall τ of each measure with the gap at every grid point, with a bootstrap band
  over models, and the *curvature share* of geodesic sharpness: ``(S₂ - S₁) / S₂`` with ``S₂``
  the second-order value and ``S₁`` the loss increase at the first-order move ``x + ξ*`` of the
  same maximiser ``ξ*`` (population median); on the grid population also the granulated τ of
  Jiang et al. per axis and its mean ``Ψ``;
- **ablations** at ``f = 1`` (fixed in advance: the ``--target`` radius; the random population
  also at the grid point where geodesic sharpness predicts best, largest mean ``|τ|`` of inv
  and mix): symmetry off (``symmetries=None``, which is adaptive sharpness exactly),
  first-order, second-order and exact perturbation (same ball as the second-order row),
  adaptive instead of Riemannian norm, the metric spectrum ``(1-s)·inv + s·mix``, average
  sharpness and relative flatness of the classifier head (no radius); rows with their own ball
  use ``f`` times their own calibrated ``ρ₁``. Every row gets τ, its bootstrap band and
  p-value.

The study is a pipeline (:mod:`..pipeline`): :mod:`.config` (sizes and the measure of every
row), :mod:`.collect` (typed records, :mod:`.records`), :mod:`.analyse` (statistics from the
records only) and :mod:`.report` (tables, JSON, :mod:`.figures`). Models are cached under
``--out/models``, so re-running only re-measures. The work is split over
``--workers`` local processes (2 by default, one per core of a laptop; ``--quick``: 1), or over
the ranks of ``torchrun --nproc_per_node N``; rank 0 writes ``transformers.json``,
``transformers.png`` (sharpness vs gap at each ablation radius) and ``tau_by_rho.png``.
"""

from __future__ import annotations

import argparse

from .. import _common as C
from .. import _curvature
from ..pipeline import Study, add_workers_argument, run_with_workers
from .analyse import analyse as _analyse
from .collect import collect as _collect
from .collect import curvature_populations
from .config import POPULATIONS, Config
from .config import config as _config
from .figures import figures
from .report import report as _report

__all__ = ["STUDY", "Config", "add_arguments", "figures", "run"]

STUDY = Study(_config, _collect, _analyse, _report)
"""The study (:class:`~..pipeline.Study`): :class:`Config` and the functions of :mod:`.config`,
:mod:`.collect`, :mod:`.analyse` and :mod:`.report`."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, "transformers")
    parser.add_argument(
        "--population",
        choices=POPULATIONS,
        default=POPULATIONS[0],
        help="grid: label noise × training-set size × seeds, the rest fixed (default); "
        "random: random fine-tuning hyper-parameters (the first design)",
    )
    parser.add_argument("--n-models", type=int, default=None, help="random population's size (40)")
    parser.add_argument(
        "--seeds", type=int, default=None, help="grid population's seeds per cell (3)"
    )
    parser.add_argument(
        "--n-iter", type=int, default=None, help="Auto-PGD iterations (grid: 12; random: 20)"
    )
    parser.add_argument(
        "--target",
        type=float,
        default=1.0,
        help="loss increase (nats) that calibrates ρ₁ of every measure (1)",
    )
    _curvature.add_argument(parser)
    add_workers_argument(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (1)")


def curvature_config(args: argparse.Namespace) -> _curvature.Config:
    """The curvature rows of the study's population (:mod:`.._curvature`)."""
    return _curvature.Config.of_study("transformers", _config(args), curvature_populations)


def run(args: argparse.Namespace) -> int:
    """Fine-tuned ViT population (§5.3, App. G): Kendall τ across ρ, curvature share, ablations;
    then (``--curvature``) the curvature rows."""
    return run_with_workers(run, _curvature.studies(STUDY, curvature_config, args), args)
