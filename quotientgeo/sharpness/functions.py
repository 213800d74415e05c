"""The three public measures as functions: each builds a :class:`Measure` and evaluates it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..geometry import ParameterGeometry
from .measure import Measure
from .result import SharpnessResult

Tensor = torch.Tensor

__all__ = ["adaptive_sharpness", "average_sharpness", "geodesic_sharpness"]


def geodesic_sharpness(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batches: Iterable,
    *,
    rho: float,
    metric: str | float | None = None,
    perturbation: str = "default",
    norm: str = "riemannian",
    symmetries: str | ParameterGeometry | None = "auto",
    n_iter: int = 100,
    restarts: int = 1,
    seed: int = 0,
    eps: float | None = None,
    progress: bool = True,
    distributed: str = "auto",
    return_perturbation: bool = False,
    compile: bool = False,
) -> SharpnessResult:
    """Worst-case geodesic sharpness ``mean_S max_{||ξ||_x ≤ ρ} L_S(γ_ξ(1)) - L_S(x)``.

    ``Measure.geodesic(rho, ...).evaluate(model, loss_fn, batches, ...)``.

    Args:
        model: the network; read only (restored bit-exactly, also on errors).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` (move the batch to the model's
            device inside it if needed).
        batches: any iterable of batches (a list, a ``DataLoader``, also over an
            ``IterableDataset``), iterated once.
        rho: ball radius (> 0).
        metric: ``None`` (default): every block in the metric it declares
            (:func:`~quotientgeo.find_symmetries` declares ``"mix"``). With
            ``symmetries="auto"``, ``"mix"``, ``"inv"`` or a number ``s ∈ [0, 1]`` declares
            that metric for the GL and re-scaling kinds (``s``: GL kinds get
            ``(1-s)·inv + s·mix``, :class:`~quotientgeo.manifolds.InterpolatedGLQuotient`). With a
            :class:`~quotientgeo.ParameterGeometry`, a metric other than the declared one is a
            ``ValueError``: measure ``geometry.with_metric(metric)`` instead.
        perturbation: ``"default"``: on each symmetry block the exact geodesic where the
            manifold has it in closed form (``closed_form_geodesic``: the GL ``inv`` metric with
            ``eps = 0``, its rotary subgroup, re-scaling, scaling and product quotients), the
            second-order map elsewhere (GL ``mix`` and interpolated metrics); or for every block
            ``"second_order"`` (``expmap2``: ``x + ξ - ½Γ(ξ,ξ)``, the paper's map),
            ``"first_order"`` (``retr``: ``x + ξ``) or ``"exact"`` (``expmap``: the geodesic,
            integrated where no closed form is known). The adaptive rest always moves along
            straight lines.
        norm: ``"riemannian"``: the ball and gradient use the quotient metric; ``"adaptive"``:
            they use the element-wise ``|w|`` metric while perturbations stay horizontal.
        symmetries: ``"auto"`` (:func:`~quotientgeo.find_symmetries`), an explicit
            :class:`~quotientgeo.geometry.ParameterGeometry`, or ``None`` (adaptive geometry
            on every parameter).
        n_iter: Auto-PGD iterations (one forward and backward pass each) per batch and restart.
        restarts: restart 0 starts at ``ξ = 0``; later ones at random horizontal directions.
        seed: seed of those random directions.
        eps: Gram relaxation of GL kinds (``P + eps·I``), for rank-deficient heads;
            ``None`` keeps each kind's own (0 for discovered attention and ``add_gl_pair``
            blocks, :class:`~quotientgeo.FrameDamping` for discovered LoRA adapters).
        progress: show a tqdm progress bar (on a terminal; on rank 0 only in a process group).
        distributed: in an initialised ``torch.distributed`` process group of several ranks,
            ``"batches"`` (each rank its own batches; every rank returns the result over all
            ranks' batches in rank order), ``"split_batch"`` (the ``k``-th batches of all ranks
            form one batch: one shared perturbation, loss and gradient averaged over ranks
            each iteration; equally sized rank batches) or ``"off"`` (local results); see
            :mod:`quotientgeo.sharpness.ranks`. ``"auto"`` (default): ``"split_batch"`` for a
            model sharded over the ranks (FSDP2's ``fully_shard``; the only mode that can
            measure it), ``"batches"`` otherwise. Without a process group it changes nothing.
        return_perturbation: also return each batch's worst perturbation ``ξ*`` in parameter
            coordinates (``SharpnessResult.perturbations``; one parameter-sized copy per batch).
        compile: the adaptive rest's Gram pass and step, and the step of the symmetric
            parameters' iterates, of every iteration by kernels compiled with
            :func:`torch.compile` (:mod:`quotientgeo.sharpness.fused`): the same values to
            rounding, fewer passes over the parameters, a compilation on first use.

    The result's ``first_order_losses`` (one extra no-grad forward per batch unless
    ``perturbation="first_order"``) give :attr:`SharpnessResult.curvature_share`.

    Random draws (restarts after the first, average-case samples) are seeded per batch by
    ``(seed, batch index)``, so a batch gets the same draws however batches are split.

    Numeric arguments (``rho``, a numeric ``metric``, ``n_iter``, ``restarts``, ``seed``) may be
    Python numbers, numpy scalars or 0-dim tensors (read once with ``.item()``); they are used
    and recorded in ``settings`` as Python ``float`` / ``int``. Bools are rejected.
    """
    measure = Measure.geodesic(
        rho, metric=metric, perturbation=perturbation, norm=norm, symmetries=symmetries,
        n_iter=n_iter, restarts=restarts, seed=seed, eps=eps,
    )  # fmt: skip
    return measure.evaluate(
        model, loss_fn, batches,
        progress=progress, distributed=distributed, return_perturbation=return_perturbation,
        compile=compile,
    )  # fmt: skip


def adaptive_sharpness(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batches: Iterable,
    *,
    rho: float,
    n_iter: int = 100,
    restarts: int = 1,
    seed: int = 0,
    progress: bool = True,
    distributed: str = "auto",
    compile: bool = False,
) -> SharpnessResult:
    """Adaptive sharpness of Andriushchenko et al. 2023: ``max_{||ξ ⊙ ŵ⁻¹||₂ ≤ ρ} L(w + ξ) - L(w)``.

    Every parameter in the element-wise geometry, straight-line perturbations, the same
    Auto-PGD loop: ``Measure.adaptive(rho, ...)``, exactly
    ``geodesic_sharpness(symmetries=None, perturbation="first_order", norm="adaptive")``
    (``compile`` as there).
    """
    measure = Measure.adaptive(rho, n_iter=n_iter, restarts=restarts, seed=seed)
    return measure.evaluate(
        model, loss_fn, batches, progress=progress, distributed=distributed, compile=compile
    )


def average_sharpness(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batches: Iterable,
    *,
    rho: float,
    metric: str | float | None = None,
    perturbation: str = "default",
    norm: str = "riemannian",
    symmetries: str | ParameterGeometry | None = "auto",
    n_samples: int = 100,
    seed: int = 0,
    eps: float | None = None,
    progress: bool = True,
    distributed: str = "auto",
) -> SharpnessResult:
    """Average-case sharpness ``mean_S E_ξ L_S(γ_ξ(1)) - L_S(x)`` over ``||ξ||_x = ρ``.

    ``ξ`` is a standard Gaussian of the metric at ``x`` (isotropic in every block), projected
    to the horizontal space and scaled to norm ``ρ``; ``n_samples`` forward passes per batch:
    ``Measure.average(rho, ...)``. The switches mean what they mean for
    :func:`geodesic_sharpness`.
    """
    measure = Measure.average(
        rho, metric=metric, perturbation=perturbation, norm=norm, symmetries=symmetries,
        n_samples=n_samples, seed=seed, eps=eps,
    )  # fmt: skip
    return measure.evaluate(model, loss_fn, batches, progress=progress, distributed=distributed)
