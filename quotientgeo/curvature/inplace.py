r"""The batch-averaged loss's gradient at displaced weights, by moving the model's own
parameters in place: what the finite-difference Hessian-vector product runs on.

The coordinates are those of :mod:`quotientgeo.curvature.loss` (the geometry's points, one
``(heads, Σk, h)`` tensor per kind, and the flat adaptive vector ``w``). To take
``∇f(x + sξ)``, the displaced coordinates are scattered into the model's parameters in place
(one fused copy), ``loss_fn(model, batch).backward()`` runs as in training (the model's own
modules and hooks, FSDP2's included, and its fastest attention kernels: no second derivative
is taken), and the parameters' ``.grad`` is gathered back into coordinates. The central
difference

    ``(∇f(x + tξ) - ∇f(x - tξ)) / (2t)``

is formed in the ``.grad`` tensors: the ``+tξ`` passes' gradients are set aside, the ``-tξ``
passes write fresh ones (autograd adds nothing per parameter), and one fused subtraction forms
the difference. Holding the first gradient through the second backward pass costs one copy of
the parameters at that pass's peak, which falls at its start (the loss's and the output
layer's gradients, before any parameter's gradient is formed); accumulating the second
gradient into the first would hold the same copy there and add an operator per parameter. The
subtraction also forms, in the second gradient's storage of the parameters with symmetry
blocks' entries, the mean ``(∇f(x + tξ) + ∇f(x - tξ)) / 2 = ∇f(x) + O(t²)`` that the
connection term takes (no gradient at ``x`` is kept, and nothing is held besides the two
gradients at the second backward pass's end). The symmetry blocks' displaced entries are
written through views of their regions (:func:`~quotientgeo.geometry.transfer.block_views`),
from ``ξ`` and ``x`` in coordinates: nothing of the blocks is copied into parameter layout. The
base point ``x`` (the coordinates the operator keeps) is written back after every product,
bit-exactly (the coordinates are the parameters' values in a dtype at least as wide), also on
an exception; modes, buffers and ``.grad`` are restored as by the sharpness measures.

The base point keeps the adaptive rest in the parameters' own dtype where they share one that
is narrower than the coordinates' (bfloat16 parameters, float32 arithmetic): it holds their
values exactly, in half the bytes. Where the caller gives the rest's output (``into``, views of
a buffer of the coordinates' dtype), the rest's difference is not gathered into a new vector:
it is added into ``into`` straight from the ``.grad`` tensors, as ``T`` of the rest's part
applied to it, in buckets of at most :data:`STREAM_BYTES` whose gradients are freed as they are
read; only the symmetry blocks' difference is gathered in coordinates.

On a model sharded with FSDP2 every rank holds the whole coordinates: the gradient's local
parts are all-gathered into them and each rank writes its local part of the displaced
parameters (:mod:`quotientgeo.geometry.shards`); every rank must pass the same batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..geometry import ParameterGeometry
from ..geometry import shards as sh
from ..geometry.transfer import block_views, gather, gather_blocks
from ..sharpness.state import model_state_preserved

Tensor = torch.Tensor

__all__ = ["InPlaceLoss"]

RESTORED = "the model is restored"

#: The largest scratch buffer, in bytes, of streaming the rest's difference into the output
#: (:meth:`InPlaceLoss.difference`); a parameter larger than this is streamed whole.
STREAM_BYTES = 2**28

#: ``(points, w)``: coordinates.
Coordinates = tuple[list[Tensor], Tensor]


class InPlaceLoss:
    """``f = mean_S loss_fn(model, S)`` and its gradients at displaced coordinates, the model's
    parameters moved in place (module docstring).

    Args:
        geometry: the model's parameter geometry.
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        batches: the batches, a list (every gradient runs over all of them).
    """

    def __init__(self, geometry: ParameterGeometry, loss_fn: Callable, batches: Sequence[Any]):
        self.geometry = geometry
        self.model = geometry.model
        self.loss_fn = loss_fn
        self.batches = batches
        self.names = list(geometry.params)
        self.params = [geometry.params[name] for name in self.names]
        #: The coordinates' dtype (the geometry's compute dtype, read once).
        self.dtype = geometry.compute_dtype
        #: Batch passes run so far (a forward and a backward pass each).
        self.passes = 0
        self._views: tuple[list[Tensor], list[Tensor]] | None = None  # set by base()
        #: Whether :meth:`difference` can stream the rest's difference into an output (no
        #: partly covered or sharded parameters).
        self.streams = not geometry.plan.partial and not sh.sharded_parameters(self.params)
        wholly = set(geometry.plan.adaptive_names)
        #: The parameters with symmetry blocks' entries (all but the wholly adaptive ones):
        #: their indices in :attr:`names`, and their names.
        self._block_indices = [i for i, n in enumerate(self.names) if n not in wholly]
        self._block_names = [self.names[i] for i in self._block_indices]
        sizes = list(geometry.plan.adaptive_sizes)
        #: ``(first, last + 1)`` of the wholly adaptive parameters streamed together.
        self._buckets = _buckets(sizes, STREAM_BYTES // self.dtype.itemsize)
        self._scratch = max((sum(sizes[lo:hi]) for lo, hi in self._buckets), default=0)

    # ------------------------------------------------------------------ parameters
    def _write(self, w: Tensor, rest: tuple[Any, Tensor, Tensor] | None = None, xi=None) -> None:
        """Write the base point into the parameters (their local parts) in place, or with
        ``rest = (part, z, s)`` and ``xi`` (the symmetry blocks' ``ξ``: :meth:`_block_xi`) the
        point displaced by ``s ξ``: the symmetry blocks' parameters ``x + s ξ`` and the
        adaptive entries ``w + s · T z`` (``part.displaced_into_``), each formed in the
        parameters themselves in a few fused operations, no vector of the model's size
        besides; the partly covered parameters entry by entry. The blocks' entries are
        written through views of every region (:func:`~quotientgeo.geometry.transfer.block_views`:
        ``ξ`` and ``x`` read in their coordinates, three operators for all of them), or, where
        a region is no view of its parameter or the parameters are sharded, from whole
        parameters in their layout (``ξ`` scattered, ``x`` kept so)."""
        geometry, plan = self.geometry, self.geometry.plan
        params = geometry.params
        with torch.no_grad():
            if self._views is not None:  # the blocks' regions, written through views
                in_params, in_base = self._views
                if in_params and rest is None:
                    torch._foreach_copy_(in_params, in_base)  # pyright: ignore[reportPrivateImportUsage]
                elif in_params:
                    assert rest is not None and xi is not None
                    torch._foreach_copy_(in_params, xi)  # pyright: ignore[reportPrivateImportUsage]
                    torch._foreach_mul_(in_params, rest[2])  # pyright: ignore[reportPrivateImportUsage]
                    torch._foreach_add_(in_params, in_base)  # pyright: ignore[reportPrivateImportUsage]
            targets = [sh.local(params[n]) for n in self._symmetric]
            if targets and rest is None:
                torch._foreach_copy_(targets, self._symmetric_base)  # pyright: ignore[reportPrivateImportUsage]
            elif targets:
                assert rest is not None and xi is not None
                torch._foreach_copy_(targets, xi)  # pyright: ignore[reportPrivateImportUsage]
                torch._foreach_mul_(targets, rest[2])  # pyright: ignore[reportPrivateImportUsage]
                torch._foreach_add_(targets, self._symmetric_base)  # pyright: ignore[reportPrivateImportUsage]
            sizes = list(plan.adaptive_sizes)
            if not sizes:
                return
            ws = w.split(sizes)
            zs = rest[1].split(sizes) if rest is not None else [None] * len(sizes)
            wholly = len(plan.adaptive_names)
            names = plan.adaptive_names
            out = [sh.local(params[n]) for n in names]
            xs = [
                sh.local_part(x.view(params[n].shape), params[n])
                for n, x in zip(names, ws, strict=False)
            ]
            if rest is None:
                if out:
                    torch._foreach_copy_(out, xs)  # pyright: ignore[reportPrivateImportUsage]
            else:
                part, z, s = rest
                vs = [
                    sh.local_part(v.view(params[n].shape), params[n])
                    for n, v in zip(names, z.split(sizes), strict=False)
                ]
                if out:
                    part.displaced_into_(out, xs, vs, s)
            for name, x, v in zip(plan.partial, ws[wholly:], zs[wholly:], strict=True):
                value = x if rest is None else rest[0].displaced(x.to(self.dtype), v, rest[2])
                p = params[name]
                whole = sh.full(sh.local(p), p).clone()
                mask = plan.partial[name].to(whole.device)
                plan.views[name].edit_(
                    whole,
                    lambda m, mask=mask, value=value: m.masked_scatter_(mask, value.to(m.dtype)),
                )
                sh.local(p).copy_(sh.local_part(whole, p))

    def _gathered_grads(
        self, rest: bool = True, grads: dict[str, Tensor | None] | None = None
    ) -> tuple[list[Tensor], Tensor | None]:
        """The parameters' ``.grad`` in coordinates (zeros where the loss does not depend on a
        parameter; the whole tensors of sharded ones); with ``rest=False`` the symmetry
        blocks' points only (``None`` for ``w``), read from ``grads`` where given (tensors of
        the parameters' layout, local parts, by the names of :attr:`_block_names`)."""
        if grads is None:
            names = self.names if rest else self._block_names
            grads = {n: self.geometry.params[n].grad for n in names}
        params = self.geometry.params
        whole: dict[str, Tensor] = {}
        for name, g in grads.items():
            p = params[name]
            if g is None:
                whole[name] = torch.zeros(p.shape, dtype=p.dtype, device=sh.local(p).device)
            else:
                whole[name] = sh.full(sh.local(g), p)
        if not rest:
            plan = self.geometry.plan
            return [
                gather_blocks(plan, i, range(len(kind.blocks)), whole, self.dtype)
                for i, kind in enumerate(plan.kinds)
            ], None
        return self.geometry.gather(whole, dtype=self.dtype)

    def _stream_rest(
        self, w: Tensor, into: list[Tensor], part: Any, scale: Tensor, beta: float
    ) -> None:
        """``into[i] ← β · into[i] + scale · T(.grad_i)`` over the wholly adaptive parameters
        (``T`` of the rest's ``part``, element-wise at the base point ``w``), bucket by bucket,
        each bucket's ``.grad`` freed once read (a parameter without one: ``T(0) = 0``)."""
        plan, params = self.geometry.plan, self.geometry.params
        adaptive = [params[n] for n in plan.adaptive_names]
        sizes = list(plan.adaptive_sizes)
        xs = [x.view(p.shape) for x, p in zip(w.split(sizes), adaptive, strict=False)]
        scratch = w.new_empty(self._scratch if beta else 0, dtype=self.dtype)
        for lo, hi in self._buckets:
            kept = [i for i in range(lo, hi) if adaptive[i].grad is not None]
            if kept:
                grads = [adaptive[i].grad for i in kept]
                outs = [into[i] for i in kept]
                part.addmv_(outs, [xs[i] for i in kept], grads, scale, beta, scratch)
            for i in range(lo, hi):
                if adaptive[i].grad is None and beta == 0:  # T(0), into not read
                    into[i].zero_()
                elif adaptive[i].grad is None:
                    into[i].mul_(beta)
                adaptive[i].grad = None

    def _passes(self, advance: Callable[[], object], check: bool) -> float:
        """``loss_fn(model, S).backward()`` over the batches (gradients accumulate in
        ``.grad``); the sum of the losses where ``check`` (each read and checked), else 0."""
        total = 0.0
        for i, batch in enumerate(self.batches):
            try:
                loss = self.loss_fn(self.model, batch)
            except Exception as err:
                _note(err, f"raised by loss_fn on batch {i}; {RESTORED}")
                raise
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                got = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
                raise ValueError(f"loss_fn must return a scalar tensor, got {got} (batch {i})")
            if check:
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise ValueError(
                        f"loss_fn returned a non-finite loss ({value}) on batch {i}; {RESTORED}"
                    )
                total += value
            if loss.requires_grad:
                loss.reshape(()).backward()
            self.passes += 1
            advance()
        return total

    def base(self) -> Coordinates:
        """The coordinates of the parameters as they are (whole, also where sharded): the
        base point, new tensors; the adaptive rest ``w`` in the parameters' dtype where they
        share one narrower than the coordinates' (:attr:`rest_dtype`)."""
        whole = {n: sh.full(sh.local(p), p) for n, p in zip(self.names, self.params, strict=True)}
        plan = self.geometry.plan
        points, w = gather(plan, whole, self.dtype, self.geometry.device, self.rest_dtype)
        # the blocks' regions as views of the parameters and of ``points`` (``None``: the
        # parameters written whole, from a copy in their layout)
        if not sh.sharded_parameters(self.params):
            self._views = block_views(self.geometry.plan, points, self._tensors)
        if self._views is not None:
            self._symmetric, self._symmetric_base = [], []
            return points, w
        # the symmetry blocks' parameters as they are (local parts): the restoring copy
        symmetric = self._local_symmetric(points)
        self._symmetric = list(symmetric)
        self._symmetric_base = [
            t.clone() if _shares_memory(t, points) else t for t in symmetric.values()
        ]
        del symmetric
        return points, w

    @property
    def rest_dtype(self) -> torch.dtype:
        """The dtype the base point keeps the adaptive rest in: the parameters' own where they
        share one narrower than the coordinates' (it holds their values exactly), else the
        coordinates'."""
        plan, params = self.geometry.plan, self.geometry.params
        dtypes = {params[n].dtype for n in (*plan.adaptive_names, *plan.partial)}
        if len(dtypes) == 1:
            (dtype,) = dtypes
            if dtype.is_floating_point and dtype.itemsize < self.dtype.itemsize:
                return dtype
        return self.dtype

    @property
    def _tensors(self) -> dict[str, Tensor]:
        """The parameters by name, detached (in-place writes reach them)."""
        return {n: p.detach() for n, p in zip(self.names, self.params, strict=True)}

    def _block_xi(self, xi: Sequence[Tensor]) -> list[Tensor]:
        """The symmetry blocks' ``ξ`` as :meth:`_write` takes it: views of its regions
        (no copy), or its parameters' local parts (a scatter) where the parameters are
        written whole."""
        if self._views is not None:
            views = block_views(self.geometry.plan, xi, self._tensors)
            assert views is not None  # as for the base point: same plan and shapes
            return views[1]
        return list(self._local_symmetric(xi).values())

    def _local_symmetric(self, points: Sequence[Tensor]) -> dict[str, Tensor]:
        """The symmetry blocks' parameters (local parts) scattered from ``points``."""
        params = self.geometry.params
        values = self.geometry.scatter(points, None)
        return {n: sh.local_part(v, params[n]) for n, v in values.items()}

    # ------------------------------------------------------------------ gradients
    def value(self, advance: Callable[[], object] = lambda: None) -> float:
        """``f`` at the parameters as they are (the base point), by the passes of a gradient
        (a sharded model's forward expects its backward), which is not read."""
        with model_state_preserved(self.model), torch.enable_grad():
            return self._passes(advance, check=True) / len(self.batches)

    def gradient(
        self, advance: Callable[[], object] = lambda: None
    ) -> tuple[float, tuple[list[Tensor], Tensor]]:
        """``(f, ∇f)`` at the parameters as they are (the base point), ``∇f`` in coordinates."""
        n = len(self.batches)
        with model_state_preserved(self.model), torch.enable_grad():
            value = self._passes(advance, check=True)
            points, w = self._gathered_grads()
        assert w is not None  # the rest's part, asked for
        if n > 1:
            torch._foreach_div_([*points, w], float(n))  # pyright: ignore[reportPrivateImportUsage]
        return value / n, (points, w)

    def difference(
        self,
        w: Tensor,
        xi: list[Tensor],
        rest: tuple[Any, Tensor],
        t: Tensor,
        advance: Callable[[], object] = lambda: None,
        into: list[Tensor] | None = None,
        beta: float = 0.0,
    ) -> tuple[list[Tensor], Tensor | None, list[Tensor]]:
        """``(∇f(x + tξ) - ∇f(x - tξ)) / (2t)`` in coordinates, at the base point of
        :meth:`base` (``w`` its adaptive vector), and the symmetry blocks' part of
        ``(∇f(x + tξ) + ∇f(x - tξ)) / 2 = ∇f(x) + O(t²)`` (what the connection term takes, so
        that no gradient at ``x`` is kept): ``xi`` the symmetry blocks' points of ``ξ``,
        ``rest = (part, z)`` the adaptive rest's part and whitened vector (``ξ_w = T z``,
        formed in the parameters, :meth:`_write`); ``t`` a scalar tensor, never read on the
        host. ``xi`` is emptied once the displaced weights are written (a caller that holds no
        other reference to the blocks' ``ξ`` has them freed before the second backward pass).
        The base point is written back at the end.

        With ``into`` (where :attr:`streams`: one tensor per wholly adaptive parameter, of its
        shape, in the coordinates' dtype) the rest's difference ``d`` is not returned (``None``
        for ``w``) but written as ``into ← β · into + T d`` (``T`` of ``rest``'s part at the
        base point; ``β = 0`` never reads ``into``), read from the ``.grad`` tensors bucket by
        bucket (module docstring)."""
        if into is not None and not self.streams:
            raise ValueError("into: the model has partly covered or sharded parameters")
        # ∇f(x + tξ) - ∇f(x - tξ) summed over the batches, to their mean's difference
        scale = 0.5 / (t * len(self.batches))
        with torch.no_grad():
            xi_params = self._block_xi(xi)
        xi.clear()
        with model_state_preserved(self.model), torch.enable_grad():
            try:
                plus: list[Tensor | None] = []
                for sign in (1.0, -1.0):
                    self._write(w, (rest[0], rest[1], t * sign), xi_params)
                    if sign < 0:  # not held through the second backward pass (the peak)
                        xi_params.clear()
                    self._passes(advance, check=False)
                    if sign > 0:  # ∇f(x + tξ) set aside: the passes at x - tξ start afresh
                        plus = [p.grad for p in self.params]
                        for p in self.params:
                            p.grad = None
                # the blocks' parameters' mean gradients, in the second gradient's storage,
                # are freed once gathered
                means = _subtract_grads(self.params, plus, self._block_indices)
                mean, _ = self._gathered_grads(
                    rest=False, grads=dict(zip(self._block_names, means, strict=True))
                )
                del means
                hv_points, hv_w = self._gathered_grads(rest=into is None)
                if into is not None:
                    with torch.no_grad():
                        self._stream_rest(w, into, rest[0], scale, beta)
            finally:
                self._write(w)
        if len(self.batches) > 1:  # the sums' mean over the batches
            torch._foreach_div_(mean, float(len(self.batches)))  # pyright: ignore[reportPrivateImportUsage]
        torch._foreach_mul_([*hv_points, *([] if hv_w is None else [hv_w])], scale)  # pyright: ignore[reportPrivateImportUsage]
        return hv_points, hv_w, mean


