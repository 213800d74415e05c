r"""The loss of a batch as a function of the perturbation ``ξ``, with ``ξ`` held by the model.

Auto-PGD maximises ``ξ ↦ L_S(γ_ξ(1))`` over a ball. The :class:`Objective` keeps its iterates
the way an optimizer keeps its state, in parameter coordinates (one tensor per trainable
parameter, its local part on a sharded model, in the parameter's dtype), and the model's own
weights hold the perturbed point ``w̃ = γ_ξ(1)`` of the current iterate, so that an evaluation
is the model's ordinary forward and ``backward()``, and the gradient lands in ``.grad``:

==============  =========================  ===================================================
buffer          size                       why
==============  =========================  ===================================================
``x0``          one copy                   the base point of the geometry; restores the model
``previous``    one copy                   ``ξ_{k-1}``, Auto-PGD's momentum
``current``     the symmetric parameters,  ``ξ_k`` where the geodesic map moves it; elsewhere
                until the backward pass    ``ξ_k = w̃ - x0`` is read off the weights
                parks them
``best``        one copy, only while the   the best iterate (restarts and the result); while
                best iterate is older      it is ``ξ_k`` or ``ξ_{k-1}`` it *is* that iterate
                than ``ξ_{k-1}``           and has no buffer of its own
``.grad``       (the backward pass's own)  ``∇L(w̃)``, then the step's gradient in place
==============  =========================  ===================================================

Whether ``ξ_k`` is the new best point is known after its forward pass (Auto-PGD reads the
comparison then, on every device): a best point of its own is freed then, before the backward
pass, and the step writes ``ξ_k`` once, as the previous iterate that is also the best. So an
ascent that improves at every step, or at every other step, holds two copies besides the
model's weights, its gradients and ``current``; a step after two that did not improve holds
three (Auto-PGD's checkpoints restart such runs; a restart hands the best point's buffers to
``ξ_{k-1}``). Where the best iterate is (:class:`Best`), and how each event of a run moves it,
one method per event:

======================  ====================  ========================  ========================
event (method)          best is ξ_k           best is ξ_{k-1}           best is older
                        (``CURRENT``)         (``PREVIOUS``)            (``OWN``)
======================  ====================  ========================  ========================
start                   ``PREVIOUS``:         ``PREVIOUS``              ``PREVIOUS``; its
(:meth:`begin`)         ξ_0 = ξ_{-1}                                    buffers are dropped
ξ_k beats the best      ``CURRENT``           ``CURRENT``               ``CURRENT``; its
(:meth:`keep_best`)                                                     buffers are freed
step                    ``PREVIOUS``: ξ_k is  ``OWN``: ξ_{k-1}'s        ``OWN``
(:meth:`advance`)       written once, as      buffers become the best
                        ξ_{k-1}               point's, ξ_k goes to
                                              fresh ones
restart                 ``CURRENT``:          ``CURRENT``: ξ_k ←        ``CURRENT``: its buffers
(:meth:`restart`)       ξ_{k-1} ← ξ_k         ξ_{k-1}, evaluated        become ξ_{k-1}'s, ξ_k ←
                                              again                     them, evaluated again
end                     ``PREVIOUS``:         ``PREVIOUS``              ``OWN``
(:meth:`best_iterate`)  ξ_{k-1} ← ξ_k
======================  ====================  ========================  ========================

With ``compile`` (:mod:`.fused`) the step from ``PREVIOUS`` copies ``ξ_{k-1}``'s values to the
fresh buffers, which become the best point's, and writes ``ξ_k`` into ``ξ_{k-1}``'s own: the
same memory, and the step's kernels are those of every other step.

The backward pass does not read a weight again once that weight's gradient is accumulated, so
from then on a symmetric parameter's own storage can hold ``ξ_k``, and ``ξ_k``'s buffer can go
(:meth:`Objective._park`). The symmetric parameters are parked in groups: consecutive in the
backward pass's order (the reverse of the parameters'), each of at most a piece's worth of
entries (``Perturbations.piece_size``), or one larger parameter; a hook on each parameter moves
the whole group in one ``_foreach_copy_`` once every parameter of the group has its gradient.
From there until the next step writes the weights, ``current`` of those parameters *is* the
weight tensor. So, but for at most a group's worth, a symmetric parameter never holds ``w̃``,
``ξ_k`` and ``∇L`` at once, and the peak, at the end of the backward pass, holds ``x0``,
``previous`` and at most ``best`` besides the model's weights and gradients; and parking costs
a number of operators that grows with the parameters' bytes, not with their count. On a model
sharded with FSDP2 the hook runs once the reduce-scatter has written the parameter's gradient
shard, and parks the local part. Models that recompute their forward pass in the backward pass
(activation checkpointing, where a weight is read again) keep ``current`` throughout.

Everything else is transient and per part (:mod:`quotientgeo.geometry.perturbation`): a chunk of
symmetry blocks in the compute dtype, or a piece of the parameters' entries. A restart from an
earlier best point evaluates its gradient again rather than keeping it: one buffer less, one
forward pass more (an evaluation's backward pass runs only once the step needs it). Every
iterate is a combination of the current one, the previous one and the gradient, so one pass
over the parameters gives their Gram matrix ``K`` in the ball's metric, and Auto-PGD
(:mod:`.apgd`) chooses the combination ``ξ_{k+1} = c · (ξ_k, ξ_{k-1}, g)`` from it. The
iterates' own products then follow from ``K`` and ``c``: ``<ξ_{k+1}, ξ_{k+1}> = cᵀ K c``,
``<ξ_{k+1}, ξ_k> = (K c)₀``, ``<ξ_k, ξ_k> = K₀₀`` (after a restart both iterates are the best
one, whose square norm was known when it was kept), so the next pass takes only the products
with the new gradient, and in the ball's own metric ``M`` without applying it: ``g = Π M⁻¹ d``
is the ``M``-orthogonal projection onto the horizontal space of ``M⁻¹ d``, ``d = J(ξ)ᵀ ∇`` the
gradient with respect to ``ξ``, so ``<v, g>_M = <v, d>`` for the horizontal iterates and ``g``
itself (for the adaptive rest ``Σ ξ ∇``, ``Σ ξ' ∇`` and ``Σ ŵ² ∇²``); in another ball's metric
a chunk's metric is applied to ``g`` alone. Only the first iteration's pass is whole, and
every pass where the parameters are in a lower precision than the compute dtype: the iterates
stored there are the combination rounded (and not exactly horizontal).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..geometry import ParameterGeometry
from ..geometry import shards as sh
from ..geometry.diagnosis import Diagnosis
from ..geometry.perturbation import (
    BasePoint,
    Perturbations,
    Piece,
    Segment,
    Sums,
    empty_like_together,
    mirror_upper,
)
from ..heap import release_free_memory
from ..linalg import DeferredChecks
from .fused import fusable, fused_gram, fused_held_step, fused_step
from .ranks import Local, add_note

Tensor = torch.Tensor

__all__ = ["Best", "Objective", "Where"]


class Best(str, enum.Enum):
    """Which tensors hold Auto-PGD's best iterate (the module's table of transitions)."""

    CURRENT = "current"  #: ξ_k's
    PREVIOUS = "previous"  #: ξ_{k-1}'s
    OWN = "own"  #: buffers of its own (``Objective.best``): it is older than both


@dataclasses.dataclass(frozen=True)
class Where:
    """An evaluation as messages name it: the batch, the restart, and the iteration index or
    what the evaluation is."""

    batch: int
    at: int | str = 0
    restart: int = 0

    def __str__(self) -> str:
        return f"batch {self.batch}, {self.moment}"

    @property
    def moment(self) -> str:
        """``iteration k (restart r)``, or what the evaluation is."""
        if isinstance(self.at, str):
            return self.at
        return f"iteration {self.at} (restart {self.restart})"

    def iteration(self, k: int) -> Where:
        return dataclasses.replace(self, at=k)


class Objective:
    """``ξ ↦ L_S(γ_ξ(1))`` on the batch of :meth:`begin`, and the ball it is maximised in.

    Args:
        model, loss_fn: the network and ``loss_fn(model, batch) -> scalar tensor``.
        space: the parts of the model's parameter geometry, each with its map and ball metric.
        x0: the starting weights by name (local parts; written back by the caller).
        ranks: the rank mode (losses and gradients averaged over ranks with ``split_batch``).
        worst_case: keep ``previous`` and ``best`` (Auto-PGD); without, one scratch buffer.
        compiled: take the adaptive rest's Gram pass and the step by compiled kernels
            (:mod:`quotientgeo.sharpness.fused`), where the pieces allow it.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[nn.Module, Any], Tensor],
        space: Perturbations,
        x0: Mapping[str, Tensor],
        ranks: Local,
        *,
        worst_case: bool = True,
        compiled: bool = False,
    ):
        self.model, self.loss_fn, self.space, self.ranks = model, loss_fn, space, ranks
        self.geometry: ParameterGeometry = space.geometry
        self.dtype = space.dtype
        self.device = self.geometry.device
        self.x0 = dict(x0)
        self.base = BasePoint(self.x0, self.dtype)  # x0's factors, computed once
        self.weights = space.local()  # the model's own (local) weights: w̃ lives here
        self.diagnosis = Diagnosis(
            self.geometry,
            space.manifolds,
            None if space.sharded else self._points,
            "the model is restored",
        )
        self.diagnosis.check_finite(self.x0)
        explicit = space.symmetric_names
        # the parameters whose every entry moves along a straight line, x + ξ
        wholly = set(explicit) - set(self.geometry.plan.partial)
        self.straight = {name for name in space.params if name not in wholly}
        self.current = space.empty(explicit)  # ξ_k where it cannot be read off the weights
        self._parked: set[str] = set()  # names whose ξ_k is in the weights (``current`` aliases)
        self._parking = False  # a backward pass of :meth:`gradient` is running
        self._accumulated: set[str] = set()  # names whose gradient this backward pass has
        self._group = {n: g for g in _parking_groups(self.current, space.piece_size) for n in g}
        self._hooks = []
        if not _recomputes_forward(model):
            for name in explicit:
                hook = functools.partial(self._park, name)
                self._hooks.append(space.params[name].register_post_accumulate_grad_hook(hook))
        # the last piece that reads each parameter: its gradient is freed after it
        self._last_piece = {n: i for i, piece in enumerate(space.pieces) for n in piece.names}
        self.previous = space.empty()  # ξ_{k-1} (the average measure's scratch)
        self.worst_case = worst_case
        self.compiled = compiled
        self._best = Best.PREVIOUS
        self.best: dict[str, Tensor] | None = None  # the buffers of the best iterate, if OWN
        self.batch: Any = None
        self.where = Where(0)
        self._pending: tuple[Tensor, Where] | None = None  # a forward pass to differentiate
        #: The iterates are kept in the compute dtype, so their Gram block after a step is
        #: that of the combination the step computed (module docstring).
        self._exact_iterates = all(p.dtype == self.dtype for p in space.params.values())
        #: ``(<ξ_k, ξ_k>, <ξ_k, ξ_{k-1}>, <ξ_{k-1}, ξ_{k-1}>)`` in the ball's metric, where known
        self._block: tuple[Tensor, Tensor, Tensor] | None = None
        self._best_sqnorm: Tensor | None = None  # the best iterate's, where known
        self._gram: Tensor | None = None  # the last K
        # the moves' matrix exponentials read nothing on the host: their checks are read with
        # the losses' finiteness (a failed one is NaN, so the loss after it is not finite)
        self.checks = DeferredChecks(factorisations=False)

    def __enter__(self) -> Objective:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hooks from the model's parameters."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    @torch.no_grad()
    def _park(self, name: str, param: Tensor) -> None:
        """After the gradient of parameter ``name`` is accumulated (a hook): once every
        parameter of its parking group has its gradient, their weights, which the backward pass
        no longer reads, take ``ξ_k``, and ``ξ_k``'s own buffers are freed."""
        if not self._parking or name in self._parked:
            return
        self._accumulated.add(name)
        group = self._group[name]
        if not self._accumulated.issuperset(group):
            return
        weights, own = [self.weights[n] for n in group], [self.current[n] for n in group]
        torch._foreach_copy_(weights, own)  # pyright: ignore[reportPrivateImportUsage]
        for t in own:
            if t.is_cuda:  # FSDP2 calls the hook on its reduce-scatter stream
                t.record_stream(torch.cuda.current_stream(t.device))
        self.current.update(zip(group, weights, strict=True))
        self._parked.update(group)

    @torch.no_grad()
    def _unpark(self) -> None:
        """``ξ_k`` back in buffers of its own, before the weights are written."""
        for name in self._parked:
            self.current[name] = self.current[name].clone(memory_format=torch.contiguous_format)
        self._parked.clear()

    def _points(self) -> tuple[list[Tensor], Tensor]:
        """The base point gathered (for messages only; ``None`` where sharded)."""
        return self.geometry.gather(self.x0, dtype=self.dtype)

    # ------------------------------------------------------------------ parameter-wise passes
    def _off_weights(self, piece: Piece) -> bool:
        """Whether every segment of ``piece`` has ``ξ_k = w̃ - x0`` (none held in ``current``)."""
        return not any(seg.name in self.current for seg in piece.segments)

    def _xi_entries(self, piece: Piece) -> list[Tensor]:
        """The piece's entries of the current iterate ``ξ_k`` (compute dtype), segment by
        segment: views of ``current`` where it is held there, else ``w̃ - x0`` read off the
        weights in one ``_foreach_sub`` (:meth:`Piece.differences`)."""
        off = tuple(seg for seg in piece.segments if seg.name not in self.current)
        read_off = piece if len(off) == len(piece.segments) else Piece(off)
        diffs = iter(read_off.differences(self.weights, self.x0, self.dtype) if off else [])
        return [
            seg.of(self.current[seg.name]).to(self.dtype)
            if seg.name in self.current
            else next(diffs)
            for seg in piece.segments
        ]

    @torch.no_grad()
    def _move_(self, source: Mapping[str, Tensor], *, first_order: bool = False) -> None:
        """Weights ``← γ_ξ(1)`` for ``ξ = source``: the symmetry blocks by their map (or
        ``x + ξ`` with ``first_order``), every other entry ``x + ξ``."""
        self._unpark()
        self._write_sums_(source, set(self.space.params) if first_order else self.straight)
        if not first_order:
            self._move_blocks_(source)

    def _write_sums_(self, source: Mapping[str, Tensor], names: set[str]) -> None:
        """Weights ``← x0 + source`` at every entry of the parameters ``names``: where the
        three are plain views in the compute dtype, for all pieces together in two ``_foreach``
        operators (in place, no temporary); elsewhere piece by piece."""
        plain: list[Segment] = []
        for piece in self.space.pieces:
            part = _segments_of(piece, names)
            if part is None:
                continue
            if fusable(part, (self.weights, self.x0, source), self.dtype):
                plain += part.segments
            else:
                part.write_sum_(self.weights, self.x0, part.entries(source, self.dtype))
        if plain:
            together = Piece(tuple(plain))
            together.write_sum_(self.weights, self.x0, together.entries(source, self.dtype))

    def _move_blocks_(self, source: Mapping[str, Tensor]) -> None:
        """The symmetry blocks of the weights ``← γ_ξ(1)`` for ``ξ = source``."""
        with self.diagnosis.located(), self.checks:
            for chunk in self.space.all_chunks():
                s = self.base.space(chunk)
                chunk.write_(self.weights, s.move(chunk.read(source, self.dtype)))

    @torch.no_grad()
    def _copy_current_(self, out: Mapping[str, Tensor]) -> None:
        """``out ← ξ_k``."""
        for piece in self.space.pieces:
            piece.write_(out, self._xi_entries(piece))

    @torch.no_grad()
    def _set_current_(self, source: Mapping[str, Tensor]) -> None:
        """``ξ_k ← source`` (the model moved there)."""
        self._block = None
        self._unpark()
        if self.current:
            names = list(self.current)
            torch._foreach_copy_(  # pyright: ignore[reportPrivateImportUsage]
                [self.current[n] for n in names], [source[n] for n in names]
            )
        self._move_(source)

    # ------------------------------------------------------------------ Auto-PGD's iterates
    def begin(self, batch, where: Where, gen: torch.Generator | None, rho: float) -> None:
        """Start on ``batch`` from ``ξ_0 = 0`` (``gen=None``) or from a random horizontal
        direction of norm ``rho``; ``ξ_{-1} = ξ_0``."""
        self.batch, self.where = batch, where
        self._best, self.best = Best.PREVIOUS, None
        self._best_sqnorm = None
        self.checks.pending.clear()
        if gen is None:
            for t in self.previous.values():
                t.zero_()
        else:
            self.random_(self.previous, gen, rho)
        self._set_current_(self.previous)

    def value(self, k: int | str, grad: bool) -> Tensor:
        """Loss at the current iterate (0-dim, compute dtype); with ``grad`` the forward pass's
        graph is kept for :meth:`gradient`. ``k`` names the evaluation in messages."""
        where = self.where.iteration(k) if isinstance(k, int) else Where(self.where.batch, k)
        return self.evaluate(where, grad)

    def evaluate(self, where: Where, grad: bool) -> Tensor:
        """The loss at the weights as they are (see :meth:`value`). An exception of ``loss_fn``
        keeps its type and gains a note naming ``where``."""
        if self._parked:
            raise RuntimeError("the weights hold ξ_k, not a point: move them first")
        for p in self.space.params.values():
            p.grad = None
        self._pending = None

        def forward() -> Tensor:
            try:
                with torch.enable_grad() if grad else torch.no_grad():
                    loss = self._loss(where)
            finally:
                if self.space.sharded and not grad:
                    sh.reshard(self.model)
            if grad:
                if not loss.requires_grad:
                    raise ValueError(
                        "loss_fn returned a tensor that does not depend on the parameters "
                        f"({where})"
                    )
                self._pending = (loss, where)
            return loss.detach().reshape(()).to(self.dtype)

        return self.ranks.loss(forward, self.space, where)

    def gradient(self) -> None:
        """The gradient of the last :meth:`value` (``grad=True``) with respect to the weights,
        into ``.grad``: the backward pass of its graph."""
        pending, self._pending = self._pending, None

        def backward() -> None:
            if pending is None:  # its forward pass failed (and is reported)
                raise RuntimeError("no forward pass to differentiate")
            self._parking = True
            self._accumulated.clear()
            try:
                pending[0].backward()
            finally:
                self._parking = False
                if self.space.sharded:
                    sh.reshard(self.model)

        self.ranks.gradient(backward, self.space)

    def _drop_gradient(self) -> None:
        """Forget the last forward pass's graph (its gradient is not wanted)."""
        self._pending = None
        if self.space.sharded:
            sh.reshard(self.model)

    def _loss(self, where: Where) -> Tensor:
        try:
            loss = self.loss_fn(self.model, self.batch)
        except Exception as err:
            add_note(err, f"raised by loss_fn on {where}; the model is restored")
            raise
        if not isinstance(loss, Tensor):
            raise TypeError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__} ({where})"
            )
        if loss.numel() != 1:
            raise ValueError(
                f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)} ({where})"
            )
        return loss.reshape(())

    def gradients(self) -> dict[str, Tensor]:
        """The local parts of ``.grad`` (zeros where a parameter got none)."""
        out = {}
        for name, p in self.space.params.items():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out[name] = sh.local(p.grad)
        return out

    @torch.no_grad()
    def gram(self) -> Tensor:
        """The Gram matrix ``K`` (3 × 3, compute dtype) of ``(ξ_k, ξ_{k-1}, g)`` in the ball's
        metric, where ``g``, the horizontal Riemannian gradient with respect to ``ξ`` at
        ``ξ_k`` (the map's vector-Jacobian product of ``.grad``, then ``egrad2rgrad``),
        replaces ``.grad``. After a step the iterates' own block is known (module docstring):
        the pass takes only the products with ``g``."""
        # what the backward pass freed goes back to the system before the step allocates
        release_free_memory(self.device, self.space.held_bytes)
        grads = self.gradients()
        block = self._block
        row = block is not None
        sums = Sums(self.space, (3,) if row else (3, 3))
        parts = list(self.space.parts())
        if self.compiled:  # one compiled kernel for the rest (quotientgeo.sharpness.fused)
            tensors = (self.weights, self.x0, self.previous, grads)
            fused = [
                part
                for part in parts
                if isinstance(part, Piece)
                and self._off_weights(part)
                and fusable(part, tensors, self.dtype)
            ]
            K = fused_gram(fused, *tensors, self.dtype)
            if K is not None:
                sums.add(fused[0], K[:, 2] if row else K)
                taken = {id(part) for part in fused}
                parts = [part for part in parts if id(part) not in taken]
        with self.diagnosis.located(), self.checks:
            for part in parts:
                s = self.base.space(part)
                if isinstance(part, Piece):  # ξ_k, ξ_{k-1}, g read in one concatenation
                    xi = self._xi_entries(part)
                    sums.add(part, part.gradient_gram_(s, xi, self.previous, grads, row=row))
                    continue
                # a chunk (ξ_k is held): ξ_k, ξ_{k-1} and ∇ read into the rows of one tensor
                rows = s.point.x.new_empty((3, *s.point.x.shape))
                for out, source in zip(rows, (self.current, self.previous, grads), strict=True):
                    part.read(source, self.dtype, out=out)
                g, products = s.gradient_row(rows) if row else s.gradient_gram(rows)
                part.write_(grads, g)
                sums.add(part, products)
        if block is None:
            self._gram = mirror_upper(sums.total())  # the parts' products, mirrored once
            if self._best is Best.CURRENT and self._best_sqnorm is None:
                self._best_sqnorm = self._gram[0, 0]
        else:
            self._gram = _bordered(block, sums.total())
        return self._gram

    @torch.no_grad()
    def advance(self, c: Tensor) -> None:
        """``ξ_{k+1} = c₀ ξ_k + c₁ ξ_{k-1} + c₂ g``, ``ξ_k`` becomes the previous iterate, the
        model moves to ``γ_{ξ_{k+1}}(1)``. Piece by piece: a buffer that must keep its value
        (``ξ_k`` parked in the weights, ``ξ_{k-1}`` as the best point) is replaced by a fresh one
        at the parameter's first piece, and every parameter's gradient is freed after its last
        one, so the step holds no more than the end of the backward pass did. The best point
        moves with the iterates (module docstring): from ``CURRENT`` to ``PREVIOUS``, from
        ``PREVIOUS`` to ``OWN``."""
        grads = self.gradients()
        c = c.to(self.dtype)
        best_is_previous = self._best is Best.PREVIOUS  # ξ_{k-1} stays, as the best point
        target, previous = dict(self.current), dict(self.previous)  # where ξ_{k+1}, ξ_k go
        best = dict(self.previous)  # where ξ_{k-1} stays, if it is the best point
        stepped = self._straight_step(grads, c) if not best_is_previous else {}
        for i, piece in enumerate(self.space.pieces):
            done = stepped.get(i, set())
            if self.compiled:
                done |= self._fused_piece_step(
                    piece, grads, c, target, best if best_is_previous else None, done
                )
            part = _segments_of(piece, set(piece.names) - done)
            if part is not None:
                self._eager_step(part, grads, c, target, previous, best_is_previous)
            self._free_gradients(piece, i, grads)
        if best_is_previous:
            self._best, self.best = Best.OWN, best
        elif self._best is Best.CURRENT:
            self._best = Best.PREVIOUS
        self.current, self.previous = target, previous
        self._parked.clear()
        for p in self.space.params.values():
            p.grad = None
        self._move_blocks_(self.current)
        if self._exact_iterates:
            assert self._gram is not None
            self._block = _next_block(self._gram, c)

    def _eager_step(
        self,
        part: Piece,
        grads: Mapping[str, Tensor],
        c: Tensor,
        target: dict[str, Tensor],
        previous: dict[str, Tensor],
        best_is_previous: bool,
    ) -> None:
        """The step of :meth:`advance` at the entries of ``part``, by ``_foreach`` operators:
        ``target ← ξ_{k+1}`` (fresh buffers for ``ξ_k`` parked in the weights), ``previous ←
        ξ_k`` (fresh buffers where ``ξ_{k-1}`` stays as the best point), the straight
        parameters' weights ``← x0 + ξ_{k+1}``."""
        parked = [n for n in part.names if n in self._parked]
        parked = [n for n in parked if target[n] is self.current[n]]
        target.update(_fresh(self.current, parked))
        if best_is_previous:
            kept = [n for n in part.names if previous[n] is self.previous[n]]
            previous.update(_fresh(self.previous, kept))
        c0, c1, c2 = c.unbind()
        xi = self._xi_entries(part)
        new = self._combination(part, (c0, c1, c2), xi, grads)
        part.write_(previous, xi)
        part.write_(target, new, target)
        if not self.straight.isdisjoint(part.names):
            part.write_sum_(self.weights, self.x0, new, self.straight)

    def _straight_step(self, grads: Mapping[str, Tensor], c: Tensor) -> dict[int, set[str]]:
        """The step of :meth:`advance` at every entry that moves along a straight line with
        ``ξ_k`` in the weights, for all pieces at once, where ``ξ_{k-1}``'s buffers may take
        ``ξ_k`` (it is not the best point): one compiled kernel with ``compile``
        (:func:`~quotientgeo.sharpness.fused.fused_step`), else eight in-place ``_foreach``
        operators (:func:`_step_in_place_`). Neither allocates, so the gradients need not be
        freed piece by piece; by piece index, the names it took."""
        moving = self.straight.difference(self.current)
        tensors = (self.weights, self.x0, self.previous, grads)
        parts = {}
        for i, piece in enumerate(self.space.pieces):
            part = _segments_of(piece, moving)
            if part is not None and fusable(part, tensors, self.dtype):
                parts[i] = part
        if not parts:
            return {}
        if self.compiled:
            fused_step(list(parts.values()), *tensors, c, self.dtype)
        else:
            w, x0, previous, g = (
                [v for part in parts.values() for v in part.views(t, self.dtype) or ()]
                for t in tensors
            )
            _step_in_place_(w, x0, previous, g, c)
        return {i: set(part.names) for i, part in parts.items()}

    def _fused_piece_step(
        self,
        piece: Piece,
        grads: Mapping[str, Tensor],
        c: Tensor,
        target: dict[str, Tensor],
        best: dict[str, Tensor] | None,
        done: set[str],
    ) -> set[str]:
        """With ``compile``, the step of :meth:`advance` at the entries of ``piece`` that the
        compiled kernels take, other than ``done``: those that move along straight lines where
        ``ξ_{k-1}`` stays as the best point (``best``;
        :func:`~quotientgeo.sharpness.fused.fused_step` after ``ξ_{k-1}`` is copied to the best
        point's buffers), and those whose ``ξ_k`` is parked in the weights
        (:func:`~quotientgeo.sharpness.fused.fused_held_step` into fresh buffers for
        ``ξ_{k+1}``); the names it took."""
        out: set[str] = set()
        moving = self.straight.difference(self.current).difference(done)
        part = _segments_of(piece, moving) if best is not None else None
        tensors = (self.weights, self.x0, self.previous, grads)
        if part is not None and fusable(part, tensors, self.dtype):
            assert best is not None
            self._keep_previous(part, best)
            fused_step([part], *tensors, c, self.dtype)
            out.update(part.names)
        held = _segments_of(piece, self._parked.difference(done))
        if held is None:
            return out
        fresh = [n for n in held.names if target[n] is self.current[n]]
        target.update(_fresh(self.current, fresh))
        tensors = (self.current, self.previous, grads, target)
        if not fusable(held, tensors, self.dtype):
            return out
        if best is not None:
            self._keep_previous(held, best)
        fused_held_step([held], *tensors, c, self.dtype)
        partial = _segments_of(held, self.straight)  # their other entries move straight
        if partial is not None:
            partial.write_sum_(self.weights, self.x0, partial.entries(target, self.dtype))
        return out | set(held.names)

    def _keep_previous(self, part: Piece, best: dict[str, Tensor]) -> None:
        """``best ← ξ_{k-1}`` at the entries of ``part``, into fresh buffers (at a parameter's
        first piece), so that ``ξ_{k-1}``'s own may take ``ξ_k``."""
        new = [n for n in part.names if best[n] is self.previous[n]]
        best.update(_fresh(self.previous, new))
        part.write_(best, part.entries(self.previous, self.dtype))

    def _free_gradients(self, piece: Piece, i: int, grads: dict[str, Tensor]) -> None:
        """Free the gradients of the parameters whose last piece is ``piece`` (the ``i``-th)."""
        for name in piece.names:
            if self._last_piece[name] == i:
                del grads[name]
                self.space.params[name].grad = None

    def _combination(
        self,
        piece: Piece,
        c: tuple[Tensor, Tensor, Tensor],
        xi: list[Tensor],
        grads: Mapping[str, Tensor],
    ) -> list[Tensor]:
        """``c₀ ξ_k + c₁ ξ_{k-1} + c₂ g`` at the piece's entries, segment by segment (``xi``:
        :meth:`_xi_entries`). Where the gradients are plain views in the compute dtype it is
        built in their own storage, which the step frees after it: five ``_foreach``
        operators and no concatenation; else in a new vector."""
        c0, c1, c2 = c
        previous, g = piece.views(self.previous, self.dtype), piece.views(grads, self.dtype)
        if previous is None or g is None:
            new = torch.cat(xi) * c0 if len(xi) > 1 else xi[0] * c0
            new.addcmul_(piece.read(self.previous, self.dtype), c1)
            new.addcmul_(piece.read(grads, self.dtype), c2)
            return piece.split(new)
        torch._foreach_mul_(g, c2)  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_add_(g, torch._foreach_mul(previous, c1))  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_add_(g, torch._foreach_mul(xi, c0))  # pyright: ignore[reportPrivateImportUsage]
        return g

    def keep_best(self, keep: bool) -> None:
        """``best ← ξ_k`` if ``keep``: the best point *is* ``ξ_k`` from now, and a best point of
        its own is freed, before the backward pass."""
        if self.worst_case and keep:
            self._best, self.best = Best.CURRENT, None
            self._best_sqnorm = None if self._block is None else self._block[0]

    def best_iterate(self) -> dict[str, Tensor]:
        """The best iterate of the last Auto-PGD run (parameter coordinates, local parts): the
        objective's own tensors, valid until the next :meth:`begin`."""
        if self._best is Best.CURRENT:
            self._copy_current_(self.previous)  # ξ_{k-1} is not needed once the run is over
            self._best = Best.PREVIOUS
        if self._best is Best.PREVIOUS:
            return self.previous
        assert self.best is not None
        return self.best

    @torch.no_grad()
    def restart(self, best_is_current: bool, k: int) -> None:
        """``ξ_k = ξ_{k-1} = best``, with the gradient at ``best`` in ``.grad``: the backward
        pass of the current iterate's forward pass where ``best`` is the current iterate, else
        (that graph dropped) one more forward and backward pass at ``best``."""
        if best_is_current:
            assert self._best is Best.CURRENT
            self.gradient()
            self._copy_current_(self.previous)
        else:
            self._drop_gradient()
            if self._best is Best.OWN:  # its buffers become ξ_{k-1}'s; ξ_{k-1}'s are freed
                assert self.best is not None
                self.previous, self.best, self._best = self.best, None, Best.PREVIOUS
            self._set_current_(self.previous)
            self.evaluate(self.where.iteration(k), grad=True)
            self.gradient()
        self._best, self.best = Best.CURRENT, None  # (and ξ_{k-1}): no buffer of its own
        if self._exact_iterates and self._best_sqnorm is not None:
            self._block = (self._best_sqnorm, self._best_sqnorm, self._best_sqnorm)

    # ------------------------------------------------------------------ the result
    @torch.no_grad()
    def sqnorm(self, xi: Mapping[str, Tensor]) -> Tensor:
        """``||ξ||²_x`` in the ball's metric (0-dim, compute dtype)."""
        sums = Sums(self.space)
        with self.diagnosis.located():
            for part in self.space.parts():
                s = self.base.space(part)
                sums.add(part, s.sqnorm(part.read(xi, self.dtype)))
        return sums.total()

    def first_order_loss(self, xi: Mapping[str, Tensor], where: Where) -> Tensor:
        """Loss at the first-order move ``x + ξ``: one no-grad forward."""
        self._move_(xi, first_order=True)
        return self.evaluate(where, grad=False)

    def reset(self) -> None:
        """The model back at ``x0``."""
        self._unpark()
        with torch.no_grad():
            for name, t in self.weights.items():
                t.copy_(self.x0[name])

    def tangent(self, xi: Mapping[str, Tensor] | None) -> dict[str, Tensor]:
        """``ξ`` (``None``: zero) in parameter coordinates as new tensors (sharded as the
        parameters)."""
        return {
            name: sh.like(torch.zeros_like(self.x0[name]) if xi is None else xi[name].clone(), p)
            for name, p in self.space.params.items()
        }

    # ------------------------------------------------------------------ random directions
    @torch.no_grad()
    def random_(self, out: Mapping[str, Tensor], gen: torch.Generator, rho: float) -> None:
        """``out ←`` a horizontal direction of norm ``rho``, isotropic in the ball's metric at
        the base point (:meth:`Perturbations.random_parts`)."""
        sums = Sums(self.space)
        with self.diagnosis.located():
            for part, e in self.space.random_parts(gen):
                s = self.base.space(part)
                xi = s.random(e)
                part.write_(out, xi)
                sums.add(part, s.sqnorm(xi))
        scale = rho / sums.total().sqrt()
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for t in out.values():
            by_dtype.setdefault(t.dtype, []).append(t)
        for dtype, tensors in by_dtype.items():
            torch._foreach_mul_(tensors, scale.to(dtype))  # pyright: ignore[reportPrivateImportUsage]

    def set_random(self, gen: torch.Generator, rho: float) -> None:
        """The model at ``γ_ξ(1)`` for a random ``ξ`` of norm ``rho`` (average sharpness)."""
        self.random_(self.previous, gen, rho)
        self._set_current_(self.previous)

    # ------------------------------------------------------------------ failures
    def check_finite(self, losses: Tensor, where: Where) -> None:
        """Raise (on every rank) if ``losses`` are not all finite; ``losses[k]`` is the loss at
        iteration ``k`` of ``where`` (or at ``where`` itself for one loss). The message also
        names the heads whose factors are rank deficient to working precision, if any. The
        checks of the moves' matrix exponentials since the last call are read with the
        losses (one host read) and raise first."""
        finite = torch.isfinite(losses)
        failed = self.checks.failed()
        ok = finite.all() if failed is None else finite.all() & ~failed
        all_finite = bool(ok)
        self.ranks.check_finite(all_finite)
        if all_finite:
            self.checks.pending.clear()
            return
        try:
            self.checks.raise_failed()
        except ValueError as err:
            add_note(err, f"on batch {where.batch}; the model is restored")
            raise
        k = int((~finite).nonzero()[0, 0])
        at = where if isinstance(where.at, str) else where.iteration(k)
        message = (
            f"loss_fn returned a non-finite loss ({float(losses[k])}) on batch {at.batch} at "
            f"{at.moment}"
        )
        deficient = self.diagnosis.rank_deficient()  # nearly singular heads are a cause
        if deficient is not None:
            raise ValueError(f"{message}, likely from {deficient}")
        raise ValueError(f"{message}; the model is restored")


