"""Small vision transformers on scikit-learn's digits: data, model, training, on-disk cache.

The 8×8 digit images are cut into 2×2 patches (16 tokens of 4 pixels), embedded linearly, given
a learned position embedding, passed through an :class:`torch.nn.TransformerEncoder` (pre-norm,
no dropout, so :func:`quotientgeo.find_symmetries` maps every attention head) and mean-pooled
into a linear classifier. Nothing is downloaded: the digits ship with scikit-learn.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

CACHE_VERSION = 2


def load_digits_split(n_train: int, seed: int) -> dict[str, torch.Tensor]:
    """Digits as ``(N, 16, 4)`` patch sequences in ``[0, 1]``; a seeded train/test split."""
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32).view(-1, 4, 2, 4, 2) / 16.0
    X = X.permute(0, 1, 3, 2, 4).reshape(-1, 16, 4)  # (N, 4x4 patches, 2x2 pixels)
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    tr, te = perm[:n_train], perm[n_train:]
    return {"x_train": X[tr], "y_train": y[tr], "x_test": X[te], "y_test": y[te]}


class DigitsViT(nn.Module):
    """Patch embedding, position embedding, ``nn.TransformerEncoder``, mean pool, linear head."""

    def __init__(self, width: int = 32, heads: int = 4, layers: int = 2, tokens: int = 16):
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.pos = nn.Parameter(0.02 * torch.randn(tokens, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=2 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(x) + self.pos)
        return self.head(self.norm(h).mean(1))


def cross_entropy(model: nn.Module, batch) -> torch.Tensor:
    """Mean cross-entropy of a ``(x, y)`` batch (the loss of every sharpness measure)."""
    x, y = batch
    return F.cross_entropy(model(x), y)


@dataclass(frozen=True)
class TrainConfig:
    """One member of the population."""

    width: int
    lr: float
    weight_decay: float
    batch_size: int
    epochs: int
    seed: int
    heads: int = 4
    layers: int = 2

    def key(self, data_seed: int, n_train: int) -> str:
        blob = json.dumps([asdict(self), data_seed, n_train, CACHE_VERSION], sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]


def population(n_models: int, seed: int, *, quick: bool = False) -> list[TrainConfig]:
    """Random hyper-parameters: learning rate, weight decay, batch size, width, epochs."""
    rng = random.Random(seed)
    configs = []
    for i in range(n_models):
        configs.append(
            TrainConfig(
                width=rng.choice([16] if quick else [16, 32]),
                lr=10 ** rng.uniform(-2.7, -2.0) if quick else 10 ** rng.uniform(-2.6, -1.9),
                weight_decay=rng.choice([0.0, 1e-4, 1e-2, 1e-1]),
                batch_size=rng.choice([16, 32, 64, 128]),
                epochs=rng.choice([6, 12] if quick else [30, 60, 100]),
                seed=seed * 1000 + i,
            )
        )
    return configs


@torch.no_grad()
def error(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return float((model(x).argmax(1) != y).float().mean())


def train(cfg: TrainConfig, data: dict[str, torch.Tensor]) -> DigitsViT:
    """AdamW with cosine decay, float32."""
    torch.manual_seed(cfg.seed)
    model = DigitsViT(cfg.width, cfg.heads, cfg.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    x, y = data["x_train"], data["y_train"]
    steps = cfg.epochs * math.ceil(len(y) / cfg.batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(cfg.seed)
    model.train()
    for _ in range(cfg.epochs):
        for idx in torch.randperm(len(y), generator=gen).split(cfg.batch_size):
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    return model


def trained(cfg: TrainConfig, data, cache: Path, data_seed: int) -> tuple[DigitsViT, dict]:
    """The trained model and its errors, from ``cache`` when present (else trained and saved)."""
    path = cache / f"vit-{cfg.key(data_seed, len(data['y_train']))}.pt"
    if path.exists():
        blob = torch.load(path, map_location="cpu", weights_only=True)
        model = DigitsViT(cfg.width, cfg.heads, cfg.layers)
        model.load_state_dict(blob["state_dict"])
        model.eval()
        return model, {**blob["metrics"], "cached": True}
    model = train(cfg, data)
    metrics = {
        "train_error": error(model, data["x_train"], data["y_train"]),
        "test_error": error(model, data["x_test"], data["y_test"]),
    }
    metrics["gap"] = metrics["test_error"] - metrics["train_error"]
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"state_dict": model.state_dict(), "config": asdict(cfg), "metrics": metrics}, tmp)
    tmp.replace(path)
    return model, {**metrics, "cached": False}


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
