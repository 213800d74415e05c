r"""Worst-case and average sharpness of a model in (geodesic) balls of its parameter geometry.

For a batch ``S`` with loss ``L_S`` and the parameters ``x`` split by a
:class:`~quotientgeo.geometry.ParameterGeometry` into symmetry blocks and an adaptive rest,

    worst-case:  ``max_{ξ horizontal, ||ξ||_x ≤ ρ} L_S(γ_ξ(1)) - L_S(x)``
    average:     ``E_{ξ horizontal, ||ξ||_x = ρ} L_S(γ_ξ(1)) - L_S(x)``

averaged over batches. ``||ξ||²_x = Σ_blocks <ξ_b, ξ_b>`` (square norms add), ``γ_ξ(1)`` is the
exact, second-order (``x + ξ - ½ Γ(ξ, ξ)``) or first-order (``x + ξ``) geodesic step on the
symmetry blocks and the straight line ``w + ξ`` on the adaptive rest, whose metric is
``Σ ξ² / ŵ²`` with ``ŵ = max(|w|, floor)`` (Andriushchenko et al. 2023; ``floor`` is
:class:`~quotientgeo.AdaptiveGeometry`'s, ``1e-12``: a zero weight moves by at most
``ρ · 1e-12``).

The maximiser is one Auto-PGD loop (Croce & Hein 2020, as used by Andriushchenko et al.):
``ξ_0 = 0`` (equivariant, so results are invariant along orbits to floating point), step
``η = 2ρ``, ``z = P_S(ξ_k + η g / ||g||)``, ``ξ_{k+1} = P_S(ξ_k + α (z - ξ_k) + (1-α)(ξ_k -
ξ_{k-1}))`` with ``α = 0.75`` (``ξ_1 = z``), ``g`` the Riemannian gradient at the base point of
``ξ ↦ L_S(γ_ξ(1))`` (projected to the horizontal space), ``P_S`` the horizontal projection
followed by scaling into the ball; the loop only combines horizontal vectors, so ``P_S``
reduces to the scaling. At the checkpoints ``p_0 = 0, p_1 = 0.22,
p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)`` (fractions of ``n_iter``) the step is
halved and the iterate restarts from the best point if fewer than 75 % of the steps since the
last checkpoint improved the best loss, or if neither the step nor the best loss changed.
One forward and one backward pass per iteration give both the loss at ``ξ_k`` and its
gradient. Restarts after the first start from random horizontal directions of norm ``ρ``.

The worst-case measures also report, per batch, the loss ``L_S(x + ξ*)`` at the first-order
move (``retr`` on every block) of the worst perturbation ``ξ*`` found, and from it the
curvature share ``(value - first_order_value) / value`` with ``first_order_value = mean_S
L_S(x + ξ*) - L_S(x)``: the fraction of the worst-case increase that the curvature
(Christoffel) term of the map carries, ``O(ρ)`` as ``ρ → 0``. ``return_perturbation=True``
also returns ``ξ*`` in parameter coordinates.

The model is never modified or copied: perturbed parameters are passed to
:func:`torch.func.functional_call`; train/eval mode, buffers and ``.grad`` are restored
bit-exactly on exit, also on exceptions and ``KeyboardInterrupt``. Loss evaluations run in eval
mode (no dropout, batch-norm running statistics).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .diagnosis import Diagnosis
from .geometry import HALF, ParameterGeometry, find_symmetries
from .linalg import tensor_sum
from .manifolds import AdaptiveGeometry
from .perturbation import MOVES, PERTURBATIONS, PerturbationSpace, move_of
from .ranks import Ranks
from .validation import integer, is_real, positive_int, positive_real, real_in

Tensor = torch.Tensor

__all__ = ["SharpnessResult", "adaptive_sharpness", "average_sharpness", "geodesic_sharpness"]

METRICS = ("mix", "inv")
NORMS = ("riemannian", "adaptive")
MOMENTUM = 0.75
MIN_UPDATE_RATIO = 0.75
FIRST_ORDER_MOVE = "the first-order move of the worst perturbation"  # in messages


@dataclasses.dataclass
class SharpnessResult:
    """Outcome of a sharpness measurement.

    Attributes:
        value: mean over batches of ``worst (or average) loss - base loss``.
        per_batch: that difference for every batch.
        base_losses: unperturbed loss per batch.
        worst_losses: worst loss per batch (average measure: mean perturbed loss).
        perturbation_norms: ball norm ``||ξ||_x`` of the worst perturbation per batch
            (``0`` when no perturbation beat the base loss; ``ρ`` for the average measure).
        trace: ``trace[batch][restart][k]`` best loss after evaluating iterate ``k`` (average
            measure: ``trace[batch][0]`` lists the loss of every sample).
        settings: the switches and sizes of the run, and the geometry summary.
        wall_time: seconds.
        first_order_losses: worst-case measures: per batch, the loss at the first-order move
            ``x + ξ*`` (``retr`` on every block, straight lines on the rest) of the worst
            perturbation ``ξ*`` of ``worst_losses`` (the base loss when ``ξ* = 0``;
            ``worst_losses`` itself with ``perturbation="first_order"``). ``None`` for the
            average measure.
        perturbations: with ``return_perturbation=True``, per batch, ``ξ*`` as a tangent vector
            in parameter coordinates, ``{name: tensor}`` in the parameters' shapes, dtypes and
            device (zeros when ``ξ* = 0``; new tensors, detached); else ``None``.
    """

    value: float
    per_batch: list[float]
    base_losses: list[float]
    worst_losses: list[float]
    perturbation_norms: list[float]
    trace: list[list[list[float]]]
    settings: dict[str, Any]
    wall_time: float
    first_order_losses: list[float] | None = None
    perturbations: list[dict[str, Tensor]] | None = None

    @property
    def first_order_value(self) -> float:
        """``mean_b (first_order_losses[b] - base_losses[b])``: the loss increase at the
        first-order moves ``x + ξ*`` of the worst perturbations; NaN without
        ``first_order_losses``."""
        if self.first_order_losses is None:
            return math.nan
        per_batch = [f - b for f, b in zip(self.first_order_losses, self.base_losses, strict=True)]
        return sum(per_batch) / len(per_batch)

    @property
    def curvature_share(self) -> float:
        """``(value - first_order_value) / value``: the fraction of the worst-case increase that
        the curvature (Christoffel) term of the map is responsible for (``0`` for first-order
        moves, ``O(ρ)`` as ``ρ → 0``, negative where that term lowers the loss at ``ξ*``); NaN
        when ``value == 0`` or without ``first_order_losses``."""
        if self.first_order_losses is None or self.value == 0:
            return math.nan
        return (self.value - self.first_order_value) / self.value

    def to_dict(self) -> dict[str, Any]:
        """Plain ``dict`` of built-in types, ready for :func:`json.dumps`: the fields (not the
        properties), ``perturbations`` as nested lists (:meth:`torch.Tensor.tolist`)."""
        data = dataclasses.asdict(dataclasses.replace(self, perturbations=None))
        if self.perturbations is not None:
            data["perturbations"] = [
                {name: t.tolist() for name, t in xi.items()} for xi in self.perturbations
            ]
        return data

    def __repr__(self) -> str:
        s = self.settings
        return (
            f"SharpnessResult(value={self.value:.6g}, measure={s.get('measure')!r}, "
            f"rho={s.get('rho')}, batches={len(self.per_batch)}, wall_time={self.wall_time:.3g}s)"
        )


# ---------------------------------------------------------------------- model state
@contextlib.contextmanager
def _model_state_preserved(model: nn.Module):
    """Evaluate in eval mode; restore modes, buffers, parameters and ``.grad`` bit-exactly."""
    modes = [(m, m.training) for m in model.modules()]
    buffers = [
        (m, name, b, b.detach().clone())
        for m in model.modules()
        for name, b in m._buffers.items()
        if b is not None
    ]
    params = [(m, name, p) for m in model.modules() for name, p in m._parameters.items()]
    grads = [
        (p, p.grad, None if p.grad is None else p.grad.detach().clone())
        for _, _, p in params
        if p is not None
    ]
    try:
        model.eval()
        yield
    finally:
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for m, name, p in params:
                if m._parameters.get(name) is not p:
                    m._parameters[name] = p
            for m, name, b, saved in buffers:
                if m._buffers.get(name) is not b:
                    m._buffers[name] = b
                b.copy_(saved)
            for p, g, saved in grads:
                if p.grad is not g:
                    p.grad = g
                if g is not None and saved is not None:  # both or neither
                    g.copy_(saved)


class _LossOf(nn.Module):
    """``forward(batch) = loss_fn(model, batch)``: the module given to ``functional_call``."""

    def __init__(self, model: nn.Module, loss_fn: Callable):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)


# ---------------------------------------------------------------------- the problem
class _Problem:
    """Loss of a batch as a function of the perturbation ``ξ`` (a list, one tensor per block)."""

    batch: object  # the current batch, set by the caller before evaluate

    def __init__(
        self, model, loss_fn, geometry: ParameterGeometry, metric, perturbation, norm, eps, ranks
    ):
        self.geometry = geometry
        self.ranks = ranks
        self.failure: str | None = None  # split_batch: this rank's first exception
        self.local_losses: list = []  # split_batch: local losses since the last check
        self.wrapper = _LossOf(model, loss_fn)
        points, w = geometry.gather()
        self.dtype, self.device = w.dtype, w.device
        manifolds = geometry.manifolds(metric, eps=eps)
        self.diagnosis = Diagnosis(geometry, manifolds, points, w, "the model is restored")
        self.diagnosis.check_finite()  # NaN/Inf weights are named as such, not as rank deficient

        def ball(manifold):
            return manifold if norm == "riemannian" else AdaptiveGeometry()

        with self.diagnosis.located():
            self.blocks = [
                PerturbationSpace(m, x, move_of(m, perturbation), ball(m))
                for m, x in zip(manifolds, points, strict=True)
            ]
        rest = geometry.rest_manifold()  # adaptive sharpness: straight lines, its own metric
        self.blocks.append(PerturbationSpace(rest, w, MOVES["first_order"], rest))
        self.batch_index = self.iteration = 0

    def zeros(self) -> list[Tensor]:
        return [b.zeros() for b in self.blocks]

    def sqnorm(self, cs: list[Tensor]) -> Tensor:
        return tensor_sum(b.sqnorm(c) for b, c in zip(self.blocks, cs, strict=True))

    def random_direction(self, gen: torch.Generator, rho: float) -> list[Tensor]:
        """Horizontal direction of norm ``rho``, isotropic in the metric at the base point."""
        cs = [b.random(gen) for b in self.blocks]
        scale = rho / self.sqnorm(cs).sqrt()
        return [c * scale for c in cs]

    def evaluate(
        self, cs: list[Tensor], iteration: int | str, grad: bool, first_order: bool = False
    ):
        """Loss at ``cs`` (detached, compute dtype) and, with ``grad``, its gradient wrt ``cs``;
        with ``distributed="split_batch"`` both averaged over ranks. ``first_order``: every
        block moves by ``retr`` (``x + ξ``) instead of the measure's move. ``iteration``: the
        iterate's index, or what the evaluation is, for messages."""
        self.iteration = iteration
        if self.ranks.mode != "split_batch":
            return self._evaluate(cs, grad, first_order)
        try:
            loss, grads = self._evaluate(cs, grad, first_order)
            self.local_losses.append((self.batch_index, iteration, loss))  # checked lazily
        except Exception as err:  # the other ranks wait in the all-reduce below: join them
            if self.failure is None:
                err = self.located(err)
                self.failure = f"{self.where()}: {type(err).__name__}: {err}"
            loss = torch.full((), math.nan, dtype=self.dtype, device=self.device)
            grads = [torch.zeros_like(c) for c in cs] if grad else None
        return self.ranks.average(loss, grads)

    def where(self) -> str:
        return f"batch {self.batch_index}, {_at(self.iteration)}"

    def located(self, err: Exception) -> Exception:
        """``err``, or where it is a failure of the geometry at faulty weights, the error that
        names them (block label, layer, head, parameters), chained from ``err``."""
        located = self.diagnosis.explain(err)
        if located is None:
            return err
        located.__cause__ = err
        return located

    def first_order_loss(self, cs: list[Tensor]) -> float:
        """Loss at the first-order move ``x + ξ`` of ``cs``: one no-grad forward through
        :meth:`evaluate` (rank-averaged with ``split_batch``); a failing ``loss_fn`` or a
        non-finite loss raises as in the maximiser."""
        loss, _ = self.evaluate(cs, FIRST_ORDER_MOVE, grad=False, first_order=True)
        self.check_finite(loss.reshape(1), 0, 0, at=FIRST_ORDER_MOVE)
        return float(loss)

    def tangent(self, cs: list[Tensor]) -> dict[str, Tensor]:
        """``cs`` in parameter coordinates, as new detached tensors. ``scatter`` is linear: views,
        transposes, concatenations and slice scatters that overwrite every entry (covered ones
        from the blocks, the others from the adaptive vector)."""
        values = self.geometry.scatter(cs[:-1], cs[-1])
        return {name: t.detach().clone() for name, t in values.items()}

    def local_failure(self) -> str | None:
        """split_batch: what failed on this rank (an exception, else its first non-finite
        local loss), or ``None``."""
        if self.failure is not None:
            return self.failure
        for batch, iteration, loss in self.local_losses:
            if not bool(torch.isfinite(loss)):
                return f"non-finite loss ({float(loss)}) on batch {batch} at {_at(iteration)}"
        return None

    def _evaluate(self, cs: list[Tensor], grad: bool, first_order: bool):
        with torch.enable_grad() if grad else torch.no_grad():
            leaves = [c.detach().requires_grad_(grad) for c in cs]
            moves = [b.first_order if first_order else b.move for b in self.blocks]
            ys = [move(c) for move, c in zip(moves, leaves, strict=True)]
            params = self.geometry.scatter(ys[:-1], ys[-1])
            params = {f"model.{name}": t for name, t in params.items()}
            loss = torch.func.functional_call(self.wrapper, params, (self.batch,))
            where = self.where()
            if not isinstance(loss, Tensor):
                raise TypeError(
                    f"loss_fn must return a scalar tensor, got {type(loss).__name__} ({where})"
                )
            if loss.numel() != 1:
                raise ValueError(
                    f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)} ({where})"
                )
            if not grad:
                return loss.detach().reshape(()).to(self.dtype), None
            if not loss.requires_grad:
                raise ValueError(
                    f"loss_fn returned a tensor that does not depend on the parameters ({where})"
                )
            grads = torch.autograd.grad(loss.reshape(()), leaves, allow_unused=True)
        grads = [torch.zeros_like(c) if g is None else g for c, g in zip(cs, grads, strict=True)]
        return loss.detach().reshape(()).to(self.dtype), grads

    def check_finite(self, losses: Tensor, upto: int, restart: int, at: str | None = None):
        """Raise (on every rank) if ``losses[: upto + 1]`` are not all finite; ``at`` names the
        evaluation in the message instead of the iteration and restart. The message also names
        the heads whose factors are rank deficient to working precision, if any."""
        finite = torch.isfinite(losses[: upto + 1])
        if self.ranks.mode == "split_batch":
            if not bool(finite.all()):  # every rank sees the same averaged losses: all get here
                self.ranks.raise_failures(self.local_failure())
            self.local_losses.clear()
        if not bool(finite.all()):
            k = int((~finite).nonzero()[0, 0])
            at = f"iteration {k} (restart {restart})" if at is None else at
            message = (
                f"loss_fn returned a non-finite loss ({float(losses[k])}) on batch "
                f"{self.batch_index} at {at}"
            )
            deficient = self.diagnosis.rank_deficient()  # nearly singular heads are a cause
            if deficient is not None:
                raise ValueError(f"{message}, likely from {deficient}")
            raise ValueError(f"{message}; the model is restored")


