"""How a sharpness measurement spreads over the ranks of a ``torch.distributed`` process group.

One class per mode (the measures' ``distributed=`` argument, :class:`~quotientgeo.options.
Distributed`), chosen by :func:`ranks_for` when the user has initialised a process group of
more than one rank:

- :class:`Batches` (``"batches"``, the default for a model that every rank holds whole): each
  rank measures its own batches (the ``DistributedSampler`` convention); at the end every rank
  receives all ranks' per-batch records in rank order, so every rank returns the result one
  process returns for the concatenated list of batches. Random draws are seeded per global
  batch index, so they do not depend on the split.
- :class:`SplitBatch` (``"split_batch"``, the default for a model sharded over the ranks with
  FSDP2, whose forward and backward passes run on all ranks together): the ``k``-th batches of
  all ranks form one global batch. Every iteration the loss and the gradient with respect to
  the shared perturbation are averaged over ranks (FSDP2 averages the gradients of a sharded
  model in its backward pass; the loss is one all-reduce), so all ranks follow one
  perturbation. This equals one process measuring the concatenated batch when ``loss_fn`` is a
  mean over equally sized rank batches (the mean of the rank means is then the global mean).
- :class:`Local` (``"off"``, or no process group): each rank returns its local result.

Relative flatness needs no collective while it measures (its per-batch numbers are linear in
the Hessian of the loss): each rank computes its rows of per-batch numbers alone and
:meth:`Local.merge` combines them at the end, in the same modes.

A failure on one rank (a raising ``loss_fn``, a non-finite loss) makes every rank raise a
``RuntimeError`` naming the rank, batch and iteration, instead of leaving the others waiting
in a collective (except inside the forward or backward pass of a sharded model, whose own
collectives the other ranks then wait in, as in training).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch

from ..options import Distributed, option

Tensor = torch.Tensor

__all__ = ["Batches", "Local", "SplitBatch", "add_note", "described", "ranks_for"]


def add_note(err: BaseException, note: str) -> None:
    """``err.add_note(note)``, also on Python 3.10, which has no ``add_note``: there the note is
    appended to ``err.__notes__`` as 3.11's method does, so :func:`described` carries it to the
    other ranks (3.10's traceback does not print it)."""
    if sys.version_info >= (3, 11):
        err.add_note(note)
    else:
        err.__notes__ = [*getattr(err, "__notes__", ()), note]  # type: ignore[attr-defined]


def described(err: BaseException) -> str:
    """``err`` as one line for the other ranks: its type, message and notes."""
    return f"{type(err).__name__}: {err}" + "".join(
        f" ({note})" for note in getattr(err, "__notes__", ())
    )


def ranks_for(mode: Distributed | str, *, sharded: bool = False) -> Local:
    """The rank mode for ``distributed=mode`` in the current process group (:class:`Local`
    without an initialised group of several ranks); ``sharded``: the model's parameters are
    sharded over the ranks (only ``"split_batch"`` can measure it)."""
    mode = option(Distributed, "distributed", mode)
    dist = torch.distributed
    active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if mode == Distributed.AUTO:
        mode = Distributed.SPLIT_BATCH if sharded else Distributed.BATCHES
    if sharded and active and mode != Distributed.SPLIT_BATCH:
        raise ValueError(
            f"distributed={mode.value!r} cannot measure a model sharded over the ranks (FSDP2): "
            "its forward and backward passes run on all ranks together, so the k-th batches of "
            "the ranks form one batch; use distributed='split_batch' (the default, 'auto')"
        )
    if mode == Distributed.OFF or not active:
        return Local()
    return {Distributed.BATCHES: Batches, Distributed.SPLIT_BATCH: SplitBatch}[mode]()


class Local:
    """One process measures its batches alone."""

    mode = Distributed.OFF

    def __init__(self) -> None:
        self.rank, self.world = 0, 1

    def batch_offset(self, batches) -> int:
        """Global index of this rank's first batch."""
        return 0

    def loss(self, forward: Callable[[], Tensor], space, where) -> Tensor:
        """The loss that ``forward()`` returns, as the measure uses it."""
        return forward()

    def gradient(self, backward: Callable[[], None], space) -> None:
        """``backward()``: the gradient into ``.grad``, as the measure uses it."""
        backward()

    def check_finite(self, finite: bool) -> None:
        """Called with whether the losses so far are finite, before a non-finite one raises."""

    def failure(self, err: Exception) -> str:
        """What to do with an exception raised while measuring this rank's batches: raise it."""
        raise err

    def collect(self, records: list, failure: str | None) -> list:
        """This rank's records (and those of the others, where the mode gathers them)."""
        return records

    def merge(self, rows: list[tuple[float, ...]], failure: str | None) -> list:
        """Rows of per-batch numbers that each rank computed alone, as the mode returns them
        (a collective in a group: every rank calls it, with its failure or ``None``); here
        this rank's."""
        return rows


class _Group(Local):
    """A mode of an initialised process group of several ranks."""

    def __init__(self) -> None:
        dist = torch.distributed
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def gather(self, value) -> list:
        """``value`` of every rank, in rank order."""
        out = [None] * self.world
        torch.distributed.all_gather_object(out, value)
        return out

    def counts(self, batches) -> list[int]:
        """Every rank's number of batches (all of them must have a length)."""
        try:
            count = len(batches)
        except TypeError:
            count = None
        counts = self.gather(count)
        missing = [r for r, c in enumerate(counts) if c is None]
        if missing:
            raise ValueError(
                f"distributed sharpness needs batches with a length (a list, a DataLoader); "
                f"rank(s) {missing} passed an iterable without one"
            )
        return counts

    def raise_failures(self, failure: str | None) -> None:
        """Raise on every rank if any rank reports a failure (a collective: all must call)."""
        failures = self.gather(failure)
        bad = [(r, f) for r, f in enumerate(failures) if f is not None]
        if bad:
            lines = "; ".join(f"rank {r}: {f}" for r, f in bad)
            raise RuntimeError(f"sharpness failed on {len(bad)} rank(s): {lines}")


class Batches(_Group):
    """Each rank its own batches; the records of all ranks gathered at the end."""

    mode = Distributed.BATCHES

    def batch_offset(self, batches) -> int:
        return sum(self.counts(batches)[: self.rank])

    def failure(self, err: Exception) -> str:
        # the other ranks will wait in the gather of collect: report there
        return described(err)

    def collect(self, records: list, failure: str | None) -> list:
        self.raise_failures(failure)
        return [r for part in self.gather(records) for r in part]

    def merge(self, rows: list[tuple[float, ...]], failure: str | None) -> list:
        """All ranks' rows, in rank order."""
        return self.collect(rows, failure)


class SplitBatch(_Group):
    """The ``k``-th batches of all ranks are one batch: losses and gradients averaged."""

    mode = Distributed.SPLIT_BATCH

    def __init__(self) -> None:
        super().__init__()
        self.first_failure: str | None = None  # this rank's first exception
        self.local_losses: list = []  # (where, loss) since the last finiteness check

    def batch_offset(self, batches) -> int:
        counts = self.counts(batches)
        if len(set(counts)) != 1:
            raise ValueError(
                f"distributed='split_batch' pairs the k-th batches of all ranks, but the ranks "
                f"hold {counts} batches"
            )
        return 0

    def loss(self, forward: Callable[[], Tensor], space, where) -> Tensor:
        """Averaged over ranks (one all-reduce); an exception on this rank is kept (and
        reported at the next finiteness check) and contributes NaN, so that no rank waits
        alone."""
        try:
            loss = forward()
            self.local_losses.append((where, loss))  # checked lazily, without a sync here
        except Exception as err:
            self._failed(where, err)
            loss = torch.full((), math.nan, dtype=space.dtype, device=space.geometry.device)
        total = loss.reshape(1).clone()
        torch.distributed.all_reduce(total)
        return total[0] / self.world

    def gradient(self, backward: Callable[[], None], space) -> None:
        """``backward()``, then the gradients averaged over ranks in place (unless the
        parameters are sharded: FSDP2 averaged them in the backward pass); a rank whose
        backward (or forward) pass failed contributes zeros."""
        try:
            backward()
        except Exception as err:
            self._failed(None, err)
            for p in space.params.values():
                p.grad = torch.zeros_like(p)
        if space.sharded:
            return
        dist = torch.distributed
        grads = []
        for p in space.params.values():
            if p.grad is None:  # every rank reduces the same tensors
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        for g in grads:
            dist.all_reduce(g)
            g.div_(self.world)

    def merge(self, rows: list[tuple[float, ...]], failure: str | None) -> list:
        """The mean over ranks of the ``k``-th rows, for every ``k``: the numbers of the
        global batch where they are linear in the rank-mean loss (the loss itself, a trace of
        its Hessian)."""
        self.raise_failures(failure)
        parts = self.gather(rows)
        return [
            tuple(sum(column) / self.world for column in zip(*ranked, strict=True))
            for ranked in zip(*parts, strict=True)
        ]

    def _failed(self, where, err: Exception) -> None:
        if self.first_failure is None:
            at = "" if where is None else f"{where}: "
            self.first_failure = f"{at}{type(err).__name__}: {err}"

    def check_finite(self, finite: bool) -> None:
        if not finite:  # every rank sees the same averaged losses: all get here
            self.raise_failures(self.local_failure())
        self.local_losses.clear()

    def local_failure(self) -> str | None:
        """What failed on this rank: an exception, else its first non-finite local loss."""
        if self.first_failure is not None:
            return self.first_failure
        for where, loss in self.local_losses:
            if not bool(torch.isfinite(loss)):
                return f"non-finite loss ({float(loss)}) at {where}"
        return None
