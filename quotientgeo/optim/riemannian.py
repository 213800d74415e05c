r"""Train a model's symmetry blocks on their quotients with geoopt's Riemannian optimizers.

:func:`quotient_optimizer` builds a geoopt optimizer (``RiemannianSGD``, ``RiemannianAdam``, …)
whose parameter groups are

1. the **points** of the model's symmetry blocks: one :class:`geoopt.ManifoldParameter` per
   kind of :class:`~quotientgeo.ParameterGeometry` (every head of every layer of that kind
   stacked, shape ``(batch, *point)``) on the kind's manifold, e.g. a GL pair
   ``x = [G; H]`` on a :class:`~quotientgeo.GLQuotient`;
2. every other trainable parameter of the model, as it is: geoopt steps it as its Euclidean
   counterpart (``RiemannianSGD`` as ``torch.optim.SGD``, ``RiemannianAdam`` as
   ``torch.optim.Adam``).

Each :meth:`~QuotientOptimizer.step` copies the blocks' current weights and ``.grad`` into the
points, lets geoopt step (Riemannian gradient, retraction, transport of the moments on the
points; the Euclidean step on the rest) and writes the points back into the weights. The
model's parameters stay the source of truth.

With ``metric="mix"`` a GL pair's Riemannian gradient is ``(∇_G Q⁻¹, ∇_H P⁻¹)``,
``P = GᵀG + eps·I``, ``Q = HᵀH + eps·I``; for a LoRA adapter (``G = B``, ``H = Aᵀ``) that is
``(g_B (AAᵀ + eps·I)⁻¹, (BᵀB + eps·I)⁻¹ g_A)``, the preconditioned gradients of Riemannian
preconditioned LoRA (Zhang & Pilanci 2024). A ``RiemannianSGD`` step with the retraction
``x + u`` is then that method's SGD step.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..geometry import ParameterGeometry
from ..geometry import shards as sh
from ..geometry.diagnosis import Diagnosis
from ..geometry.symmetries import geometry_of
from ..geometry.transfer import gather_blocks, write_blocks_
from ..linalg import deferred_checks
from ..manifolds import FrameDamping, QuotientManifold
from ..manifolds.gl.damping import without_ball
from ..options import checked_metric

with warnings.catch_warnings():
    # geoopt 0.5 decorates helpers with torch.jit.script, which torch now deprecates
    warnings.filterwarnings(
        "ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning
    )
    import geoopt
    from geoopt.optim.mixin import OptimMixin

Tensor = torch.Tensor

__all__ = ["TRAINING_EPS", "QuotientOptimizer", "quotient_optimizer"]

UNCHANGED = "the model's weights are unchanged"
#: The Gram relaxation of blocks declared with a damping that takes its scale from a sharpness
#: ball (``FrameDamping()``, the default of LoRA adapters, or ``BallDamping()``): an optimizer
#: has no ball, so they train with PEFT's default ``reg`` of ``create_riemannian_optimizer``.
TRAINING_EPS = 1e-2


class QuotientOptimizer(torch.optim.Optimizer):
    r"""A geoopt optimizer that steps a model's symmetry blocks on their quotient manifolds.

    :func:`quotient_optimizer` builds one: an instance of a subclass of this class and of the
    geoopt optimizer class it is given (``isinstance(opt, geoopt.optim.RiemannianAdam)`` holds).
    ``param_groups[0]`` holds :attr:`points` (one :class:`geoopt.ManifoldParameter` per kind of
    :attr:`geometry`), ``param_groups[1]`` the model's other trainable parameters (a group is
    left out when it has nothing).

    One :meth:`step`:

    1. ``closure()`` if given (with gradients enabled);
    2. for each kind, the points ``x ← gather(weights)`` and their gradients
       ``x.grad ← gather(.grad)``, both in :attr:`ParameterGeometry.compute_dtype`; a missing
       ``.grad`` counts as zero, except that a kind none of whose parameters has a ``.grad`` is
       skipped as torch skips such a parameter (``x.grad = None``: no weight decay, no
       momentum);
    3. the geoopt optimizer's step on both groups: on a point, the Riemannian gradient
       ``egrad2rgrad(x, ∇)`` (the horizontal ``proj(M(x)⁻¹ ∇)``), the retraction
       ``x + u`` and the transport of the moments by horizontal projection at the new point.
       ``RiemannianSGD``'s momentum buffers start at zero (geoopt alone starts them at the
       Euclidean gradient ``∇``, which makes the first step with momentum ``μ``
       ``-lr·(μ·∇ + grad)``: not equivariant on the points, and not torch's SGD on the
       rest); with ``dampening=0`` the rest then steps exactly as with ``torch.optim.SGD``.
       A partly covered parameter steps whole with the rest, and its block entries are
       then overwritten by the points;
    4. the points written back into the weights (cast to each parameter's dtype); the
       gradient copies are released.

    Why copies, and not the points as the parameters: a point stacks pieces of several
    parameters (``lora_B`` and the transposed ``lora_A``; the query and key rows of each head,
    with their biases; every layer of one kind). No tensor can be a view of them all, and
    moving the parameters into views of one buffer, or behind
    ``torch.nn.utils.parametrize``, changes the model a user holds: the parametrizations
    rename the state dict's keys (``…weight`` becomes ``…parametrizations.weight.original``),
    recompute every weight in each forward pass, and break what expects plain
    parameters (PEFT's ``save_pretrained`` and ``merge_and_unload``, ``load_state_dict``
    of an ordinary checkpoint). With copies the model stays an ordinary ``nn.Module``
    and its parameters remain the source of truth: a weight changed between steps (a loaded
    state dict) is what the next step starts from.

    Cost: one copy of the block parameters (the points, kept between steps, in the compute
    dtype: float32 copies of half-precision weights) and, during a step, one copy of their
    gradients; the optimizer's own state (momentum, Adam's moments) is kept on the points, as
    geoopt keeps it on any parameter. In half precision the weights are rounded to their dtype
    after every step, as they are for any optimizer without master weights.

    :meth:`zero_grad` clears the gradients of the model's block parameters too (those no
    group holds). ``state_dict()`` / ``load_state_dict()`` are torch's: the state of each
    point is saved under its index, so a state dict loads into the optimizer of a model with
    the same symmetry blocks. A failure of the geometry (rank-deficient factors with
    ``eps = 0``, non-finite weights) raises a ``ValueError`` naming the block, layer, head
    and parameters; the model's weights are then unchanged (the points' state, such as
    momentum, is not: the points' factorisations are checked together, in one host read,
    once geoopt has stepped them, before the other parameters are stepped).
    """

    model: nn.Module
    #: the model's parameter geometry, in the metric the points are stepped in
    geometry: ParameterGeometry
    #: the points of each kind, ``(batch, *shape)``, on the kind's manifold
    points: list[geoopt.ManifoldParameter]

    def __init__(
        self,
        params: list[dict[str, Any]],
        *,
        model: nn.Module,
        geometry: ParameterGeometry,
        points: list[geoopt.ManifoldParameter],
        **kwargs: Any,
    ) -> None:
        self.model = model
        self.geometry = geometry
        self.points = points
        plan = geometry.plan
        # the parameters each kind reads, and those no group holds (wholly in blocks)
        self._kind_names: list[tuple[str, ...]] = []
        for ki, kind in enumerate(plan.kinds):
            if kind.product is not None:
                names = [seg.span.name for seg in plan.segments[ki]]
            else:
                names = [r.name for b in kind.blocks for r in plan.blocks[b].regions]
            self._kind_names.append(tuple(dict.fromkeys(names)))
        partial = set(geometry.partial_names)
        self._covered: list[nn.Parameter] = [
            geometry.params[n] for n in geometry.symmetric_names if n not in partial
        ]
        self._diagnosis = Diagnosis(
            geometry, [trained(k.manifold) for k in plan.kinds], geometry.gather, UNCHANGED
        )
        super().__init__(params, **kwargs)

    # ------------------------------------------------------------------ weights <-> points
    @torch.no_grad()
    def _read_points(self) -> None:
        """The points and their gradients from the model's weights and ``.grad``."""
        plan, params = self.geometry.plan, self.geometry.params
        for ki, (x, names) in enumerate(zip(self.points, self._kind_names, strict=True)):
            blocks = range(len(plan.kinds[ki].blocks))
            x.copy_(gather_blocks(plan, ki, blocks, params, x.dtype))
            grads = {n: params[n].grad for n in names}
            if all(g is None for g in grads.values()):
                x.grad = None
                continue
            filled = {n: torch.zeros_like(params[n]) if g is None else g for n, g in grads.items()}
            x.grad = gather_blocks(plan, ki, blocks, filled, x.dtype)

    @torch.no_grad()
    def _write_points(self) -> None:
        """The points into the model's weights (in place; entries outside blocks kept)."""
        plan, params = self.geometry.plan, self.geometry.params
        for ki, x in enumerate(self.points):
            write_blocks_(plan, ki, range(len(plan.kinds[ki].blocks)), x.detach(), params)

    # ------------------------------------------------------------------ the optimizer
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # pyright: ignore[reportIncompatibleMethodOverride]
        """``closure()`` (if given), then the step of the class docstring; returns the
        closure's loss (``None`` without a closure)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._read_points()
        self._start_momentum_at_zero()
        try:
            with self._diagnosis.located():
                # the points first, their factorisations checked in one host read before
                # any weight is written; then the other groups
                points = {id(x) for x in self.points}
                groups = self.param_groups
                ours = [g for g in groups if any(id(p) in points for p in g["params"])]
                with deferred_checks():
                    self._base_step(ours)
                self._base_step([g for g in groups if all(g is not o for o in ours)])
            self._write_points()
        finally:
            for x in self.points:
                x.grad = None
        return loss

    def _base_step(self, groups: list[dict[str, Any]]) -> None:
        """The geoopt class's own step on ``groups`` only, without the hook wrapper torch puts
        on it once that class is instantiated (this class's step is wrapped already, and the
        step hooks run once)."""
        if not groups:
            return
        every, self.param_groups = self.param_groups, groups
        try:
            base = super().step
            unwrapped = getattr(base, "__wrapped__", None)
            if unwrapped is None:
                base()
            else:
                unwrapped(self)
        finally:
            self.param_groups = every

    @torch.no_grad()
    def _start_momentum_at_zero(self) -> None:
        """A zero momentum buffer for every parameter that ``RiemannianSGD`` steps for the
        first time. geoopt starts it at the Euclidean gradient ``∇`` and then adds the
        Riemannian gradient: a first step ``-lr·(μ·∇ + (1-d)·grad)``, which on a point is not
        equivariant (``∇`` transforms as a covector) and on the rest is not torch's SGD. From
        zero it is ``-lr·(1-d)·grad``."""
        if not isinstance(self, geoopt.optim.RiemannianSGD):
            return
        for group in self.param_groups:
            if group["momentum"] > 0:
                for p in group["params"]:
                    if p.grad is not None and not self.state.get(p):
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, with geoopt's integer step counts kept integers.

        ``torch.optim.Adam`` (which ``RiemannianAdam`` extends) turns a loaded ``state["step"]``
        into a float32 tensor; geoopt's step would then compute the bias corrections
        ``1 - β^step`` in float32, and a loaded optimizer would not continue as the one that
        saved it."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            step = state.get("step")
            if isinstance(step, Tensor) and step.numel() == 1:
                state["step"] = int(step.item())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every group and of the model's block parameters."""
        super().zero_grad(set_to_none)
        for p in self._covered:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()


