"""One pretrained :class:`~._vit.DigitsViT` and a population fine-tuned from it on a held-out task.

The paper's transformer populations are fine-tuned from one pretrained model with random
hyper-parameters (CLIP on ImageNet, BERT on MNLI). The same recipe on scikit-learn's digits:

- **pretraining task**: classify the digits 0–4 (all of their ~900 images, shift augmentation);
- **held-out task**: classify the digits 5–9, whose images are split into a training pool
  (half of them, or ``pool`` images) and a test set (the rest). Each member loads the
  pretrained encoder, gets a new 5-way head and is fine-tuned (AdamW, cosine decay) on the
  first ``subset`` fraction of the pool, whose labels a fraction ``label_noise`` of are
  replaced by a wrong class (:func:`training_labels`). Two populations: random learning rate,
  weight decay, epochs, batch size, label smoothing, subset and augmentation
  (:func:`population`), or a grid of label noise × training-set size × seed with the rest fixed
  (:func:`grid_population`);
- **sharpness data**: the first ``n_batches × batch`` images of the pool with the member's
  own training labels, a fixed set of points inside every member's training subset.

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

CACHE_VERSION = 2
PRETRAIN_CLASSES = (0, 1, 2, 3, 4)
FINETUNE_CLASSES = (5, 6, 7, 8, 9)


def tasks(seed: int, pool: int | None = None) -> dict[str, Tensor]:
    """Patch sequences and labels: ``pretrain`` (digits 0–4), a training pool of ``pool``
    images of the digits 5–9 (half of them by default) and a test set of the rest (labels
    0–4), in a seeded random order."""
    x, y = _vit.digits()
    pre = torch.isin(y, torch.tensor(PRETRAIN_CLASSES))
    fine = torch.isin(y, torch.tensor(FINETUNE_CLASSES)).nonzero().squeeze(1)
    fine = fine[torch.randperm(len(fine), generator=torch.Generator().manual_seed(seed))]
    cut = len(fine) // 2 if pool is None else pool
    if not 0 < cut < len(fine):
        raise ValueError(f"pool must be in (0, {len(fine)}), got {pool}")
    train, test = fine[:cut], fine[cut:]
    offset = FINETUNE_CLASSES[0]
    return {
        "x_pretrain": x[pre],
        "y_pretrain": y[pre],
        "x_train": x[train],
        "y_train": y[train] - offset,
        "x_test": x[test],
        "y_test": y[test] - offset,
    }


def sharpness_batches(
    data: dict[str, Tensor], n_batches: int, batch: int, labels: Tensor | None = None
) -> list:
    """The fixed training batches every measure uses: the pool's first ``n_batches·batch``
    images, with ``labels`` (a member's :func:`training_labels`; default the clean ones)."""
    x, y = data["x_train"], data["y_train"] if labels is None else labels
    if n_batches * batch > len(y):
        raise ValueError(f"{n_batches}×{batch} sharpness samples but only {len(y)} labels")
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
    label_noise: float = 0.0  # fraction of the pool whose training label is a wrong class


def training_labels(cfg: FineTuning, y: Tensor) -> Tensor:
    """The pool labels ``y`` as member ``cfg`` is trained on:
    ``noisy_labels(y, cfg.label_noise, cfg.seed)``."""
    return noisy_labels(y, cfg.label_noise, cfg.seed)


def noisy_labels(y: Tensor, noise: float, seed: int) -> Tensor:
    """The pool labels ``y`` with noise ``noise``: point ``i`` gets a wrong class (uniform among
    the other four) where ``u_i < noise``, with ``u_i`` uniform and the wrong class both drawn
    from a generator seeded by ``seed`` over the whole pool, so the corrupted points of a larger
    noise level contain those of a smaller one, and a subset (the pool's first entries) keeps
    the labels it has in the full pool."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(len(y), generator=gen)
    shift = torch.randint(1, len(FINETUNE_CLASSES), (len(y),), generator=gen)
    wrong = (y + shift) % len(FINETUNE_CLASSES)
    return torch.where(u < noise, wrong, y)


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


def grid_population(
    seed: int,
    noise: tuple[float, ...],
    sizes: tuple[float, ...],
    seeds: int,
    *,
    steps: int,
    lr: float,
    weight_decay: float,
    batch_size: int,
    pool: int,
) -> list[FineTuning]:
    """The grid ``noise × sizes × range(seeds)``, seed-major then size then noise (member 0:
    ``noise[0]``, ``sizes[0]``, replicate 0); every member gets ``lr``, ``weight_decay``,
    ``batch_size``, no label smoothing nor augmentation and the epochs that make about
    ``steps`` optimizer steps on its subset of the ``pool``. Replicate ``r`` has the seed
    ``1000·seed + r`` in every cell (head initialisation, batch order and the noisy labels of
    :func:`training_labels`), so two cells of a replicate differ only in their axes."""
    recipes = []
    for r in range(seeds):
        for subset in sizes:
            per_epoch = math.ceil(math.ceil(subset * pool) / batch_size)
            for eta in noise:
                recipes.append(
                    FineTuning(
                        lr=lr,
                        weight_decay=weight_decay,
                        epochs=max(1, round(steps / per_epoch)),
                        batch_size=batch_size,
                        label_smoothing=0.0,
                        subset=subset,
                        augment="none",
                        seed=1000 * seed + r,
                        label_noise=eta,
                    )
                )
    return recipes


def cache_key(*parts) -> str:
    """A short hash of ``parts`` (dataclasses as dicts) and :data:`CACHE_VERSION`: the name of
    a cached model."""
    blob = json.dumps([*parts, CACHE_VERSION], sort_keys=True, default=asdict)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def load_or_make(path: Path, make):
    """``(torch.load(path), True)``, or ``(make(), False)`` with ``make()`` saved there first
    (atomically)."""
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
    key = cache_key(cfg, len(data["y_pretrain"]))

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

    blob, _ = load_or_make(cache / f"pretrained-{key}.pt", make)
    return {**blob, "key": key}


def finetuned(
    cfg: FineTuning, base: dict, pre: Pretraining, data: dict[str, Tensor], cache: Path
) -> tuple[_vit.DigitsViT, dict]:
    """Member ``cfg`` fine-tuned from ``base`` (:func:`pretrained`) and its errors: train error on
    its own training subset with its own (noisy) labels, test error on the test set,
    ``gap = test - train``; also the train error on the clean labels and the test set size."""
    n = math.ceil(cfg.subset * len(data["y_train"]))
    x, y = data["x_train"][:n], training_labels(cfg, data["y_train"])[:n]

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
            "n_test": len(data["y_test"]),
            "clean_train_error": _vit.error(model, x, data["y_train"][:n]),
        }
        return {"state_dict": model.state_dict(), "metrics": metrics}

    blob, cached = load_or_make(
        cache / f"finetuned-{cache_key(cfg, base['key'], len(data['y_train']))}.pt", make
    )
    model = build()
    model.load_state_dict(blob["state_dict"])
    model.eval()
    return model, {**blob["metrics"], "cached": cached}