def _step_in_place_(
    weights: list[Tensor], x0: list[Tensor], previous: list[Tensor], g: list[Tensor], c: Tensor
) -> None:
    """``ξ_{k+1} = c₀ ξ_k + c₁ ξ_{k-1} + c₂ g`` with ``weights = x₀ + ξ_k``: ``previous ← ξ_k``
    and ``weights ← x₀ + ξ_{k+1}``, in place on lists of matching views, eight ``_foreach``
    operators for all of them and nothing allocated (``g`` is overwritten). The products and
    sums are :meth:`Objective._combination`'s, in its order (a sum's two terms swapped, which
    rounds the same): the same bits."""
    c0, c1, c2 = c.unbind()
    mul_, add_ = torch._foreach_mul_, torch._foreach_add_  # pyright: ignore[reportPrivateImportUsage]
    sub_, copy_ = torch._foreach_sub_, torch._foreach_copy_  # pyright: ignore[reportPrivateImportUsage]
    mul_(g, c2)
    mul_(previous, c1)
    add_(g, previous)  # c₂ g + c₁ ξ_{k-1}
    sub_(weights, x0)  # ξ_k, where the weights were
    copy_(previous, weights)
    mul_(weights, c0)
    add_(weights, g)  # ξ_{k+1}
    add_(weights, x0)