def _at(iteration: int | str) -> str:
    """An evaluation as messages name it: ``iteration k``, or its description."""
    return f"iteration {iteration}" if isinstance(iteration, int) else iteration


def _checkpoints(n_iter: int) -> list[int]:
    """Auto-PGD checkpoints ``ceil(p_j n)``: ``p_0 = 0``, ``p_1 = 0.22``,
    ``p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)`` (as in the reference code)."""
    p, w = [0.0, 0.22], [0, math.ceil(n_iter * 0.22)]
    while w[-1] < n_iter and w[-1] != w[-2]:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
        w.append(math.ceil(p[-1] * n_iter))
    return sorted({k for k in w[1:] if 0 < k < n_iter})


def _scale_into_ball_(problem: _Problem, cs: list[Tensor], rho: float) -> list[Tensor]:
    """``P_S`` on horizontal vectors, in place: ``ξ ← ξ · min(1, ρ / ||ξ||_x)``."""
    scale = (rho / problem.sqnorm(cs).sqrt()).clamp(max=1.0)
    for c in cs:
        c.mul_(scale)
    return cs


def _step(problem: _Problem, c, c_prev, grads, eta: float, rho: float, first: bool):
    """``z = P_S(ξ + η g/||g||)``; ``ξ_new = z`` (first step) or
    ``P_S(ξ + α(z - ξ) + (1-α)(ξ - ξ_prev)) = P_S(α z + 2(1-α) ξ - (1-α) ξ_prev)``.

    Fused and in place on fresh tensors: a few passes over the parameters per iteration.
    """
    g = [b.rgrad(d) for b, d in zip(problem.blocks, grads, strict=True)]
    step = eta / (problem.sqnorm(g).sqrt() + torch.finfo(problem.dtype).tiny)
    z = _scale_into_ball_(
        problem, [torch.addcmul(ci, gi, step) for ci, gi in zip(c, g, strict=True)], rho
    )
    if first:
        return z
    a = MOMENTUM
    new = [
        torch.mul(ci, 2 * (1 - a)).add_(pi, alpha=-(1 - a)).add_(zi, alpha=a)
        for ci, zi, pi in zip(c, z, c_prev, strict=True)
    ]
    return _scale_into_ball_(problem, new, rho)


