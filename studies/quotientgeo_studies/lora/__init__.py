r"""``quotientgeo reproduce lora``: LoRA fine-tuning with five optimizers over a learning-rate
grid, and the sharpness of the fine-tuned adapters against their generalization gap.

A LoRA adapter ``B A`` has the symmetry ``(B, A) ↦ (B M⁻¹, M A)``, ``M ∈ GL(r)``: the quotient
of an attention head. Two questions: do the optimizers that see this quotient make
fine-tuning less sensitive to the learning rate (the claim of the preconditioned-LoRA
papers), and do adaptive, geodesic and average sharpness rank the fine-tuned members'
generalization gaps, measured on the adapters alone and on the whole model?

The protocol (fixed before any run of the population; ``docs/reproductions.md``):

- **base model and task**: the transformers study's :class:`~.._vit.DigitsViT` pretrained on
  the digits 0–4 (:mod:`.._finetune`), fine-tuned on the held-out digits 5–9: a pool of 384
  training images, a fraction ``η = 0.3`` of whose labels is replaced by a uniformly drawn
  wrong class (one draw per replicate seed), and a test set of the other 512 (clean labels);
- **adapters** (:mod:`.model`): PEFT LoRA, ``r = 4``, ``lora_alpha = 8``, no dropout, on the
  feed-forward ``linear1`` and ``linear2`` of both encoder layers (PEFT cannot wrap
  ``nn.MultiheadAttention``'s projections), a new 5-way head trained fully, everything else
  frozen; :func:`quotientgeo.find_symmetries` must find each adapter as a ``GL(4)`` pair;
- **optimizers** (:mod:`.training`), each with weight decay 0, the same learning rate of its
  base optimizer and the same cosine decay to 0: ``adamw`` (``torch.optim.AdamW``),
  ``peft_riemannian`` (``peft.optimizers.create_riemannian_optimizer`` around AdamW,
  ``reg = 1e-2``), ``quotient_adam`` (:func:`quotientgeo.optim.quotient_optimizer` with
  geoopt's ``RiemannianAdam``, mix metric, ``eps = 1e-2``), ``sam`` and ``geodesic_sam``
  (:class:`quotientgeo.optim.GeodesicSAM` around AdamW, ``variant="sam"`` or
  ``variant="geodesic"`` with the mix metric; ``ρ = 0.1``, the radius the ``sam`` study's
  noisy validation split chose for both under label noise);
- **population**: the 5 arms × the learning rates ``10^-3.5, 10^-3, …, 10^-1.5`` × 3
  replicates (``--seeds``), 75 members; replicate ``r`` has the seed ``1000·seed + r`` (head and
  adapter initialisation, batch order, noisy labels) in every cell. 600 steps of batch 32,
  float32. A member whose parameters are not finite after training is diverged: its accuracy
  counts, its sharpness is not measured;
- **gap**: test error minus train error on the member's own noisy labels;
- **sharpness**, on a float64 copy of each member, the pool's first 2 × 64 images with the
  member's own labels: adaptive sharpness, geodesic sharpness (mix metric, second-order map;
  both Auto-PGD, 20 iterations) and average sharpness (100 Gaussian directions per batch in
  the element-wise adaptive geometry), each in two scopes: ``adapters`` (the trainable
  parameters: the LoRA pairs and the head) and ``whole`` (every parameter, made trainable for
  the measurement and restored after it; geodesic sharpness then also maps the attention
  heads' QK and VO pairs);
- **radii**: each of the 6 balls is calibrated with :func:`quotientgeo.calibrate_rho` on the
  reference member (``adamw``, ``lr = 10^-2.5``, replicate 0) to a loss increase of
  ``--target`` (1) nat; every member is measured there;
- **statistics** (:mod:`.analyse`): test accuracy per arm × learning rate (mean ± sd over the
  replicates), each arm's worst and best learning rate and their range; an arm is more robust
  than AdamW when its worst-learning-rate mean beats AdamW's by more than twice the standard
  error of the difference (the same rule at every learning rate, Welch's p beside it); per
  measure and scope Kendall τ-b with the gap, its 90 % bootstrap band and p-value, and the
  granulated τ of Jiang et al. (2020) on the axes optimizer and learning rate (groups share
  the replicate) with its mean Ψ.

The study is a pipeline (:mod:`..pipeline`): :mod:`.config`, :mod:`.collect` (records of
:mod:`.records`), :mod:`.analyse` and :mod:`.report` (tables, ``lora.json``, ``lora.png`` by
:mod:`.figures`). Fine-tuned members are cached under ``--out/models``, so a re-run only
re-measures. The work is split over ``--workers`` local processes (2; ``--quick``: 1) or the
ranks of ``torchrun``. ``--optimizers`` runs a subset of the arms (``adamw`` among them: the
radii are calibrated on it).
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
from .figures import figure
from .report import report as _report
from .training import ARMS

__all__ = ["ARMS", "STUDY", "Config", "add_arguments", "figure", "run"]

STUDY = Study(_config, _collect, _analyse, _report)
"""The study (:class:`~..pipeline.Study`): :class:`Config` and the functions of :mod:`.config`,
:mod:`.collect`, :mod:`.analyse` and :mod:`.report`."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_common_arguments(parser, "lora")
    parser.add_argument(
        "--optimizers",
        default=None,
        help=f"comma-separated optimizers to run, adamw among them (default: {','.join(ARMS)})",
    )
    parser.add_argument("--seeds", type=int, default=None, help="replicates per cell (3)")
    parser.add_argument("--n-iter", type=int, default=None, help="Auto-PGD iterations (20)")
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
    """The curvature rows of the study's population, in both scopes (:mod:`.._curvature`)."""
    return _curvature.Config.of_study("lora", _config(args), curvature_populations)


def run(args: argparse.Namespace) -> int:
    """LoRA fine-tuning: five optimizers over a learning-rate grid; sharpness vs gap; then
    (``--curvature``) the curvature rows."""
    return run_with_workers(run, _curvature.studies(STUDY, curvature_config, args), args)
