r"""``quotientgeo reproduce modular``: sharpness vs generalization of transformers on modular
addition, a population that runs from memorisation to full generalisation.

- **population** (:mod:`.task`): one-layer transformers trained full batch on
  ``(a, b, =) -> (a + b) mod p`` on a grid of training fraction × weight decay × seed; the
  test set is every pair outside the member's training set, the gap is test minus train error.
  The gaps' spread is printed before any sharpness, as ``gap_spread_over_noise``: the standard
  deviation of the gaps over the binomial standard error ``sqrt(e(1-e)/n)`` of one member's test
  error at the population's mean test error ``e`` and the smallest test set ``n``
  (``--gaps-only`` stops there);
- **data of every measure**: the first ``n_batches × batch`` pairs of the task's order, inside
  every member's training set (the training sets are nested);
- **precision**: members train in float32 and are measured in float64 (``measure_dtype``):
  weight decay drives the attention's query and key factors close to rank loss, which float32
  cannot resolve;
- **radii**: adaptive, geodesic inv, geodesic mix (second order) and average sharpness each
  have a ball whose ``ρ₁`` is calibrated on the reference member (member 0) with
  :func:`quotientgeo.calibrate_rho` (worst-case, or average, loss increase of ``--target``
  nats); the first three are measured at ``ρ = f · ρ₁``, ``f`` on a half-decade grid (τ(ρ)),
  every other row at ``f = 1`` only: first-order and exact geodesic moves (in the
  second-order row's ball), average sharpness and relative flatness of the unembedding
  ``head`` (no ball);
- **statistics**: Kendall τ of every row with the gap, 90 % bootstrap band and p-value; the
  granulated coefficient Ψ of Jiang et al. (2020) over the two hyper-parameter axes; τ(ρ);
  the curvature share ``(S₂ - S₁) / S₂`` of second-order geodesic sharpness (median).

Models are cached under ``--out/models``; the work is split over ``--workers`` processes;
rank 0 writes ``modular.json``, ``modular.png`` (every row against the gap at ``f = 1``) and
``modular_tau_by_rho.png``.
"""

from __future__ import annotations

import argparse

from .. import _common as C
from .. import _curvature
from ..pipeline import Study, add_workers_argument, run_with_workers
from .analyse import analyse as _analyse
from .collect import collect as _collect
from .collect import curvature_populations
from .config import Config
from .config import config as _config
from .report import figures
from .report import report as _report

__all__ = ["STUDY", "Config", "add_arguments", "figures", "run"]

STUDY = Study(_config, _collect, _analyse, _report)
"""The study (:class:`~..pipeline.Study`): :class:`Config` and the functions of :mod:`.config`,
:mod:`.collect`, :mod:`.analyse` and :mod:`.report`; ``--gaps-only`` stops after training (no
records, nothing analysed or reported)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, "modular")
    parser.add_argument("--n-iter", type=int, default=None, help="Auto-PGD iterations (20)")
    parser.add_argument(
        "--target", type=float, default=1.0, help="loss increase (nats) that calibrates ρ₁ (1)"
    )
    parser.add_argument(
        "--gaps-only", action="store_true", help="train and print the gaps, measure nothing"
    )
    _curvature.add_argument(parser)
    add_workers_argument(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (1)")


def curvature_config(args: argparse.Namespace) -> _curvature.Config:
    """The curvature rows of the study's population (:mod:`.._curvature`)."""
    return _curvature.Config.of_study("modular", _config(args), curvature_populations)


def run(args: argparse.Namespace) -> int:
    """Transformers on modular addition (memorisation to generalisation): τ, Ψ, τ(ρ), flatness;
    then (``--curvature``, not with ``--gaps-only``) the curvature rows."""
    studies = [STUDY] if args.gaps_only else _curvature.studies(STUDY, curvature_config, args)
    return run_with_workers(run, studies, args)