def _host_tracking(device: torch.device) -> bool:
    """Track the best point with host comparisons (free on CPU) rather than on the device."""
    return device.type == "cpu"


def _apgd(problem: _Problem, start: list[Tensor], rho: float, n_iter: int, restart: int, bar):
    """One Auto-PGD run from ``start``; returns (best loss, best ξ, per-iterate losses).

    Iterates are never modified after they are formed, so the best point is kept by reference;
    on CUDA the comparison stays on the device (``torch.where``) to avoid a host sync per
    iteration, and only the checkpoints synchronise.
    """
    checkpoints = set(_checkpoints(n_iter))
    losses = torch.empty(n_iter + 1, dtype=problem.dtype, device=problem.device)
    on_host = _host_tracking(problem.device)
    c, c_prev = start, start
    eta, prev_eta, prev_cp, prev_best = 2.0 * rho, 2.0 * rho, 0, None
    n_updates = torch.zeros((), dtype=torch.int64, device=problem.device)
    for k in range(n_iter + 1):
        last = k == n_iter
        loss, grads = problem.evaluate(c, k, grad=not last)
        losses[k] = loss
        if k == 0:
            problem.check_finite(losses, 0, restart)
            best, best_c, best_g = loss, c, grads
            prev_best = float(loss)
        else:
            improved = loss > best
            n_updates += improved
            if on_host:
                if bool(improved):
                    best, best_c, best_g = loss, c, grads
            else:
                best = torch.where(improved, loss, best)
                best_c = [torch.where(improved, u, v) for u, v in zip(c, best_c, strict=True)]
                if not last:  # grads is a list whenever not last (evaluate(grad=not last))
                    best_g = [
                        torch.where(improved, u, v)
                        for u, v in zip(grads, best_g, strict=True)  # pyright: ignore[reportArgumentType]
                    ]
        if last:
            break
        bar.update(1)
        if k in checkpoints:
            problem.check_finite(losses, k, restart)
            best_now, updates = float(best), int(n_updates)
            stalled = updates < MIN_UPDATE_RATIO * (k - prev_cp)
            frozen = prev_eta == eta and prev_best == best_now
            prev_eta, prev_best, prev_cp = eta, best_now, k
            n_updates.zero_()
            if stalled or frozen:
                eta *= 0.5
                c, c_prev, grads = best_c, best_c, best_g
        c_prev, c = c, _step(problem, c, c_prev, grads, eta, rho, first=k == 0)
    problem.check_finite(losses, n_iter, restart)
    return best, best_c, losses


