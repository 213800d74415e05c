"""How a sharpness measurement spreads over the ranks of a ``torch.distributed`` process group.

Modes (the measures' ``distributed=`` argument), active when the user has initialised a
process group of more than one rank:

- ``"batches"`` (default): each rank measures its own batches (the ``DistributedSampler``
  convention); at the end every rank receives all ranks' per-batch results in rank order, so
  every rank returns the result one process returns for the concatenated list of batches.
  Random draws are seeded per global batch index, so they do not depend on the split.
- ``"split_batch"``: the ``k``-th batches of all ranks form one global batch. Every iteration
  the loss and the gradient with respect to the shared perturbation are averaged over ranks
  (one all-reduce of a flat buffer), so all ranks follow one perturbation. This equals one
  process measuring the concatenated batch when ``loss_fn`` is a mean over equally sized
  rank batches (the mean of the rank means is then the global mean).
- ``"off"``: ignore the process group; each rank returns its local result.

A failure on one rank (a raising ``loss_fn``, a non-finite loss) makes every rank raise a
``RuntimeError`` naming the rank, batch and iteration, instead of leaving the others waiting
in a collective.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

__all__ = ["MODES", "Ranks"]

MODES = ("batches", "split_batch", "off")


class Ranks:
    """The process group as one measurement sees it: ``mode``, ``rank`` and ``world``."""

    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"distributed must be one of {MODES}, got {mode!r}")
        dist = torch.distributed
        active = (
            mode != "off"
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
        )
        self.mode = mode if active else "off"
        self.rank = dist.get_rank() if active else 0
        self.world = dist.get_world_size() if active else 1

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def gather(self, value) -> list:
        """``value`` of every rank, in rank order (``[value]`` when inactive)."""
        if not self.active:
            return [value]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, value)
        return out

    def batch_offset(self, batches) -> int:
        """Global index of this rank's first batch (checks the counts the mode needs)."""
        if not self.active:
            return 0
        try:
            count = len(batches)
        except TypeError:
            count = None
        counts = self.gather(count)
        if any(c is None for c in counts):
            ranks = [r for r, c in enumerate(counts) if c is None]
            raise ValueError(
                f"distributed sharpness needs batches with a length (a list, a DataLoader); "
                f"rank(s) {ranks} passed an iterable without one"
            )
        if self.mode == "split_batch":
            if len(set(counts)) != 1:
                raise ValueError(
                    f"distributed='split_batch' pairs the k-th batches of all ranks, but the "
                    f"ranks hold {counts} batches"
                )
            return 0
        return sum(counts[: self.rank])

    def raise_failures(self, failure: str | None) -> None:
        """Raise on every rank if any rank reports a failure (a collective: all must call)."""
        failures = self.gather(failure)
        bad = [(r, f) for r, f in enumerate(failures) if f is not None]
        if bad:
            lines = "; ".join(f"rank {r}: {f}" for r, f in bad)
            raise RuntimeError(f"sharpness failed on {len(bad)} rank(s): {lines}")

    def average(self, loss: Tensor, grads: list[Tensor] | None) -> tuple[Tensor, list | None]:
        """Loss and gradients averaged over ranks, in one all-reduce of a flat buffer."""
        parts = [loss.reshape(1)] + ([g.reshape(-1) for g in grads] if grads else [])
        flat = torch.cat(parts)
        torch.distributed.all_reduce(flat)
        flat /= self.world
        if not grads:
            return flat[0], grads
        sizes = [1] + [g.numel() for g in grads]
        pieces = flat.split(sizes)
        return pieces[0][0], [p.view_as(g) for p, g in zip(pieces[1:], grads, strict=True)]
