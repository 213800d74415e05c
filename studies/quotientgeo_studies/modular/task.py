r"""Modular addition ``(a, b, =) -> (a + b) mod p`` and a one-layer transformer trained on it.

The grokking task of Power et al. (2022) and Nanda et al. (2023):

- **data**: all ``p²`` pairs ``(a, b)``, tokens ``a``, ``b`` and ``=`` (token ``p``), label
  ``(a + b) mod p``, in one seeded random order; a member with training fraction ``φ`` trains
  on the first ``⌈φ p²⌉`` pairs of that order (nested training sets) and is tested on all
  the others;
- **model**: token and position embeddings, one pre-norm ``nn.TransformerEncoderLayer``
  (``nn.MultiheadAttention``, so :func:`quotientgeo.find_symmetries` maps its heads' GL(h)
  symmetry; no dropout), a final ``LayerNorm`` and a linear unembedding ``head`` read at the
  ``=`` position;
- **training**: full-batch AdamW (β = (0.9, 0.98)), constant learning rate, float32, for a
  fixed number of steps.

Addition rather than multiplication: multiplication mod a prime is addition mod ``p - 1`` on
the non-zero residues (through a discrete logarithm), so it is the same task up to a relabelling
plus the absorbing ``0``; addition is the one whose learned algorithm is described (Nanda et al.).

Members are cached on disk under a key that hashes their recipe, so re-running only re-measures.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from .._vit import cross_entropy, error  # the loss of every measure; the error of a split

Tensor = torch.Tensor

CACHE_VERSION = 1


@dataclass(frozen=True)
class Task:
    """The data: the modulus ``p`` and the seed of the pairs' order."""

    p: int = 31
    seed: int = 0


def pairs(task: Task) -> tuple[Tensor, Tensor]:
    """All ``p²`` sequences ``(a, b, =)`` as ``(p², 3)`` tokens and labels ``(a + b) mod p``,
    in the task's seeded random order."""
    p = task.p
    a, b = torch.cartesian_prod(torch.arange(p), torch.arange(p)).unbind(1)
    tokens = torch.stack([a, b, torch.full_like(a, p)], dim=1)
    order = torch.randperm(p * p, generator=torch.Generator().manual_seed(task.seed))
    return tokens[order], ((a + b) % p)[order]


def n_train(task: Task, fraction: float) -> int:
    """Training-set size of fraction ``fraction``: ``⌈fraction · p²⌉``."""
    return math.ceil(fraction * task.p**2)


class ModularTransformer(nn.Module):
    """Embeddings, one pre-norm ``nn.TransformerEncoderLayer``, ``LayerNorm``, unembedding
    ``head`` read at the last (``=``) token: tokens ``(batch, 3)``, logits ``(batch, p)``."""

    def __init__(self, p: int, width: int = 32, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(p + 1, width)
        self.pos = nn.Parameter(0.02 * torch.randn(3, width))
        self.block = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, p)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.block(self.embed(tokens) + self.pos)
        return self.head(self.norm(h[:, -1]))


@dataclass(frozen=True)
class Recipe:
    """One member: training fraction, weight decay, steps and seed (of the initialisation)."""

    fraction: float
    weight_decay: float
    steps: int
    seed: int
    width: int = 32
    heads: int = 4
    lr: float = 3e-3


def train(recipe: Recipe, task: Task) -> tuple[ModularTransformer, dict]:
    """A member trained full batch on its training pairs, and its metrics: train error,
    test error on every other pair, ``gap = test - train``, ``n_train``, ``n_test``."""
    x, y = pairs(task)
    n = n_train(task, recipe.fraction)
    torch.manual_seed(recipe.seed)
    model = ModularTransformer(task.p, recipe.width, recipe.heads)
    opt = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay, betas=(0.9, 0.98)
    )
    model.train()
    for _ in range(recipe.steps):
        loss = F.cross_entropy(model(x[:n]), y[:n])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    train_error, test_error = error(model, x[:n], y[:n]), error(model, x[n:], y[n:])
    metrics = {
        "train_error": train_error,
        "test_error": test_error,
        "gap": test_error - train_error,
        "train_loss": float(cross_entropy(model, (x[:n], y[:n])).detach()),
        "n_train": n,
        "n_test": len(y) - n,
    }
    return model, metrics


def trained(recipe: Recipe, task: Task, cache: Path) -> tuple[ModularTransformer, dict]:
    """:func:`train`, or its result from ``cache`` (keyed by recipe and task); the metrics
    say ``cached``."""
    blob = json.dumps([asdict(recipe), asdict(task), CACHE_VERSION], sort_keys=True)
    path = cache / f"modular-{hashlib.sha1(blob.encode()).hexdigest()[:12]}.pt"
    cached = path.exists()
    if cached:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    else:
        model, metrics = train(recipe, task)
        saved = {"state_dict": model.state_dict(), "metrics": metrics}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(saved, tmp)
        tmp.replace(path)
    model = ModularTransformer(task.p, recipe.width, recipe.heads)
    model.load_state_dict(saved["state_dict"])
    model.eval()
    return model, {**saved["metrics"], "cached": cached}