# ---------------------------------------------------------------------- setup and checks
def checked_metric(metric):
    """A numeric metric ``s`` as a Python ``float`` in ``[0, 1]``; names unchanged."""
    if is_real(metric):
        return real_in("an interpolated metric s", metric, 0.0, 1.0)
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS} or a number s in [0, 1], got {metric!r}")
    return metric


def _check_common(rho, n_iter_name: str, n_iter, seed) -> tuple[float, int, int]:
    """``(rho, n_iter, seed)`` as Python ``float``, ``int``, ``int``."""
    return positive_real("rho", rho), positive_int(n_iter_name, n_iter), integer("seed", seed)


def _setup(model, loss_fn, symmetries, metric, perturbation, norm, warn_missing=True):
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError("loss_fn must be callable as loss_fn(model, batch) -> scalar tensor")
    for value, allowed, what in (
        (perturbation, PERTURBATIONS, "perturbation"),
        (norm, NORMS, "norm"),
    ):
        if value not in allowed:
            raise ValueError(f"{what} must be one of {allowed}, got {value!r}")
    if isinstance(symmetries, str) and symmetries == "auto":
        geometry = find_symmetries(model)
        if not geometry.kinds and warn_missing:
            warnings.warn(
                f"no parameter symmetry detected in {type(model).__name__}: every parameter is "
                "measured in the adaptive geometry (declare blocks with ParameterGeometry for "
                "custom architectures)",
                UserWarning,
                stacklevel=3,
            )
    elif symmetries is None:
        geometry = ParameterGeometry(model)
    elif isinstance(symmetries, ParameterGeometry):
        if symmetries.model is not model:
            raise ValueError("the ParameterGeometry passed as symmetries describes another model")
        geometry = symmetries
    else:
        raise TypeError(
            f"symmetries must be 'auto', None or a ParameterGeometry, got {symmetries!r}"
        )
    if not geometry.params:
        raise ValueError("the model has no trainable parameters (requires_grad=True)")
    half = sorted({str(p.dtype) for p in geometry.params.values() if p.dtype in HALF})
    if half:
        warnings.warn(
            f"the model has {', '.join(half)} parameters: the geometry (points, perturbations, "
            "projections, norms) is computed in float32 and perturbed weights are cast back to "
            "the parameters' dtype for the forward pass",
            UserWarning,
            stacklevel=3,
        )
    return geometry


