"""Training steps shared by the studies and the benchmarks: AdamW, SAM, ASAM and geodesic SAM.

Every method steps the same AdamW; a SAM-type method wraps it in
:class:`~quotientgeo.optim.GeodesicSAM` (two forward and backward passes per step).
``quotientgeo reproduce sam`` trains with these steps and ``quotientgeo bench sam`` times them.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .sam import GeodesicSAM

__all__ = ["METHODS", "make_optimizer", "train_step"]

# GeodesicSAM settings of each method (None: the base optimizer alone)
METHODS = {
    "adamw": None,
    "sam": {"variant": "sam"},
    "asam": {"variant": "asam"},
    "geodesic_mix": {"variant": "geodesic", "metric": "mix"},
    "geodesic_inv": {"variant": "geodesic", "metric": "inv"},
}


def make_optimizer(method: str, model, rho: float | None, **adamw) -> torch.optim.Optimizer:
    """AdamW (``method="adamw"``) or :class:`~quotientgeo.optim.GeodesicSAM` around AdamW."""
    if METHODS[method] is None:
        return torch.optim.AdamW(model.parameters(), **adamw)
    if rho is None:
        raise ValueError(f"method {method!r} is a SAM variant and needs a radius rho")
    return GeodesicSAM(model, torch.optim.AdamW, rho=rho, **METHODS[method], **adamw)


def train_step(method: str, model, opt, x, y) -> None:
    """One step on the cross-entropy of ``(x, y)`` (two forward/backward passes for SAM types)."""

    def closure():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    if METHODS[method] is None:
        closure()
        opt.step()
    else:
        opt.step(closure)
    opt.zero_grad(set_to_none=True)
