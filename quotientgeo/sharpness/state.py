"""The model a measure reads is left exactly as it was given."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["model_state_preserved"]


@contextlib.contextmanager
def model_state_preserved(model: nn.Module):
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