def _settings(measure, geometry, rho, metric, perturbation, norm, eps, seed, **extra):
    return {
        "measure": measure,
        "rho": rho,
        "metric": metric,
        "perturbation": perturbation,
        "norm": norm,
        "eps": eps,
        "seed": seed,
        **extra,
        "symmetric_blocks": len(geometry.blocks),
        "dtype": str(geometry.compute_dtype),
        "device": str(geometry.device),
        "geometry": geometry.summary(),
    }


def _total(batches, per_batch: int) -> int | None:
    """Progress-bar total ``len(batches) · per_batch``, or ``None`` when ``batches`` has no
    length (a generator; a ``DataLoader`` over an ``IterableDataset``, whose ``len`` raises)."""
    try:
        return len(batches) * per_batch
    except TypeError:
        return None


def _bar(progress: bool, total: int | None, desc: str):
    return tqdm(total=total, desc=desc, disable=not progress, dynamic_ncols=True, leave=False)


# ---------------------------------------------------------------------- measures
def _batch_seed(seed: int, index: int) -> int:
    """Seed of the random draws for the batch of global index ``index`` (split independent)."""
    return (seed * 1_000_003 + index) % 2**63


def _over_batches(
    model,
    problem_args: tuple[Any, ParameterGeometry, Any, Any, Any, Any],
    batches,
    distributed: str,
    seed: int,
    bar,
    one_batch,
):
    """``one_batch(problem, generator, bar)`` for every batch, the model preserved; returns the
    records of all ranks in rank order (``distributed="batches"``) and the :class:`Ranks`.
    Failures on any rank raise on all of them. ``bar`` is ``(progress, steps per batch,
    measure name)``; only rank 0 shows it."""
    ranks = Ranks(distributed)
    progress, per_batch, measure = bar
    bar = _bar(progress and ranks.rank == 0, _total(batches, per_batch), f"{measure} sharpness")
    offset = ranks.batch_offset(batches)
    records, failure, problem = [], None, None
    with _model_state_preserved(model), bar:
        try:
            problem = _Problem(model, *problem_args, ranks)
            gen = torch.Generator(device=problem.device)
            for i, batch in enumerate(batches):
                problem.batch, problem.batch_index = batch, offset + i
                gen.manual_seed(_batch_seed(seed, offset + i))
                records.append(one_batch(problem, gen, bar))
        except Exception as err:  # the other ranks will wait in the gather below: report there
            located = err if problem is None else problem.located(err)
            if ranks.mode != "batches":
                if located is err:
                    raise
                raise located from err
            where = "setup" if problem is None else problem.where()
            failure = f"{where}: {type(located).__name__}: {located}"
    if ranks.mode == "batches":
        ranks.raise_failures(failure)
        records = [r for part in ranks.gather(records) for r in part]
    if not records:
        raise ValueError("batches is empty: nothing to measure sharpness on")
    return records, ranks


