r"""Relative flatness (Petzka et al., NeurIPS 2021) of one linear layer, computed exactly.

For the weight ``W ∈ R^{m×d}`` of an ``nn.Linear`` (rows ``w_s ∈ R^d``, ``s = 1..m``; the bias
is not part of it) and the loss ``L_S`` of a batch ``S``,

    ``κ(W) = Σ_{s,s'} ⟨w_s, w_s'⟩ Tr(H_{s,s'})``,  ``H_{s,s'} = ∂²L_S / ∂w_s ∂w_s' ∈ R^{d×d}``,

Petzka et al.'s ``κ^φ_Tr`` with ``φ`` the network up to the layer's input, averaged over
batches.

The algorithm. Write ``H^{(k)} ∈ R^{m×m}`` for the entries ``H[(s,k), (s',k)]`` of the
Hessian that share the input coordinate ``k``, and ``G = W Wᵀ``: then
``κ = Σ_k Tr(G H^{(k)})``. For any ``Q, P ∈ R^{m×p}`` with ``Q Pᵀ = G``,
``Tr(G H^{(k)}) = Σ_i p_iᵀ H^{(k)} q_i``, and ``H^{(k)} q_i`` is column ``k`` of the
Hessian-vector product ``H (q_i e_kᵀ)`` (``q_i`` in column ``k``, zeros elsewhere). With
``(Q, P) = (I, G)`` when ``m ≤ d`` and ``(Q, P) = (W, W)`` when ``d < m`` that is
``min(m, d) · d`` Hessian-vector products, exact (no sampling, no ``(md)²`` Hessian in
memory). Each is a second backward pass through the graph of ``∂L_S/∂W``, built once per batch
with every other parameter detached; ``chunk_size`` of them share one pass, batched by
``torch.autograd.grad(..., is_grads_batched=True)`` (``vmap``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..geometry import shards as sh
from ..options import Distributed
from ..progress import progress_bar
from ..validation import positive_int
from .checks import check_batches, check_loss_fn, check_model
from .ranks import add_note, described, ranks_for
from .state import model_state_preserved

Tensor = torch.Tensor

__all__ = ["FlatnessResult", "relative_flatness"]

RESTORED = "the model is restored"


@dataclasses.dataclass(frozen=True)
class FlatnessResult:
    """Outcome of :func:`relative_flatness`.

    Attributes:
        value: mean over batches of ``κ = Σ_{s,s'} ⟨w_s, w_s'⟩ Tr(H_{s,s'})``.
        per_batch: ``κ`` of every batch.
        losses: the loss ``L_S`` of every batch at the model's weights.
        settings: the layer (name, shape), the Hessian-vector products per batch, the chunk
            size, the number of batches, the distributed mode and world size, dtype and
            device.
        wall_time: seconds.
    """

    value: float
    per_batch: list[float]
    losses: list[float]
    settings: dict[str, Any]
    wall_time: float

    def to_dict(self) -> dict[str, Any]:
        """Plain ``dict`` of built-in types, ready for :func:`json.dumps`."""
        return dataclasses.asdict(self)

    def __repr__(self) -> str:
        return (
            f"FlatnessResult(value={self.value:.6g}, layer={self.settings.get('layer')!r}, "
            f"batches={len(self.per_batch)}, wall_time={self.wall_time:.3g}s)"
        )


def relative_flatness(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batches: Iterable,
    *,
    layer: str | nn.Linear,
    chunk_size: int = 64,
    progress: bool = True,
    distributed: Distributed | str = Distributed.AUTO,
) -> FlatnessResult:
    r"""Relative flatness of Petzka et al. (NeurIPS 2021) of the feature layer ``layer``.

    ``κ(W) = Σ_{s,s'=1}^{m} ⟨w_s, w_s'⟩ Tr(H_{s,s'})`` for the weight ``W ∈ R^{m×d}`` of
    ``layer`` (rows ``w_s``; the bias is excluded), with ``H_{s,s'} = ∂²L_S/∂w_s∂w_s'`` the
    ``d×d`` block of the Hessian of the batch loss ``L_S`` with respect to ``W``; the mean over
    ``batches``. Exact: ``min(m, d)·d`` Hessian-vector products per batch, no full Hessian
    (:mod:`quotientgeo.sharpness.flatness`).

    In a ReLU network it does not change under the re-scalings of Petzka et al.: layer-wise,
    the layer (weight and bias) times ``λ > 0`` and the next layer's weight times ``1/λ``, or
    the previous layer times ``λ`` and the layer's weight times ``1/λ``; neuron-wise, row
    ``w_s`` and bias ``b_s`` times ``λ_s > 0`` and the next layer's column ``s`` times
    ``1/λ_s``. It does change when the neurons feeding the layer are re-scaled one by one
    (``W``'s columns): compare models whose features are on a common scale.

    Args:
        model: the network; read only (evaluated in eval mode; parameters, buffers, modes and
            ``.grad`` restored bit-exactly, also on errors).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``, as for
            :func:`~quotientgeo.geodesic_sharpness`.
        batches: any iterable of batches (a list, a ``DataLoader``), iterated once.
        layer: the feature layer, an ``nn.Linear`` of ``model``: its name in
            ``model.named_modules()`` (``"classifier"``, ``"encoder.layers.0.linear1"``) or the
            module itself.
        chunk_size: Hessian-vector products per backward pass (memory grows linearly with
            it); ``1`` computes them one by one without ``vmap``.
        progress: a progress bar, on a terminal (and on rank 0 only).
        distributed: in an initialised process group of several ranks, as for the sharpness
            measures (:mod:`quotientgeo.sharpness.ranks`): ``"batches"`` (the default,
            ``"auto"``): each rank measures its own batches and every rank returns the result
            of one process on all ranks' batches, in rank order; ``"split_batch"``: the
            ``k``-th batches of the ranks form one batch, whose ``κ`` and loss are the means
            over ranks of the ranks' (exact when ``loss_fn`` is a mean over equally sized rank
            batches: the Hessian of the mean loss is the mean of the Hessians, and ``κ`` is
            linear in it); ``"off"``: each rank alone. Nothing without a process group. A
            model sharded over the ranks (FSDP2) is refused.

    Returns:
        A :class:`FlatnessResult`; ``value`` is the mean of ``per_batch``.
    """
    check_model(model)
    check_loss_fn(loss_fn)
    check_batches(batches)
    name, linear = _feature_layer(model, layer)
    chunk_size = positive_int("chunk_size", chunk_size)
    if sh.sharded_parameters(model.parameters()):
        raise ValueError(
            "relative flatness cannot measure a model sharded over the ranks (FSDP2): measure a "
            "copy that every rank holds whole"
        )
    ranks = ranks_for(distributed)
    weight = linear.weight
    m, d = weight.shape
    n_hvps = min(m, d) * d
    chunks = -(-n_hvps // chunk_size)
    try:
        count = len(batches)  # pyright: ignore[reportArgumentType]
    except TypeError:
        count = None
    bar = progress_bar(
        total=None if count is None else count * chunks,
        desc="relative flatness",
        enabled=progress and ranks.rank == 0,
    )
    offset = ranks.batch_offset(batches)
    t0 = time.perf_counter()
    rows, failure = [], None
    with model_state_preserved(model), bar:
        try:
            hessian = _LayerHessian(model, loss_fn, name, weight, chunk_size)
            for i, batch in enumerate(batches):
                rows.append(hessian.kappa(batch, offset + i, advance=lambda: bar.update(1)))
        except Exception as err:
            if ranks.world == 1:
                raise
            failure = described(err)  # the other ranks wait in merge: report there
    rows = ranks.merge(rows, failure)
    if not rows:
        raise ValueError("batches is empty: nothing to measure relative flatness on")
    losses = [loss for loss, _ in rows]
    values = [value for _, value in rows]
    settings = {
        "measure": "relative_flatness",
        "layer": name,
        "shape": [m, d],
        "hvps_per_batch": n_hvps,
        "chunk_size": chunk_size,
        "n_batches": len(values),
        "distributed": ranks.mode.value,
        "world_size": ranks.world,
        "dtype": str(weight.dtype),
        "device": str(weight.device),
    }
    return FlatnessResult(
        value=sum(values) / len(values),
        per_batch=values,
        losses=losses,
        settings=settings,
        wall_time=time.perf_counter() - t0,
    )


def _feature_layer(model: nn.Module, layer) -> tuple[str, nn.Linear]:
    """``(name, module)`` of the feature layer given by name or as a module of ``model``."""
    named = dict(model.named_modules())
    if isinstance(layer, str):
        if layer not in named:
            linear = [n for n, m in named.items() if isinstance(m, nn.Linear)]
            shown = ", ".join(repr(n) for n in linear[:8]) + (", …" if len(linear) > 8 else "")
            raise ValueError(
                f"model has no module named {layer!r}; its nn.Linear layers are {shown or 'none'}"
            )
        name, module = layer, named[layer]
    elif isinstance(layer, nn.Module):
        found = [n for n, m in named.items() if m is layer]
        if not found:
            raise ValueError(f"layer {type(layer).__name__} is not a submodule of model")
        name, module = found[0], layer
    else:
        raise TypeError(
            f"layer must be the name of an nn.Linear of model or the module itself, got "
            f"{type(layer).__name__}"
        )
    if not isinstance(module, nn.Linear):
        raise TypeError(
            f"layer {name!r} is a {type(module).__name__}, not an nn.Linear: relative flatness "
            "is defined for the weight matrix of a linear layer"
        )
    if not isinstance(module._parameters.get("weight"), nn.Parameter):
        raise ValueError(
            f"the weight of layer {name!r} is not a registered parameter (a parametrization?)"
        )
    return name, module


def _probes(w: Tensor) -> tuple[Tensor, Tensor]:
    """``(Q, P)``, ``m×p`` with ``Q Pᵀ = W Wᵀ`` and ``p = min(m, d)``."""
    m, d = w.shape
    if m <= d:
        return torch.eye(m, dtype=w.dtype, device=w.device), w @ w.T
    return w, w


class LossOf(nn.Module):
    """``forward(batch) = loss_fn(model, batch)``: the module given to ``functional_call`` (also
    by :mod:`quotientgeo.curvature`)."""

    def __init__(self, model: nn.Module, loss_fn: Callable):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)


class _LayerHessian:
    """``κ`` of one batch by Hessian-vector products with respect to one weight matrix."""

    def __init__(self, model: nn.Module, loss_fn: Callable, name: str, weight, chunk_size: int):
        self.wrapper = LossOf(model, loss_fn)
        self.name = name
        self.weight = weight
        self.key = f"model.{name}.weight" if name else "model.weight"
        # every other parameter detached: no graph, and no saved activations, outside the layer
        self.frozen = {
            f"model.{n}": p.detach() for n, p in model.named_parameters() if p is not weight
        }
        self.chunk_size = chunk_size
        w = weight.detach()
        m, d = w.shape
        q, p = _probes(w)
        k = torch.arange(d, device=w.device).repeat(q.shape[1])  # the pairs (i, k), i-major
        i = torch.arange(q.shape[1], device=w.device).repeat_interleave(d)
        self.q, self.p, self.i, self.k, self.shape = q, p, i, k, (m, d)

    def kappa(self, batch, index: int, advance: Callable[[], object]) -> tuple[float, float]:
        """``(L_S, κ)`` of ``batch`` (the ``index``-th); ``advance()`` after each chunk."""
        w = self.weight.detach().requires_grad_(True)
        with torch.enable_grad():
            try:
                loss = torch.func.functional_call(
                    self.wrapper, {**self.frozen, self.key: w}, (batch,)
                )
            except Exception as err:
                add_note(err, f"raised by loss_fn on batch {index}; {RESTORED}")
                raise
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                got = type(loss).__name__ if not isinstance(loss, Tensor) else tuple(loss.shape)
                raise ValueError(f"loss_fn must return a scalar tensor, got {got} (batch {index})")
            if not torch.isfinite(loss).all():
                value = float(loss.detach())
                raise ValueError(
                    f"loss_fn returned a non-finite loss ({value}) on batch {index}; {RESTORED}"
                )
            grad = None
            if loss.requires_grad:
                (grad,) = torch.autograd.grad(
                    loss.reshape(()), w, create_graph=True, allow_unused=True
                )
        if grad is None:
            raise ValueError(
                f"the loss does not depend on the weight of layer {self.name!r} (batch {index})"
            )
        total = torch.zeros((), dtype=w.dtype, device=w.device)
        n = len(self.i)
        for start in range(0, n, self.chunk_size):
            i, k = self.i[start : start + self.chunk_size], self.k[start : start + self.chunk_size]
            if grad.requires_grad:  # else the loss is linear in W: H = 0
                total = total + self._chunk(grad, w, i, k, index)
            advance()
        return float(loss.detach()), float(total)

    def _chunk(self, grad: Tensor, w: Tensor, i: Tensor, k: Tensor, index: int) -> Tensor:
        """``Σ_c p_{i_c}ᵀ (H (q_{i_c} e_{k_c}ᵀ))[:, k_c]`` over the chunk's pairs."""
        c, rows = len(i), torch.arange(len(i), device=w.device)
        v = w.new_zeros(c, *self.shape)
        v[rows, :, k] = self.q[:, i].T
        try:
            if c == 1:
                (hv,) = torch.autograd.grad(grad, w, v[0], retain_graph=True, allow_unused=True)
                hv = None if hv is None else hv[None]
            else:
                (hv,) = torch.autograd.grad(
                    grad, w, v, retain_graph=True, allow_unused=True, is_grads_batched=True
                )
        except Exception as err:
            add_note(
                err,
                f"raised by a Hessian-vector product of layer {self.name!r} on batch {index} "
                f"(chunk_size=1 computes them without vmap; second derivatives need every op "
                f"after the layer to be twice differentiable, e.g. Hugging Face models with "
                f"attn_implementation='eager'); {RESTORED}",
            )
            raise
        if hv is None:  # the gradient does not depend on W
            return torch.zeros((), dtype=w.dtype, device=w.device)
        return (hv[rows, :, k] * self.p[:, i].T).sum()
