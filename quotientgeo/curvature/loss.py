r"""The batch-averaged loss as a function of a parameter geometry's coordinates, and its
Euclidean derivatives: the gradient once, Hessian-vector products by double backward.

The coordinates are the geometry's points (one ``(heads, Σk, h)`` tensor per kind) and the flat
adaptive vector ``w`` (:meth:`~quotientgeo.ParameterGeometry.gather`); the model sees them
through :meth:`~quotientgeo.ParameterGeometry.scatter` and ``torch.func.functional_call``, so
its parameters are never written. The loss is ``f = (1/N) Σ_S L_S``, the mean of ``loss_fn``
over the ``N`` batches, each batch weighted alike (as the sharpness measures average).

A product ``∇²f v`` builds each batch's gradient graph (``create_graph=True``) and
differentiates ``⟨∇L_S, v⟩`` once more: one forward and two backward passes per batch. Several
vectors share one graph per batch. Attention runs in PyTorch's math kernel of
``scaled_dot_product_attention`` here, whose backward is differentiable (the fused CPU and
flash kernels have no second derivative).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..geometry import ParameterGeometry
from ..sharpness.flatness import LossOf
from ..sharpness.state import model_state_preserved

Tensor = torch.Tensor

__all__ = ["BatchLoss"]

RESTORED = "the model is restored"


class BatchLoss:
    """``f(points, w) = mean_S loss_fn(model, S)`` with the parameters scattered from the
    coordinates (module docstring).

    Args:
        geometry: the model's parameter geometry (its model is the one measured).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``.
        batches: the batches, a list (each product runs over all of them).
    """

    def __init__(self, geometry: ParameterGeometry, loss_fn: Callable, batches: Sequence[Any]):
        self.geometry = geometry
        self.model = geometry.model
        self.wrapper = LossOf(self.model, loss_fn)
        self.batches = batches
        #: Batch passes run so far (a product over ``k`` vectors counts one per batch).
        self.passes = 0

    def _graph(
        self, leaves: list[Tensor], batch, index: int, create_graph: bool = True
    ) -> tuple[Tensor, list]:
        """The loss of ``batch`` at ``leaves`` and its gradient, with its own graph where
        ``create_graph`` (``None`` where the loss does not depend on a leaf)."""
        params = self.geometry.scatter(leaves[:-1], leaves[-1])
        named = {f"model.{name}": value for name, value in params.items()}
        try:
            with sdpa_kernel(SDPBackend.MATH):
                loss = torch.func.functional_call(self.wrapper, named, (batch,))
        except Exception as err:
            _note(err, f"raised by loss_fn on batch {index}; {RESTORED}")
            raise
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            got = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor, got {got} (batch {index})")
        if not bool(torch.isfinite(loss.detach()).all()):
            raise ValueError(
                f"loss_fn returned a non-finite loss ({float(loss.detach())}) on batch {index}; "
                f"{RESTORED}"
            )
        if not loss.requires_grad:
            return loss.reshape(()), [None] * len(leaves)
        grads = torch.autograd.grad(
            loss.reshape(()), leaves, create_graph=create_graph, allow_unused=True
        )
        return loss.reshape(()), list(grads)

    def gradient(
        self, points: Sequence[Tensor], w: Tensor, advance: Callable[[], object] = lambda: None
    ) -> tuple[float, list[Tensor]]:
        """``(f, ∇f)`` at ``(points, w)``: the mean loss and its gradient, one tensor per
        coordinate tensor (points of each kind, then ``w``). An ordinary backward pass per
        batch (no graph of the gradient); the first batch's gradient is the accumulator."""
        coords = (*points, w)
        total: list[Tensor | None] = [None] * len(coords)
        value = 0.0
        with model_state_preserved(self.model), torch.enable_grad():
            for i, batch in enumerate(self.batches):
                leaves = [t.detach().requires_grad_(True) for t in coords]
                loss, grads = self._graph(leaves, batch, i, create_graph=False)
                value += float(loss.detach())
                for j, g in enumerate(grads):
                    if g is not None:
                        acc = total[j]
                        total[j] = g.detach() if acc is None else acc.add_(g)
                del grads
                self.passes += 1
                advance()
        n = len(self.batches)
        out = [torch.zeros_like(t) if g is None else g for g, t in zip(total, coords, strict=True)]
        if n > 1:
            torch._foreach_div_(out, float(n))  # pyright: ignore[reportPrivateImportUsage]
        return value / n, out

    def hvp(
        self,
        points: Sequence[Tensor],
        w: Tensor,
        vectors: Sequence[Sequence[Tensor]],
        advance: Callable[[], object] = lambda: None,
    ) -> list[list[Tensor]]:
        """``∇²f v`` for each ``v`` of ``vectors`` (each a list shaped as ``(*points, w)``): one
        gradient graph per batch, one more backward pass per vector."""
        out = [[torch.zeros_like(t) for t in v] for v in vectors]
        with model_state_preserved(self.model), torch.enable_grad():
            for i, batch in enumerate(self.batches):
                leaves = [t.detach().requires_grad_(True) for t in (*points, w)]
                _, grads = self._graph(leaves, batch, i)
                live = [j for j, g in enumerate(grads) if g is not None and g.requires_grad]
                for k, v in enumerate(vectors):
                    if not live:  # the loss is at most linear in the coordinates: ∇²L_S = 0
                        break
                    try:
                        hv = torch.autograd.grad(
                            [grads[j] for j in live],
                            leaves,
                            [v[j] for j in live],
                            retain_graph=k < len(vectors) - 1,
                            allow_unused=True,
                        )
                    except Exception as err:
                        _note(
                            err,
                            f"raised by a Hessian-vector product on batch {i} (second "
                            "derivatives need every operation of the loss to be twice "
                            "differentiable, e.g. Hugging Face models with "
                            f"attn_implementation='eager'); {RESTORED}",
                        )
                        raise
                    for acc, h in zip(out[k], hv, strict=True):
                        if h is not None:
                            acc.add_(h)
                self.passes += 1
                advance()
        n = len(self.batches)
        return [[t / n for t in v] for v in out]


def _note(err: BaseException, message: str) -> None:
    add_note = getattr(err, "add_note", None)  # Python 3.11+
    if add_note is not None:
        add_note(message)