def geodesic_sharpness(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batches: Iterable,
    *,
    rho: float,
    metric: str | float = "mix",
    perturbation: str = "default",
    norm: str = "riemannian",
    symmetries: str | ParameterGeometry | None = "auto",
    n_iter: int = 100,
    restarts: int = 1,
    seed: int = 0,
    eps: float | None = None,
    progress: bool = True,
    distributed: str = "batches",
    return_perturbation: bool = False,
    _measure: str = "geodesic",
) -> SharpnessResult:
    """Worst-case geodesic sharpness ``mean_S max_{||ξ||_x ≤ ρ} L_S(γ_ξ(1)) - L_S(x)``.

    Args:
        model: the network; read only (restored bit-exactly, also on errors).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` (move the batch to the model's
            device inside it if needed).
        batches: any iterable of batches (a list, a ``DataLoader``, also over an
            ``IterableDataset``), iterated once.
        rho: ball radius (> 0).
        metric: ``"mix"`` or ``"inv"``: the metric of the GL and re-scaling kinds
            (:meth:`~quotientgeo.QuotientManifold.with_metric`); a number ``s ∈ [0, 1]`` gives
            GL kinds the metric ``(1-s)·inv + s·mix``
            (:class:`~quotientgeo.InterpolatedGLQuotient`, geometry from the generic base).
            Other manifolds declared with :meth:`ParameterGeometry.add` keep their own metric.
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
            ``None`` keeps each kind's own (0 for discovered and ``add_gl_pair`` blocks).
        progress: show a tqdm progress bar (on rank 0 only in a process group).
        distributed: in an initialised ``torch.distributed`` process group of several ranks,
            ``"batches"`` (each rank its own batches; every rank returns the result over all
            ranks' batches in rank order), ``"split_batch"`` (the ``k``-th batches of all ranks
            form one batch: one shared perturbation, loss and gradient averaged over ranks
            each iteration; equally sized rank batches) or ``"off"`` (local results); see
            :mod:`quotientgeo.ranks`. Without a process group it changes nothing.
        return_perturbation: also return each batch's worst perturbation ``ξ*`` in parameter
            coordinates (``SharpnessResult.perturbations``; one parameter-sized copy per batch).

    The result's ``first_order_losses`` (one extra no-grad forward per batch unless
    ``perturbation="first_order"``) give :attr:`SharpnessResult.curvature_share`.

    Random draws (restarts after the first, average-case samples) are seeded per batch by
    ``(seed, batch index)``, so a batch gets the same draws however batches are split.

    Numeric arguments (``rho``, a numeric ``metric``, ``n_iter``, ``restarts``, ``seed``) may be
    Python numbers, numpy scalars or 0-dim tensors (read once with ``.item()``); they are used
    and recorded in ``settings`` as Python ``float`` / ``int``. Bools are rejected.
    """
    rho, n_iter, seed = _check_common(rho, "n_iter", n_iter, seed)
    restarts = positive_int("restarts", restarts)
    if not isinstance(return_perturbation, bool):
        raise TypeError(f"return_perturbation must be True or False, got {return_perturbation!r}")
    metric = checked_metric(metric)
    geometry = _setup(
        model, loss_fn, symmetries, metric, perturbation, norm, warn_missing=_measure != "adaptive"
    )
    t0 = time.perf_counter()

    def one_batch(problem, gen, bar):
        base = worst = None
        worst_c, trace = None, []
        for r in range(restarts):
            start = problem.zeros() if r == 0 else problem.random_direction(gen, rho)
            best, best_c, losses = _apgd(problem, start, rho, n_iter, r, bar)
            if r == 0:
                base = float(losses[0])
                worst, worst_c = base, None
            best = float(best)
            if worst is None or best > worst:  # worst is set at r == 0
                worst, worst_c = best, best_c
            trace.append(torch.cummax(losses, 0).values.tolist())
        norm_c = 0.0 if worst_c is None else float(problem.sqnorm(worst_c).sqrt())
        # the same move, or ξ* = 0 (the base point): no extra forward pass
        same = perturbation == "first_order" or worst_c is None
        first = worst if same else problem.first_order_loss(worst_c)
        xi = None
        if return_perturbation:
            xi = problem.tangent(problem.zeros() if worst_c is None else worst_c)
            if problem.ranks.mode == "batches":  # gathered as pickled objects: via the host
                xi = {name: t.cpu() for name, t in xi.items()}
        return base, worst, norm_c, trace, first, xi

    problem_args = (loss_fn, geometry, metric, perturbation, norm, eps)
    records, ranks = _over_batches(
        model, problem_args, batches, distributed, seed, (progress, restarts * n_iter, _measure),
        one_batch,
    )  # fmt: skip
    base_losses, worst_losses, norms, traces, first_order_losses, xis = (
        list(v) for v in zip(*records, strict=True)
    )
    per_batch = [w - b for w, b in zip(worst_losses, base_losses, strict=True)]
    settings = _settings(
        _measure,
        geometry,
        rho,
        metric,
        perturbation,
        norm,
        eps,
        seed,
        n_iter=n_iter,
        restarts=restarts,
        n_batches=len(per_batch),
        distributed=ranks.mode,
        world_size=ranks.world,
    )
    return SharpnessResult(
        value=sum(per_batch) / len(per_batch),
        per_batch=per_batch,
        base_losses=base_losses,
        worst_losses=worst_losses,
        perturbation_norms=norms,
        trace=traces,
        settings=settings,
        wall_time=time.perf_counter() - t0,
        first_order_losses=first_order_losses,
        perturbations=(
            [{name: t.to(geometry.device) for name, t in xi.items()} for xi in xis]
            if return_perturbation
            else None
        ),
    )


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
    distributed: str = "batches",
) -> SharpnessResult:
    """Adaptive sharpness of Andriushchenko et al. 2023: ``max_{||ξ ⊙ ŵ⁻¹||₂ ≤ ρ} L(w + ξ) - L(w)``.

    Every parameter in the element-wise geometry, straight-line perturbations, the same
    Auto-PGD loop: exactly ``geodesic_sharpness(symmetries=None, perturbation="first_order",
    norm="adaptive")``.
    """
    return geodesic_sharpness(
        model,
        loss_fn,
        batches,
        rho=rho,
        metric="mix",
        perturbation="first_order",
        norm="adaptive",
        symmetries=None,
        n_iter=n_iter,
        restarts=restarts,
        seed=seed,
        progress=progress,
        distributed=distributed,
        _measure="adaptive",
    )