def _shares_memory(t: Tensor, tensors: Sequence[Tensor]) -> bool:
    """Whether ``t`` is a view of one of ``tensors`` (or shares its storage)."""
    ptr = t.untyped_storage().data_ptr()
    return any(ptr == u.untyped_storage().data_ptr() for u in tensors)


def _subtract_grads(
    params: Sequence[Tensor], plus: list[Tensor | None], means: Sequence[int]
) -> list[Tensor | None]:
    """``.grad ← plus - .grad`` parameter by parameter, in one fused subtraction where both
    are there (a fresh gradient instead of one accumulated into ``plus``: autograd then writes
    no sum per parameter); returns, for the parameters at the indices ``means``, the mean
    ``(plus + .grad) / 2``, formed as ``.grad + ½ (plus - .grad)`` in the second gradient's own
    storage (one fused addition; ``None`` where neither gradient is there)."""
    both = [(a, p) for a, p in zip(plus, params, strict=True) if a is not None]
    pairs = [(a, p.grad) for a, p in both if p.grad is not None]
    if pairs:
        torch._foreach_sub_([a for a, _ in pairs], [g for _, g in pairs])  # pyright: ignore[reportPrivateImportUsage]
    mean: list[Tensor | None] = []
    fused: list[tuple[Tensor, Tensor]] = []  # (.grad, plus - .grad)
    for i in means:
        a, g = plus[i], params[i].grad
        if a is not None and g is not None:
            fused.append((g, a))
            mean.append(g)
        else:
            mean.append(_half(a, g))
    if fused:
        torch._foreach_add_([g for g, _ in fused], [a for _, a in fused], alpha=0.5)  # pyright: ignore[reportPrivateImportUsage]
    for p, a in zip(params, plus, strict=True):
        if a is None:
            p.grad = None if p.grad is None else p.grad.neg_()
        else:
            p.grad = a
    return mean


def _half(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """``(a + b) / 2`` where one of them is missing (zero): a new tensor, or ``None``."""
    present = a if a is not None else b
    return None if present is None else present * 0.5


def _note(err: BaseException, message: str) -> None:
    add_note = getattr(err, "add_note", None)  # Python 3.11+
    if add_note is not None:
        add_note(message)


def _buckets(sizes: Sequence[int], largest: int) -> list[tuple[int, int]]:
    """``(first, last + 1)`` runs of consecutive ``sizes`` whose sum stays within ``largest``
    (a size above it alone in its run)."""
    runs: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, n in enumerate(sizes):
        if i > start and total + n > largest:
            runs.append((start, i))
            start, total = i, 0
        total += n
    if start < len(sizes):
        runs.append((start, len(sizes)))
    return runs
