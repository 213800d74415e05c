"""Small vision transformers on scikit-learn's digits: data, model, training.

The 8×8 digit images are cut into 2×2 patches (16 tokens of 4 pixels), embedded linearly, given
a learned position embedding, passed through an :class:`torch.nn.TransformerEncoder` (pre-norm,
no dropout, so :func:`quotientgeo.find_symmetries` maps every attention head) and mean-pooled
into a linear classifier. Nothing is downloaded: the digits ship with scikit-learn.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn
from torch.nn import functional as F

Tensor = torch.Tensor
ModuleT = TypeVar("ModuleT", bound=nn.Module)


def digits() -> tuple[Tensor, Tensor]:
    """All 1797 digits as ``(N, 16, 4)`` patch sequences in ``[0, 1]`` and their labels."""
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    images = torch.tensor(X, dtype=torch.float32).view(-1, 8, 8) / 16.0
    return to_patches(images), torch.tensor(y, dtype=torch.long)


def to_patches(images: Tensor) -> Tensor:
    """``(N, 8, 8)`` images to ``(N, 16, 4)``: 4×4 patches of 2×2 pixels, row-major."""
    return images.reshape(-1, 4, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(-1, 16, 4)


def to_images(patches: Tensor) -> Tensor:
    """The inverse of :func:`to_patches`."""
    return patches.reshape(-1, 4, 4, 2, 2).permute(0, 1, 3, 2, 4).reshape(-1, 8, 8)


def load_digits_split(n_train: int, seed: int) -> dict[str, Tensor]:
    """Digits as ``(N, 16, 4)`` patch sequences; a seeded train/test split."""
    X, y = digits()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    tr, te = perm[:n_train], perm[n_train:]
    return {"x_train": X[tr], "y_train": y[tr], "x_test": X[te], "y_test": y[te]}


def shift(x: Tensor, gen: torch.Generator) -> Tensor:
    """Augmentation: each image translated by -1, 0 or +1 pixel per axis (zero fill)."""
    images = F.pad(to_images(x), (1, 1, 1, 1))
    n = len(images)
    dy, dx = torch.randint(0, 3, (2, n, 1), generator=gen)
    rows = (dy + torch.arange(8))[:, :, None]
    cols = (dx + torch.arange(8))[:, None, :]
    return to_patches(images[torch.arange(n)[:, None, None], rows, cols])


def noise(x: Tensor, gen: torch.Generator) -> Tensor:
    """Augmentation: Gaussian pixel noise of standard deviation 0.1, clipped to ``[0, 1]``."""
    return (x + 0.1 * torch.randn(x.shape, generator=gen)).clamp_(0.0, 1.0)


AUGMENTATIONS: dict[str, Callable[[Tensor, torch.Generator], Tensor] | None] = {
    "none": None,
    "shift": shift,
    "noise": noise,
}


class DigitsViT(nn.Module):
    """Patch embedding, position embedding, ``nn.TransformerEncoder``, mean pool, linear head."""

    def __init__(
        self, width: int = 32, heads: int = 4, layers: int = 2, tokens: int = 16, classes: int = 10
    ):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.pos = nn.Parameter(0.02 * torch.randn(tokens, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=2 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.encoder(self.embed(x) + self.pos)
        return self.head(self.norm(h).mean(1))


def cross_entropy(model: nn.Module, batch) -> Tensor:
    """Mean cross-entropy of a ``(x, y)`` batch (the loss of every sharpness measure)."""
    x, y = batch
    return F.cross_entropy(model(x), y)


@torch.no_grad()
def error(model: nn.Module, x: Tensor, y: Tensor) -> float:
    model.eval()
    return float((model(x).argmax(1) != y).float().mean())


def fit(
    model: ModuleT,
    x: Tensor,
    y: Tensor,
    *,
    lr: float,
    weight_decay: float,
    epochs: int,
    batch_size: int,
    seed: int,
    label_smoothing: float = 0.0,
    augment: str = "none",
) -> ModuleT:
    """AdamW with cosine decay to 0 on shuffled mini-batches of ``(x, y)``, float32; inputs
    pass through ``AUGMENTATIONS[augment]``; returns ``model`` in eval mode."""
    transform = AUGMENTATIONS[augment]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    steps = epochs * math.ceil(len(y) / batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(batch_size):
            xb = x[idx] if transform is None else transform(x[idx], gen)
            loss = F.cross_entropy(model(xb), y[idx], label_smoothing=label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    return model


@dataclass(frozen=True)
class TrainConfig:
    """A model trained from scratch (:func:`small_trained`)."""

    width: int
    lr: float
    weight_decay: float
    batch_size: int
    epochs: int
    seed: int
    heads: int = 4
    layers: int = 2


def train(cfg: TrainConfig, data: dict[str, Tensor]) -> DigitsViT:
    """A :class:`DigitsViT` trained from scratch on ``data``'s training split."""
    torch.manual_seed(cfg.seed)
    model = DigitsViT(cfg.width, cfg.heads, cfg.layers)
    return fit(
        model,
        data["x_train"],
        data["y_train"],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        epochs=cfg.epochs,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
    )


def small_trained(quick: bool, seed: int):
    """One small ViT trained briefly on 300 digits, and that data (invariance, rho-sweep)."""
    data = load_digits_split(300, seed)
    cfg = TrainConfig(
        width=16 if quick else 32,
        lr=3e-3,
        weight_decay=0.0,
        batch_size=32,
        epochs=3 if quick else 10,
        seed=seed,
    )
    return train(cfg, data), data
