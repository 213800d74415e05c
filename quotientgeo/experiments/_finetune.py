"""One pretrained :class:`~._vit.DigitsViT` and a population fine-tuned from it on a held-out task.

The paper's transformer populations are fine-tuned from one pretrained model with random
hyper-parameters (CLIP on ImageNet, BERT on MNLI). The same recipe on scikit-learn's digits:

- **pretraining task**: classify the digits 0–4 (all of their ~900 images, shift augmentation);
- **held-out task**: classify the digits 5–9, whose images are split in half into a training
  pool and a test set. Each member loads the pretrained encoder, gets a new 5-way head and is
  fine-tuned (AdamW, cosine decay) on the first ``subset`` fraction of the pool with random
  learning rate, weight decay, epochs, batch size, label smoothing and augmentation;
- **sharpness data**: the first ``n_batches × batch`` images of the pool, a fixed set of
  batches inside every member's training subset.

Models are cached on disk under keys that hash their whole recipe, so re-running a study only
re-measures.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import _vit

Tensor = torch.Tensor

CACHE_VERSION = 1
PRETRAIN_CLASSES = (0, 1, 2, 3, 4)
FINETUNE_CLASSES = (5, 6, 7, 8, 9)


def tasks(seed: int) -> dict[str, Tensor]:
    """Patch sequences and labels: ``pretrain`` (digits 0–4), ``train``/``test`` halves of the
    digits 5–9 (labels 0–4), the training pool in a seeded random order."""
    x, y = _vit.digits()
    pre = torch.isin(y, torch.tensor(PRETRAIN_CLASSES))
    fine = torch.isin(y, torch.tensor(FINETUNE_CLASSES)).nonzero().squeeze(1)
    fine = fine[torch.randperm(len(fine), generator=torch.Generator().manual_seed(seed))]
    train, test = fine[: len(fine) // 2], fine[len(fine) // 2 :]
    offset = FINETUNE_CLASSES[0]
    return {
        "x_pretrain": x[pre],
        "y_pretrain": y[pre],
        "x_train": x[train],
        "y_train": y[train] - offset,
        "x_test": x[test],
        "y_test": y[test] - offset,
    }


def sharpness_batches(data: dict[str, Tensor], n_batches: int, batch: int) -> list:
    """The fixed training batches every measure uses: the pool's first ``n_batches·batch``."""
    x, y = data["x_train"], data["y_train"]
    return [
        (x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]) for i in range(n_batches)
    ]


@dataclass(frozen=True)
class Pretraining:
    """The pretrained model's recipe."""

    width: int = 32
    heads: int = 4
    layers: int = 2
    lr: float = 3e-3
    weight_decay: float = 0.05
    epochs: int = 40
    batch_size: int = 64
    augment: str = "shift"
    seed: int = 0


@dataclass(frozen=True)
class FineTuning:
    """One member's fine-tuning recipe."""

    lr: float
    weight_decay: float
    epochs: int
    batch_size: int
    label_smoothing: float
    subset: float  # fraction of the training pool, its first entries
    augment: str
    seed: int


def population(n_models: int, seed: int, *, quick: bool = False) -> list[FineTuning]:
    """Random recipes: learning rate log-uniform in ``[1e-3, 5e-3]``, weight decay, epochs,
    batch size, label smoothing, training subset and augmentation drawn from small sets."""
    rng = random.Random(seed)
    return [
        FineTuning(
            lr=10 ** rng.uniform(-3.0, -2.3),
            weight_decay=rng.choice([0.0, 1e-3, 1e-2, 1e-1]),
            epochs=rng.choice([2, 3] if quick else [20, 40, 60]),
            batch_size=rng.choice([16, 32, 64]),
            label_smoothing=rng.choice([0.0, 0.1, 0.2]),
            subset=rng.choice([0.6, 0.8, 1.0]),
            augment=rng.choice(list(_vit.AUGMENTATIONS)),
            seed=seed * 1000 + i,
        )
        for i in range(n_models)
    ]


def _key(*parts) -> str:
    blob = json.dumps([*parts, CACHE_VERSION], sort_keys=True, default=asdict)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def _cached(path: Path, make):
    """``torch.load(path)``, or ``make()`` saved there first (atomically)."""
    if path.exists():
        return torch.load(path, map_location="cpu", weights_only=True), True
    blob = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    tmp.replace(path)
    return blob, False


def pretrained(cfg: Pretraining, data: dict[str, Tensor], cache: Path) -> dict:
    """``{"state_dict", "metrics", "key"}`` of the model pretrained on the digits 0–4."""
    key = _key(cfg, len(data["y_pretrain"]))

    def make():
        torch.manual_seed(cfg.seed)
        model = _vit.DigitsViT(cfg.width, cfg.heads, cfg.layers, classes=len(PRETRAIN_CLASSES))
        x, y = data["x_pretrain"], data["y_pretrain"]
        _vit.fit(
            model,
            x,
            y,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            epochs=cfg.epochs,
            batch_size=cfg.batch_size,
            seed=cfg.seed,
            augment=cfg.augment,
        )
        return {
            "state_dict": model.state_dict(),
            "metrics": {"train_error": _vit.error(model, x, y)},
        }

    blob, _ = _cached(cache / f"pretrained-{key}.pt", make)
    return {**blob, "key": key}


def finetuned(
    cfg: FineTuning, base: dict, pre: Pretraining, data: dict[str, Tensor], cache: Path
) -> tuple[_vit.DigitsViT, dict]:
    """Member ``cfg`` fine-tuned from ``base`` (:func:`pretrained`) and its errors: train error on
    its own training subset, test error on the test set, ``gap = test - train``."""
    n = math.ceil(cfg.subset * len(data["y_train"]))
    x, y = data["x_train"][:n], data["y_train"][:n]

    def build() -> _vit.DigitsViT:
        return _vit.DigitsViT(pre.width, pre.heads, pre.layers, classes=len(FINETUNE_CLASSES))

    def make():
        torch.manual_seed(cfg.seed)
        model = build()  # a new head, seeded; the encoder and embeddings from pretraining
        encoder = {k: v for k, v in base["state_dict"].items() if not k.startswith("head.")}
        model.load_state_dict(encoder, strict=False)
        _vit.fit(
            model,
            x,
            y,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            epochs=cfg.epochs,
            batch_size=cfg.batch_size,
            seed=cfg.seed,
            label_smoothing=cfg.label_smoothing,
            augment=cfg.augment,
        )
        train_error = _vit.error(model, x, y)
        test_error = _vit.error(model, data["x_test"], data["y_test"])
        metrics = {
            "train_error": train_error,
            "test_error": test_error,
            "gap": test_error - train_error,
            "n_train": n,
        }
        return {"state_dict": model.state_dict(), "metrics": metrics}

    blob, cached = _cached(cache / f"finetuned-{_key(cfg, base['key'])}.pt", make)
    model = build()
    model.load_state_dict(blob["state_dict"])
    model.eval()
    return model, {**blob["metrics"], "cached": cached}