def average_sharpness(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batches: Iterable,
    *,
    rho: float,
    metric: str | float = "mix",
    perturbation: str = "default",
    norm: str = "riemannian",
    symmetries: str | ParameterGeometry | None = "auto",
    n_samples: int = 100,
    seed: int = 0,
    eps: float | None = None,
    progress: bool = True,
    distributed: str = "batches",
) -> SharpnessResult:
    """Average-case sharpness ``mean_S E_ξ L_S(γ_ξ(1)) - L_S(x)`` over ``||ξ||_x = ρ``.

    ``ξ`` is a standard Gaussian of the metric at ``x`` (isotropic in every block), projected
    to the horizontal space and scaled to norm ``ρ``; ``n_samples`` forward passes per batch.
    The switches mean what they mean for :func:`geodesic_sharpness`.
    """
    rho, n_samples, seed = _check_common(rho, "n_samples", n_samples, seed)
    metric = checked_metric(metric)
    geometry = _setup(model, loss_fn, symmetries, metric, perturbation, norm)
    t0 = time.perf_counter()

    def one_batch(problem, gen, bar):
        losses = torch.empty(n_samples + 1, dtype=problem.dtype, device=problem.device)
        losses[0], _ = problem.evaluate(problem.zeros(), 0, grad=False)
        for s in range(1, n_samples + 1):
            cs = problem.random_direction(gen, rho)
            losses[s], _ = problem.evaluate(cs, s, grad=False)
            bar.update(1)
        problem.check_finite(losses, n_samples, 0)
        return float(losses[0]), float(losses[1:].mean()), rho, [losses[1:].tolist()]

    problem_args = (loss_fn, geometry, metric, perturbation, norm, eps)
    records, ranks = _over_batches(
        model, problem_args, batches, distributed, seed, (progress, n_samples, "average"),
        one_batch,
    )  # fmt: skip
    base_losses, mean_losses, _, traces = (list(v) for v in zip(*records, strict=True))
    per_batch = [m - b for m, b in zip(mean_losses, base_losses, strict=True)]
    settings = _settings(
        "average",
        geometry,
        rho,
        metric,
        perturbation,
        norm,
        eps,
        seed,
        n_samples=n_samples,
        n_batches=len(per_batch),
        distributed=ranks.mode,
        world_size=ranks.world,
    )
    return SharpnessResult(
        value=sum(per_batch) / len(per_batch),
        per_batch=per_batch,
        base_losses=base_losses,
        worst_losses=mean_losses,
        perturbation_norms=[rho] * len(per_batch),
        trace=traces,
        settings=settings,
        wall_time=time.perf_counter() - t0,
    )