def _next_block(K: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(<ξ_{k+1}, ξ_{k+1}>, <ξ_{k+1}, ξ_k>, <ξ_k, ξ_k>) = (cᵀ K c, (K c)₀, K₀₀)`` from ``K``,
    the Gram matrix of ``(ξ_k, ξ_{k-1}, g)``, and ``ξ_{k+1} = c · (ξ_k, ξ_{k-1}, g)``."""
    Kc = K @ c
    return c @ Kc, Kc[0], K[0, 0]


def _bordered(block: tuple[Tensor, Tensor, Tensor], row: Tensor) -> Tensor:
    """The Gram matrix of ``(ξ_k, ξ_{k-1}, g)`` (3 × 3, one operator) from the iterates' own
    products ``block`` and ``row = (<ξ_k, g>, <ξ_{k-1}, g>, <g, g>)``."""
    (a, b, d), (e, f, h) = block, row.unbind()
    return torch.stack((a, b, e, b, d, f, e, f, h)).view(3, 3)


def _recomputes_forward(model: nn.Module) -> bool:
    """Whether the model recomputes parts of its forward pass in the backward pass (Hugging
    Face's activation checkpointing), reading weights whose gradient is already accumulated."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _parking_groups(current: Mapping[str, Tensor], size: int) -> list[tuple[str, ...]]:
    """The parameters of ``current`` in the backward pass's order (the reverse of theirs), cut
    into runs of at most ``size`` entries (a larger parameter is a run of its own)."""
    groups: list[tuple[str, ...]] = []
    run: list[str] = []
    entries = 0
    for name in reversed(list(current)):
        n = current[name].numel()
        if run and entries + n > size:
            groups.append(tuple(run))
            run, entries = [], 0
        run.append(name)
        entries += n
    return [*groups, tuple(run)] if run else groups


def _fresh(tensors: Mapping[str, Tensor], names: list[str]) -> dict[str, Tensor]:
    """New contiguous tensors shaped as ``tensors[name]`` for ``names`` (a piece's parameters),
    views of one allocation (:func:`empty_like_together`): at most a piece's worth of memory is
    held until its last view is dropped."""
    return dict(zip(names, empty_like_together([tensors[n] for n in names]), strict=True))


def _segments_of(piece: Piece, names) -> Piece | None:
    """``piece``'s segments of the parameters ``names`` (the piece itself where that is all of
    them; ``None`` where none)."""
    segments = tuple(seg for seg in piece.segments if seg.name in names)
    if not segments:
        return None
    if len(segments) == len(piece.segments):
        return piece
    return Piece(segments, piece.manifold, piece.sharded)