@functools.cache
def _subclass(optimizer_cls: type[torch.optim.Optimizer]) -> type[QuotientOptimizer]:
    """``Quotient<Name>``: :class:`QuotientOptimizer` before ``optimizer_cls`` (one class per
    optimizer class, so that ``type(opt)`` is the same for every call)."""
    name = f"Quotient{optimizer_cls.__name__}"
    return type(name, (QuotientOptimizer, optimizer_cls), {"__module__": __name__})


def quotient_optimizer(
    model: nn.Module,
    optimizer_cls: type[torch.optim.Optimizer],
    *,
    symmetries: str | ParameterGeometry = "auto",
    metric: str | float | None = None,
    eps: float | FrameDamping | None = None,
    **kwargs: Any,
) -> QuotientOptimizer:
    r"""A geoopt optimizer that trains ``model``'s symmetry blocks on their quotients.

    ::

        opt = quotient_optimizer(model, geoopt.optim.RiemannianAdam, lr=1e-3)
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()

    The symmetry blocks (LoRA adapters, attention heads, or the blocks of a geometry you
    declare) step on their quotient manifolds; every other trainable parameter steps as the
    optimizer's Euclidean counterpart, in the same optimizer (:class:`QuotientOptimizer`).

    Args:
        model: the network; its trainable parameters are optimized.
        optimizer_cls: a geoopt Riemannian optimizer class, ``geoopt.optim.RiemannianSGD`` or
            ``geoopt.optim.RiemannianAdam`` (a torch optimizer would ignore the manifolds).
        symmetries: ``"auto"`` (:func:`~quotientgeo.find_symmetries`) or a
            :class:`~quotientgeo.ParameterGeometry` of ``model``.
        metric: ``"mix"``, ``"inv"`` or ``s ∈ [0, 1]`` for the GL and re-scaling blocks
            (``None``: each block's declared metric, ``"mix"`` for discovered ones). With
            ``P = GᵀG + eps·I``, ``Q = HᵀH + eps·I`` the Riemannian gradient of a GL pair
            is ``(∇_G Q⁻¹, ∇_H P⁻¹)`` for ``"mix"`` and ``(∇_G P, ∇_H Q)`` for ``"inv"``.
        eps: Gram relaxation of the GL metrics (``None``: the declared one). A LoRA adapter
            whose ``B`` starts at zero (PEFT's default) has ``P = eps·I``: it needs
            ``eps > 0``. Discovery declares LoRA pairs with
            :class:`~quotientgeo.FrameDamping`, whose scale is a sharpness ball; with
            ``eps=None`` they train with ``TRAINING_EPS`` ``= 1e-2`` (``P + eps·I``,
            ``Q + eps·I``), PEFT's default ``reg``, so that a mix ``RiemannianSGD`` step is
            PEFT's Riemannian SGD step (not GL-invariant, as PEFT's is not);
            ``eps=FrameDamping(radius=r)`` steps invariantly.
        **kwargs: the optimizer's arguments (``lr``, ``momentum``, ``betas``,
            ``weight_decay``, ``stabilize``, …), for both groups; change a group's
            afterwards through ``opt.param_groups``.

    Returns:
        An instance of ``Quotient<optimizer_cls name>``, a subclass of
        :class:`QuotientOptimizer` and of ``optimizer_cls``.

    Raises:
        TypeError: ``optimizer_cls`` is not a geoopt optimizer class, ``model`` not a module,
            ``symmetries`` neither ``"auto"`` nor a geometry.
        ValueError: a model without trainable parameters, a geometry of another model, an
            unknown metric, sharded (FSDP2) parameters, or block points the manifold
            refuses (rank-deficient factors with ``eps = 0``: the message names the block,
            layer, head and parameters).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, OptimMixin)):
        raise TypeError(
            "optimizer_cls must be a geoopt optimizer class (geoopt.optim.RiemannianSGD, "
            f"geoopt.optim.RiemannianAdam), got {optimizer_cls!r}: a torch optimizer would "
            "step the points as flat tensors and ignore their manifolds"
        )
    if not issubclass(optimizer_cls, torch.optim.Optimizer):
        raise TypeError(f"{optimizer_cls.__name__} is not a torch.optim.Optimizer")
    metric = checked_metric(metric)
    if not (
        (isinstance(symmetries, str) and symmetries == "auto")
        or isinstance(symmetries, ParameterGeometry)
    ):
        raise TypeError(f"symmetries must be 'auto' or a ParameterGeometry, got {symmetries!r}")
    geometry = geometry_of(model, symmetries, metric, eps=eps)
    if sh.sharded_parameters(geometry.params.values()):
        raise ValueError(
            "quotient_optimizer does not step sharded (FSDP2) parameters: each kind's points "
            "stack whole blocks of every layer"
        )
    points = _points(geometry)
    partial = set(geometry.partial_names)
    covered = {n for n in geometry.symmetric_names if n not in partial}
    # partly covered parameters step whole with the rest; their block entries are then
    # overwritten by the points
    rest = [p for n, p in geometry.params.items() if n not in covered]
    groups = [{"params": g} for g in (points, rest) if g]
    return _subclass(optimizer_cls)(groups, model=model, geometry=geometry, points=points, **kwargs)


def trained(manifold: QuotientManifold) -> QuotientManifold:
    """``manifold`` as an optimizer steps it: relaxed by ``TRAINING_EPS`` where it was
    declared with a damping that waits for a sharpness ball's radius (which an optimizer
    lacks)."""
    return without_ball(manifold, TRAINING_EPS)


def _points(geometry: ParameterGeometry) -> list[geoopt.ManifoldParameter]:
    """One :class:`geoopt.ManifoldParameter` per kind, gathered from the weights; a point
    the kind's manifold refuses raises the error that names its block, layer and head."""
    plan, dtype = geometry.plan, geometry.compute_dtype
    points = []
    for ki, kind in enumerate(plan.kinds):
        x = gather_blocks(plan, ki, range(len(kind.blocks)), geometry.params, dtype)
        ok, reason = trained(kind.manifold)._check_point_on_manifold(x)
        if not ok:
            diagnosis = Diagnosis(
                geometry,
                [trained(k.manifold) for k in plan.kinds],
                geometry.gather,
                "nothing was built",
            )
            located = diagnosis.rank_deficient() if x.isfinite().all() else diagnosis.non_finite()
            raise located or ValueError(
                f"the points of kind {ki} ({kind.describe()}) are refused by their manifold: "
                f"{reason}"
            )
        # geoopt's __new__ takes the manifold; pyright checks the call against Parameter's
        points.append(geoopt.ManifoldParameter(x, manifold=trained(kind.manifold)))  # pyright: ignore[reportCallIssue]
    return points
