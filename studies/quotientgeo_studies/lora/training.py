"""How a member is fine-tuned: the five optimizer arms and one training loop.

Every arm steps with weight decay 0 at the learning rate ``lr`` of its base optimizer, under
the same cosine decay to 0 over the same steps; the SAM arms take two forward and backward
passes per step.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from quotientgeo.optim import GeodesicSAM

from .model import FROZEN_ATTENTION

Tensor = torch.Tensor

ARMS = ("adamw", "peft_riemannian", "quotient_adam", "sam", "geodesic_sam")
"""The optimizers compared, in table order."""

SAM_ARMS = ("sam", "geodesic_sam")


@dataclasses.dataclass(frozen=True)
class ArmSettings:
    """The arms' settings other than the learning rate: ``rho`` of both SAM arms, the damping
    ``reg`` of PEFT's Riemannian preconditioner, the Gram relaxation ``quotient_eps`` of the
    quotient optimizer's ``GL(r)`` metric, the weight decay of the arms built on AdamW (the
    quotient optimizer's Adam has none by default)."""

    rho: float = 0.1
    reg: float = 1e-2
    quotient_eps: float = 1e-2
    weight_decay: float = 0.0


def optimizer(arm: str, model: nn.Module, lr: float, s: ArmSettings) -> torch.optim.Optimizer:
    """The optimizer of ``arm`` over ``model``'s trainable parameters:

    - ``adamw``: ``torch.optim.AdamW``;
    - ``peft_riemannian``: ``peft.optimizers.create_riemannian_optimizer`` around AdamW (the
      Riemannian preconditioner of Zhang & Pilanci 2024: ``B``'s gradient times
      ``(AAᵀ + reg·I)⁻¹``, ``A``'s times ``(BᵀB + reg·I)⁻¹``);
    - ``quotient_adam``: geoopt's ``RiemannianAdam`` with the LoRA pairs as points of the
      ``GL(r)`` quotient (mix metric, Gram relaxation ``quotient_eps``), the rest Euclidean
      (:func:`quotientgeo.optim.quotient_optimizer`);
    - ``sam``: :class:`~quotientgeo.optim.GeodesicSAM` with ``variant="sam"`` around AdamW;
    - ``geodesic_sam``: :class:`~quotientgeo.optim.GeodesicSAM`, ``variant="geodesic"``, the
      mix metric and the second-order map, around AdamW.
    """
    wd = s.weight_decay
    if arm == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd)
    if arm == "peft_riemannian":
        from peft.optimizers import create_riemannian_optimizer

        return create_riemannian_optimizer(
            model,  # a PeftModel
            torch.optim.AdamW,
            lr=lr,
            reg=s.reg,
            weight_decay=wd,
        )
    if arm == "quotient_adam":
        import geoopt

        from quotientgeo.optim import quotient_optimizer

        return quotient_optimizer(
            model,
            geoopt.optim.RiemannianAdam,
            lr=lr,
            metric="mix",
            eps=s.quotient_eps,
        )  # RiemannianAdam is torch's Adam underneath: weight decay 0 by default
    if arm == "sam":
        return GeodesicSAM(
            model, torch.optim.AdamW, rho=s.rho, variant="sam", lr=lr, weight_decay=wd
        )
    if arm == "geodesic_sam":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", FROZEN_ATTENTION, UserWarning)
            return GeodesicSAM(
                model,
                torch.optim.AdamW,
                rho=s.rho,
                variant="geodesic",
                metric="mix",
                lr=lr,
                weight_decay=wd,
            )
    raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")


def step(arm: str, model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor) -> None:
    """One optimizer step on the cross-entropy of ``(x, y)``; the model's gradients are
    cleared first."""

    def closure() -> Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    model.zero_grad(set_to_none=True)
    if arm in SAM_ARMS:
        opt.step(closure)
    else:
        closure()
        opt.step()


def train(
    model: nn.Module,
    arm: str,
    lr: float,
    x: Tensor,
    y: Tensor,
    *,
    steps: int,
    batch_size: int,
    seed: int,
    settings: ArmSettings,
) -> dict[str, Any]:
    """Fine-tune ``model`` in place: ``steps`` steps of ``arm`` on shuffled batches of
    ``(x, y)`` (a new order per epoch, from ``seed``), the learning rate decaying from ``lr``
    to 0 on a cosine; the model is left in evaluation mode with its gradients cleared.
    Returns ``{"seconds", "diverged"}`` (a trainable parameter is not finite)."""
    opt = optimizer(arm, model, lr, settings)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    tick, done = time.perf_counter(), 0
    model.train()
    while done < steps:
        for idx in torch.randperm(len(y), generator=gen).split(batch_size):
            if done == steps:
                break
            step(arm, model, opt, x[idx], y[idx])
            schedule.step()
            done += 1
    model.zero_grad(set_to_none=True)
    model.eval()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters() if p.requires_grad)
    return {"seconds": time.perf_counter() - tick, "diverged": not finite}
