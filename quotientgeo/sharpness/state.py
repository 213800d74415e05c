"""The model a measure reads is left exactly as it was given."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from ..geometry import shards
from ..geometry.perturbation import clone_together

__all__ = ["model_state_preserved"]


@contextlib.contextmanager
def model_state_preserved(
    model: nn.Module, params: Mapping[str, torch.Tensor] | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Evaluate in eval mode; restore modes, buffers, ``params`` and ``.grad`` bit-exactly.

    Yields a copy of ``params`` (by name; each tensor's local part where the model is sharded,
    contiguous, in order in one allocation per dtype and device): the starting weights, which
    the caller may perturb the model away from in place; they are written back on exit, also
    on an exception or ``KeyboardInterrupt``. Gradients are put aside, not copied: every
    ``.grad`` is ``None`` inside, and the very tensors (unchanged) are back on exit.
    """
    modes = [(m, m.training) for m in model.modules()]
    buffers = [
        (m, name, b, b.detach().clone())
        for m in model.modules()
        for name, b in m._buffers.items()
        if b is not None
    ]
    entries = [(m, name, p) for m in model.modules() for name, p in m._parameters.items()]
    grads = [(p, p.grad) for _, _, p in entries if p is not None]
    targets = {} if params is None else {name: shards.local(p) for name, p in params.items()}
    saved = {}
    try:
        with torch.no_grad():  # adjacent in one allocation: consecutive ones read as one view
            saved = dict(zip(targets, clone_together(list(targets.values())), strict=True))
        for p, _ in grads:
            p.grad = None
        model.eval()
        yield saved
    finally:
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for m, name, p in entries:
                if m._parameters.get(name) is not p:
                    m._parameters[name] = p
            for name, value in saved.items():
                targets[name].copy_(value)
            for m, name, b, value in buffers:
                if m._buffers.get(name) is not b:
                    m._buffers[name] = b
                b.copy_(value)
            for p, g in grads:
                p.grad = g
