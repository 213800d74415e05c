r"""Sharpness-aware minimisation (SAM) in a model's parameter geometry.

One step at weights ``w`` with gradient ``g = ∇L(w)``:

1. ``first_step``: move the weights, in place, to :math:`w̃ = γ_ξ(1)`, the end of the
   (geodesic) step along :math:`ξ = ρ \operatorname{grad} L / \|\operatorname{grad} L\|_w`, the
   Riemannian gradient scaled to metric norm ``ρ``;
2. ``second_step``: put ``w`` back (bit-exactly) and step the base optimizer with the gradient
   taken at ``w̃``.

The three variants share every line but the geometry:

- ``"sam"`` (Foret et al. 2021): the flat metric, :math:`ξ = ρ g / \|g\|_2`, :math:`w̃ = w + ξ`;
- ``"asam"`` (Kwon et al. 2021, the l2 form): the element-wise adaptive metric
  :math:`\sum ξ^2 / |w|^2` on every parameter,
  :math:`ξ = ρ |w|^2 ⊙ g / \| |w| ⊙ g \|_2`, :math:`w̃ = w + ξ`;
- ``"geodesic"``: the quotient geometry of :func:`~quotientgeo.find_symmetries` (or the
  blocks given): on each symmetry block ``ξ`` is the horizontal Riemannian gradient and ``w̃``
  its second-order geodesic step :math:`x + ξ - \tfrac12 Γ(ξ, ξ)` (or first-order, or exact);
  the other parameters move as in ASAM. ``ξ`` and the geodesic map are equivariant under the
  symmetry group, so two parameterisations of one function are perturbed into two
  parameterisations of one function; SAM and ASAM perturb them into different functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..geometry import ParameterGeometry
from ..geometry import shards as sh
from ..geometry.diagnosis import Diagnosis
from ..geometry.perturbation import BasePoint, Perturbations, Piece, Sums, clone_together
from ..geometry.symmetries import geometry_of
from ..linalg import deferred_checks
from ..manifolds import AdaptiveGeometry, EuclideanGeometry, QuotientManifold
from ..options import Perturbation, checked_metric, option
from ..validation import positive_real
from .fused import RestViews, fused_rest_sqnorm, fused_rest_step, rest_views

Tensor = torch.Tensor

__all__ = ["GeodesicSAM"]

VARIANTS = ("sam", "asam", "geodesic")


class GeodesicSAM(torch.optim.Optimizer):
    r"""SAM, ASAM or geodesic SAM around a base optimizer (module docstring).

    Usage follows the common PyTorch SAM implementations::

        opt = GeodesicSAM(model, torch.optim.AdamW, rho=0.05, lr=1e-3, weight_decay=0.05)
        loss_fn(model, batch).backward(); opt.first_step(zero_grad=True)
        loss_fn(model, batch).backward(); opt.second_step(zero_grad=True)
        # or, with closure() computing the loss and calling backward(): opt.step(closure)

    Args:
        model: the network; its trainable parameters are optimized.
        base_optimizer: an optimizer class (``torch.optim.AdamW``, ...), built here on the
            model's parameters with ``**kwargs``.
        rho: radius of the perturbation in the variant's metric (> 0).
        variant: ``"sam"``, ``"asam"`` or ``"geodesic"``.
        metric: ``"mix"`` or ``"inv"`` (or ``s ∈ [0, 1]``) for the GL and re-scaling blocks
            (``"geodesic"`` only).
        perturbation: ``"second_order"``, ``"first_order"`` or ``"exact"`` geodesic step on the
            symmetry blocks (``"geodesic"`` only).
        symmetries: ``"auto"`` (:func:`~quotientgeo.find_symmetries`) or a
            :class:`~quotientgeo.ParameterGeometry` of ``model`` (``"geodesic"`` only).
        eps: Gram relaxation of the GL metrics (``None``: the declared one).
        average_gradients: average ``.grad`` over the ranks of an initialised
            ``torch.distributed`` process group before each of the two steps (one all-reduce
            of a flat buffer), for data parallelism without ``DistributedDataParallel``. Off
            by default: like every PyTorch optimizer, the steps use ``.grad`` as it is, which
            is right under ``DistributedDataParallel`` (it averages in ``backward``) and when
            the ranks train different models.
        compile: take the two passes over the rest (the parameters without symmetry; every
            parameter for SAM and ASAM) by kernels compiled with :func:`torch.compile`
            (:mod:`quotientgeo.optim.fused`; the first steps compile them), one call per pass
            for all of the rest: the norm agrees with the eager path's to rounding, and the
            step is the eager path's formula in its order.

    ``param_groups`` are the base optimizer's (so learning-rate schedulers built on either
    object act on both), ``state_dict()``/``load_state_dict()`` are the base optimizer's.
    Between the two steps the original weights are kept: one copy of the trainable parameters
    (in their own dtypes), no copy of the model; the geometry's points and their cache are
    built once per step.
    """

    def __init__(
        self,
        model: nn.Module,
        base_optimizer: Callable[..., torch.optim.Optimizer],
        rho: float = 0.05,
        *,
        variant: str = "geodesic",
        metric: str | float | None = None,
        perturbation: str = "second_order",
        symmetries: str | ParameterGeometry = "auto",
        eps: float | None = None,
        average_gradients: bool = False,
        compile: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        rho = positive_real("rho", rho)
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        perturbation = option(Perturbation, "perturbation", perturbation)
        metric = checked_metric(metric)
        if not isinstance(compile, bool):
            raise TypeError(f"compile must be True or False, got {compile!r}")
        if not callable(base_optimizer):
            raise TypeError("base_optimizer must be an optimizer class, e.g. torch.optim.AdamW")
        self.model = model
        self.variant = variant
        self.average_gradients = bool(average_gradients)
        self.compiled = compile
        self.geometry: ParameterGeometry = self._geometry(model, variant, symmetries, metric, eps)
        if not self.geometry.params:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        self.rest: AdaptiveGeometry | EuclideanGeometry = (
            EuclideanGeometry() if variant == "sam" else self.geometry.rest_manifold()
        )
        self.perturbation: Perturbation = perturbation
        self.space = Perturbations(self.geometry, perturbation, rest=self.rest, radius=rho)
        params = list(self.geometry.params.values())
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer: torch.optim.Optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups: list[dict[str, Any]] = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)
        self._origin: dict[str, Tensor] | None = None

    @staticmethod
    def _geometry(model, variant, symmetries, metric, eps) -> ParameterGeometry:
        if variant != "geodesic":
            return ParameterGeometry(model)  # every parameter in the rest
        if (isinstance(symmetries, str) and symmetries == "auto") or isinstance(
            symmetries, ParameterGeometry
        ):
            return geometry_of(model, symmetries, metric, eps=eps, warn_missing=False)
        raise TypeError(f"symmetries must be 'auto' or a ParameterGeometry, got {symmetries!r}")

    # ------------------------------------------------------------------ the two steps
    def _gradients(self) -> dict[str, Tensor]:
        """The local parts of the parameters' gradients by name (zeros where ``.grad`` is
        ``None``)."""
        return {
            name: torch.zeros_like(sh.local(p)) if p.grad is None else sh.local(p.grad)
            for name, p in self.geometry.params.items()
        }

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        """Move the weights in place to the perturbed point ``γ_ξ(1)`` (module docstring).

        Part by part (:mod:`quotientgeo.geometry.perturbation`): the Riemannian gradient of each
        part and its square norm first, then, scaled to the radius, its geodesic step written
        into the weights; the original weights are kept (one copy, the parameters' local parts). A
        failure of the geometry at rank-deficient or non-finite weights raises a
        ``ValueError`` naming the block, layer, head and parameters; the weights and ``.grad``
        are then unchanged."""
        if self._origin is not None:
            raise RuntimeError("first_step was called twice; call second_step in between")
        if self.average_gradients:
            _average_gradients_(self.model, self.geometry.params.values())
        rho = self.param_groups[0]["rho"]
        if rho != self.space.radius:  # a scheduled radius: the ball-scaled relaxations follow it
            self.space = Perturbations(self.geometry, self.perturbation, rest=self.rest, radius=rho)
        space, dtype = self.space, self.space.dtype
        weights, grads = space.local(), self._gradients()
        diagnosis = Diagnosis(
            self.geometry,
            space.manifolds,
            None if space.sharded else lambda: self.geometry.gather(),
            "the weights are unchanged",
        )

        base = BasePoint(weights, dtype)  # the factors of both passes computed once

        # the chunks' gradients kept for the second pass, with their points where both fit,
        # within one piece's memory (what a piece of the rest's passes allocates); the others
        # computed again there
        budget = space.piece_size * dtype.itemsize
        with diagnosis.located():
            sums, kept, held = Sums(space), {}, 0
            with deferred_checks():  # the factorisations checked in one host read
                for chunk in space.all_chunks():
                    s, d = base.space(chunk, chunk.read(weights, dtype)), chunk.read(grads, dtype)
                    g = s.rgrad(d)
                    sums.add(chunk, s.gradient_sqnorm(g, d))
                    size = g.numel() * g.element_size()
                    if held + 2 * size <= budget:
                        kept[id(chunk)], held = (s, g), held + 2 * size
                    elif held + size <= budget:
                        kept[id(chunk)], held = (None, g), held + size
            # with compile, the pieces that the kernels take, their views built once
            fused = None
            if self.compiled:
                fused = rest_views(space.rest, self.rest, weights, grads, dtype)
            if fused is not None:
                sums.add(fused.pieces[0], fused_rest_sqnorm(fused, self.rest))
            for piece in self._eager_rest(fused):
                sums.add(piece, self._rest_sqnorm(piece, weights, grads))
            norm = sums.total()
            scale = rho / (norm.sqrt() + torch.finfo(norm.dtype).tiny)
            # the weights as they are (one allocation); then each part's step, read from them
            self._origin = dict(zip(weights, clone_together(list(weights.values())), strict=True))
            try:
                with deferred_checks():  # (the factors are the first pass's: none are new)
                    for chunk in space.all_chunks():
                        s, g = kept.pop(id(chunk), (None, None))
                        if s is None:
                            s = base.space(chunk, chunk.read(self._origin, dtype))
                        if g is None:
                            g = s.rgrad(chunk.read(grads, dtype))
                        chunk.write_(weights, s.move(g * scale))
                if fused is not None:
                    fused_rest_step(fused, self.rest, scale)
                for piece in self._eager_rest(fused):
                    self._rest_step_(piece, weights, grads, scale)
            except BaseException:
                self.restore()
                raise
        if zero_grad:
            self.zero_grad()

    def _eager_rest(self, fused: RestViews | None) -> list[Piece]:
        """The pieces of the rest that the eager passes take: those the compiled kernels do
        not (``fused``, :func:`~quotientgeo.optim.fused.rest_views`)."""
        taken = {id(piece) for piece in fused.pieces} if fused is not None else set()
        return [piece for piece in self.space.rest if id(piece) not in taken]

    # The adaptive rest (every parameter for SAM and ASAM) moves along straight lines in an
    # element-wise metric, ``ξ = ρ ŵ² ∇ / ||ŵ ∇||`` (``ŵ = 1`` for SAM): its two passes run on
    # the parameters' own tensors, a piece's segments as a list of views, one ``_foreach``
    # operator per formula, reading ``w`` and ``∇`` in place; a piece that has no such views
    # (masked, non-contiguous or in another dtype than the compute dtype) is read as one
    # vector and written back.
    def _rest_sqnorm(self, piece: Piece, weights, grads) -> Tensor:
        """``||grad||²`` of the piece in the rest's metric: ``Σ (ŵ ∇)²`` (``Σ ∇²`` for SAM)."""
        w, d = _entries(piece, weights, self.space.dtype), _entries(piece, grads, self.space.dtype)
        if isinstance(self.rest, AdaptiveGeometry):
            d = self.rest.whitened_gradients(w, d)
        norms = torch._foreach_norm(d)  # pyright: ignore[reportPrivateImportUsage]
        return torch.linalg.vector_norm(torch.stack(norms)).square()

    def _rest_step_(self, piece: Piece, weights, grads, c: Tensor) -> None:
        """The piece's weights ``← w + c ŵ² ∇`` (``w + c ∇`` for SAM), in place."""
        dtype = self.space.dtype
        w, d = piece.views(weights, dtype), _entries(piece, grads, dtype)
        own = w is None  # a vector of its own: written back at the end
        if w is None:
            w = [piece.read(weights, dtype)]
        if isinstance(self.rest, AdaptiveGeometry):
            self.rest.add_scaled_rgrad_(w, d, c)
        else:
            torch._foreach_add_(w, torch._foreach_mul(d, c))  # pyright: ignore[reportPrivateImportUsage]
        if own:
            piece.write_(weights, w[0])

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        """Restore the weights of :meth:`first_step` and step the base optimizer with the
        gradients now in ``.grad`` (taken at the perturbed point)."""
        if self._origin is None:
            raise RuntimeError("second_step needs a first_step before it")
        self.restore()
        if self.average_gradients:
            _average_gradients_(self.model, self.geometry.params.values())
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    @property
    def manifolds(self) -> list[QuotientManifold]:
        """Each kind's manifold as the current ball perturbs it (a LoRA pair's
        ``FrameDamping()`` with this optimizer's ``rho``)."""
        return self.space.manifolds

    @torch.no_grad()
    def restore(self) -> None:
        """Put back, bit-exactly, the weights that :meth:`first_step` moved, and step nothing
        (:meth:`second_step` is ``restore()`` and the base optimizer's step). For training
        loops that step the base optimizer themselves, e.g.
        :class:`~quotientgeo.integrations.transformers.SAMTrainer`."""
        if self._origin is None:
            raise RuntimeError("restore needs a first_step before it")
        weights = self.space.local()
        origin = [self._origin[name] for name in weights]
        torch._foreach_copy_(list(weights.values()), origin)  # pyright: ignore[reportPrivateImportUsage]
        self._origin = None

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor:
        """``loss = closure()``, :meth:`first_step`, ``closure()``, :meth:`second_step`; returns
        the loss at the unperturbed weights. ``closure`` zeroes nothing itself: it computes the
        loss and calls ``backward()`` (several micro-batches may accumulate)."""
        if closure is None:
            raise ValueError(
                "GeodesicSAM.step needs a closure that computes the loss and calls backward(); "
                "or call first_step() and second_step() yourself"
            )
        with torch.enable_grad():
            loss = closure()
        self.first_step(zero_grad=True)
        with torch.enable_grad():
            closure()
        self.second_step()
        return loss

    def __repr__(self) -> str:
        """The variant, radius and (geodesic) metric, map and blocks, then the base optimizer."""
        settings = [f"variant={self.variant!r}", f"rho={self.param_groups[0]['rho']:g}"]
        if self.variant == "geodesic":
            metrics = ", ".join(repr(m) for m in self.geometry.metrics) or "none"
            settings += [
                f"metric={metrics}",
                f"perturbation={self.perturbation.value!r}",
                f"blocks={len(self.geometry.blocks)}",
            ]
        return (
            f"{type(self).__name__}({', '.join(settings)}, base_optimizer={self.base_optimizer!r})"
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return self.base_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.base_optimizer.load_state_dict(state_dict)
        self.param_groups = self.base_optimizer.param_groups


def _entries(piece: Piece, tensors, dtype: torch.dtype) -> list[Tensor]:
    """The piece's entries of ``tensors`` in ``dtype``: its segments' views, else one vector."""
    views = piece.views(tensors, dtype)
    return [piece.read(tensors, dtype)] if views is None else views


def _average_gradients_(model: nn.Module, params) -> None:
    """Average ``.grad`` over the ranks of an initialised process group (in place, one
    all-reduce per gradient), unless ``model`` is a
    ``DistributedDataParallel`` that already did."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return
    for g in [p.grad for p in params if p.grad is not None]:
        dist.all_reduce(g)
        g.div_(dist.get_world_size())
